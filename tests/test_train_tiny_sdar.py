"""scripts/train_tiny.py --arch sdar: the block-diffusion training forward is the engine's block-causal decoding
forward, and a trained directory loads back."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import train_tiny  # noqa: E402

import dllm  # noqa: E402
from dllm.eval.synthetic import CHARSET, make_split  # noqa: E402
from dllm.models.loading import build_model, init_random  # noqa: E402
from dllm.models.tokenizer import build_tokenizer  # noqa: E402


def tiny_sdar(block_size=4):
    tok = build_tokenizer("dream", CHARSET)
    size = dict(d=32, layers=2, heads=4, kv_heads=2, ff=64)
    model = build_model(train_tiny.model_config("sdar", tok, size, 10000.0, block_size), "cpu", torch.float32)
    init_random(model, 0, std=0.2)  # large weights: attention far from uniform, so a wrong key shows
    return model.eval(), tok


def test_noisy_block_sees_itself_and_the_clean_blocks_before_it():
    """The noisy copy of block b gets the logits of a plain block-causal forward of [clean blocks < b | noisy
    block b], and the clean copy those of x0, for rows of different prompt lengths (left padding)."""
    model, tok = tiny_sdar()
    cfg = model.config
    examples = make_split("train", 6, families=["copy"])  # prompts of several lengths: left padding
    prompts, lengths, answers = train_tiny.encode(tok, "sdar", examples, 24)
    assert lengths.unique().numel() > 2
    x = train_tiny.block_diffusion_inputs(cfg, prompts, lengths, answers, torch.Generator().manual_seed(0))
    with torch.no_grad():
        doubled = model.run(x["tokens"], x["positions"], x["key_mask"])
    width, n_answer = int(lengths.max()), answers.shape[1]
    n_noisy = x["tokens"].shape[1] - width - n_answer
    for row in range(len(examples)):
        p = int(lengths[row])
        ids = prompts[row, -p:].tolist()
        clean, noisy = ids + answers[row].tolist(), ids + x["tokens"][row, n_noisy - n_answer:n_noisy].tolist()
        with torch.no_grad():
            plain = model(torch.tensor([clean]))[0]
        assert torch.allclose(doubled[row, n_noisy + width - p:], plain, atol=1e-4)  # the clean copy
        first, last = p // cfg.block_size, (p + n_answer - 1) // cfg.block_size
        for b in range(first, last + 1):  # each answer block, noisy, after clean blocks
            lo, hi = b * cfg.block_size, min((b + 1) * cfg.block_size, p + n_answer)
            mixed = clean[:lo] + noisy[lo:hi]
            with torch.no_grad():
                plain = model(torch.tensor([mixed]))[0, max(lo, p):hi]
            cols = torch.arange(max(lo, p), hi) - p + x["logit_rows"][row, 0]
            assert torch.allclose(doubled[row, cols], plain, atol=1e-4), (row, b)
            if noisy[:lo] != clean[:lo]:  # the test can tell: the noisy earlier blocks give other logits
                with torch.no_grad():
                    wrong = model(torch.tensor([noisy[:hi]]))[0, max(lo, p):hi]
                assert not torch.allclose(doubled[row, cols], wrong, atol=1e-4)


def test_noise_is_drawn_per_block():
    model, tok = tiny_sdar()
    prompts, lengths, answers = train_tiny.encode(tok, "sdar", make_split("train", 4, families=["add"]), 48)
    x = train_tiny.block_diffusion_inputs(model.config, prompts, lengths, answers, torch.Generator().manual_seed(1))
    blocks = (lengths[:, None] + torch.arange(answers.shape[1])) // model.config.block_size
    for row in range(len(lengths)):
        for b in blocks[row].unique():
            assert x["t"][row, blocks[row] == b].unique().numel() == 1
        assert x["t"][row].unique().numel() > 1


def test_a_trained_sdar_saves_and_loads_back(tmp_path):
    out = tmp_path / "tiny-sdar"
    train_tiny.main(["--arch", "sdar", "--out", str(out), "--state", str(tmp_path / "state"), "--steps", "2",
                     "--d", "16", "--layers", "1", "--heads", "2", "--batch-size", "4", "--train-per-family", "20",
                     "--eval-per-family", "1", "--eval-every", "2"])
    model, tok = dllm.load(str(out))
    cfg = model.config
    assert (cfg.arch, cfg.block_size, cfg.qk_norm, cfg.qkv_bias, cfg.logit_shift) == ("sdar", 4, True, False, 0)
    assert cfg.stop_ids == tuple(sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}))
