"""scripts/train_tiny.py --arch wedlm: the dual-stream training forward computes each noisy block as streaming
decoding computes a window after a committed prefix, the clean stream as a plain causal forward; the noise is
round(n * gamma) masks per block; a trained directory loads back as a causal WeDLM."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import train_tiny  # noqa: E402

import dllm  # noqa: E402
from dllm.eval.synthetic import CHARSET, make_split  # noqa: E402
from dllm.models.loading import build_model, init_random  # noqa: E402
from dllm.models.tokenizer import build_tokenizer  # noqa: E402
from dllm.models.transformer import visible_keys  # noqa: E402

BLOCK = 4


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer("dream", CHARSET)
    size = dict(d=32, layers=2, heads=4, kv_heads=2, ff=64)
    model = build_model(train_tiny.model_config("wedlm", tok, size, 10000.0), "cpu", torch.float32)
    init_random(model, 0, std=0.2)  # large weights: attention far from uniform, so a wrong key shows
    return model.eval(), tok


def test_noisy_blocks_are_computed_as_decoding_computes_its_window(tiny):
    """For rows of different prompt lengths (left padding): each noisy answer token's row equals, on the canvas
    [prompt | clean answer before its block | the block with its masks in place], the rank rule's forward (filled
    slots before masks, RoPE at the canvas positions) that the window layout decodes with; each clean row before an
    answer token equals a plain causal forward of the clean sequence."""
    model, tok = tiny
    cfg = model.config
    examples = make_split("train", 6, families=["copy"])
    prompts, lengths, answers = train_tiny.encode(tok, "wedlm", examples, 24)
    assert lengths.unique().numel() > 2
    x = train_tiny.wedlm_inputs(cfg, prompts, lengths, answers, torch.Generator().manual_seed(0), BLOCK)
    with torch.no_grad():
        doubled = model.run(x["tokens"], x["positions"], x["key_mask"], logit_rows=x["logit_rows"])
    n = answers.shape[1]
    mixed = 0
    for row in range(len(examples)):
        p = int(lengths[row])
        clean = prompts[row, -p:].tolist() + answers[row].tolist()
        with torch.no_grad():
            plain = model(torch.tensor([clean]))[0]
        assert torch.allclose(doubled[row, n:], plain[p - 1:-1], atol=1e-4)  # the AR rows
        noisy = torch.where(x["masked"][row], cfg.mask_id, answers[row])
        shift = int(x["shift"][row])
        for b in range((p + shift) // BLOCK, (p + n - 1 + shift) // BLOCK + 1):
            lo, hi = max(b * BLOCK - shift, p), min((b + 1) * BLOCK - shift, p + n)
            canvas = torch.tensor([clean[:lo] + noisy[lo - p:hi - p].tolist()])
            unfilled = torch.zeros_like(canvas, dtype=torch.bool)
            unfilled[0, lo:] = x["masked"][row, lo - p:hi - p]
            steps = torch.arange(hi)[None]
            ranks = steps + hi * unfilled
            with torch.no_grad():
                want = model.run(canvas, steps, visible_keys(cfg, ranks, ranks, None))[0, lo:hi]
            assert torch.allclose(doubled[row, lo - p:hi - p], want, atol=1e-4), (row, b)
            mixed += bool(unfilled[0, lo:].any() and not unfilled[0, lo:].all())
    assert mixed > 3  # blocks with filled slots and masks: the reordering was tested


def test_each_block_masks_round_n_gamma_of_its_answer_tokens(tiny):
    model, tok = tiny
    prompts, lengths, answers = train_tiny.encode(tok, "wedlm", make_split("train", 8, families=["add"]), 48)
    x = train_tiny.wedlm_inputs(model.config, prompts, lengths, answers, torch.Generator().manual_seed(1), BLOCK)
    blocks = (lengths[:, None] + torch.arange(answers.shape[1]) + x["shift"]) // BLOCK
    for row in range(len(lengths)):
        for b in blocks[row].unique():
            inside = blocks[row] == b
            assert x["gamma"][row, inside].unique().numel() == 1
            assert int(x["masked"][row, inside].sum()) == round(int(inside.sum()) * float(x["gamma"][row, inside][0]))
        assert x["gamma"][row].unique().numel() > 1


def test_a_block_starts_at_every_answer_position_whatever_the_prompt_length(tiny):
    """Decoding's window starts at any committed front, so for one prompt length (a synthetic family has a few) a
    training block must start at each answer position in some rows: with blocks aligned at the row's start, the
    boundaries before the answer sat at one place per prompt length (tiny-wedlm's first training, RESULTS.md)."""
    model, tok = tiny
    prompts, lengths, answers = train_tiny.encode(tok, "wedlm", make_split("train", 64, families=["copy"]), 24)
    keep = lengths == lengths.mode().values
    x = train_tiny.wedlm_inputs(model.config, prompts[keep], lengths[keep], answers[keep],
                                torch.Generator().manual_seed(3), BLOCK)
    blocks = (lengths[keep, None] + torch.arange(answers.shape[1]) + x["shift"]) // BLOCK
    starts = {int(i) for row in blocks for i in torch.nonzero(row[1:] != row[:-1])[:, 0] + 1}
    assert keep.sum() >= 8 and set(range(1, BLOCK + 1)) <= starts


def test_the_loss_is_the_mean_of_the_masked_and_the_ar_loss(tiny):
    """ar_weight 0 leaves the masked loss alone; its 1/gamma weighted mean and the AR mean average to the loss."""
    model, tok = tiny
    prompts, lengths, answers = train_tiny.encode(tok, "wedlm", make_split("train", 4, families=["sort"]), 48)
    answers = answers[:, :int((answers != tok.eos_token_id).sum(1).max()) + BLOCK - 1]  # what the loss feeds
    args = (model, prompts, lengths, answers)
    with torch.no_grad():
        both = train_tiny.wedlm_loss(*args, torch.Generator().manual_seed(2), BLOCK)
        mlm = train_tiny.wedlm_loss(*args, torch.Generator().manual_seed(2), BLOCK, ar_weight=0.0)
        ar_only = 2 * both - mlm
        x = train_tiny.wedlm_inputs(model.config, prompts, lengths, answers, torch.Generator().manual_seed(2), BLOCK)
        logits = model.run(x["tokens"], x["positions"], x["key_mask"], logit_rows=x["logit_rows"])
    ar = torch.nn.functional.cross_entropy(logits[:, answers.shape[1]:].flatten(0, 1), answers.flatten())
    assert float(ar_only) == pytest.approx(float(ar), rel=1e-5)


def test_a_trained_wedlm_saves_and_loads_back(tmp_path):
    out = tmp_path / "tiny-wedlm"
    train_tiny.main(["--arch", "wedlm", "--out", str(out), "--state", str(tmp_path / "state"), "--steps", "2",
                     "--d", "16", "--layers", "1", "--heads", "2", "--batch-size", "4", "--train-per-family", "20",
                     "--eval-per-family", "1", "--eval-every", "2"])
    model, tok = dllm.load(str(out))
    cfg = model.config
    assert (cfg.arch, cfg.causal, cfg.block_size, cfg.qk_norm, cfg.qkv_bias, cfg.logit_shift) == \
        ("wedlm", True, 0, True, False, 0)
    assert cfg.stop_ids == tuple(sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}))
