"""scripts/train_tiny.py --arch dgemma: the uniform-noise training forward is transformers' DiffusionGemma decoding
a canvas over its encoded prompt (left-padded batch, with and without self-conditioning), the noise is uniform over
the vocabulary at a rate t per row, and a trained directory loads back with one canvas per answer."""
import sys
from pathlib import Path

import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import train_tiny  # noqa: E402

import dllm  # noqa: E402
from dllm.engine.options import decoding_lengths  # noqa: E402
from dllm.eval.synthetic import CHARSET, make_split  # noqa: E402
from dllm.models import diffusion_gemma  # noqa: E402
from dllm.models.checkpoint import checkpoint_state  # noqa: E402
from dllm.models.loading import build_model, init_random  # noqa: E402
from dllm.models.tokenizer import build_tokenizer  # noqa: E402

TINY_VISION = dict(model_type="gemma4_vision", hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=4, position_embedding_size=8, patch_size=2)


def tiny_dgemma(canvas=24):
    tok = build_tokenizer("llada", CHARSET)
    size = dict(d=32, layers=2, heads=4, kv_heads=2, ff=64)
    model = build_model(train_tiny.dgemma_config(tok, size, 10000.0, canvas), "cpu", torch.float32)
    init_random(model, 0, std=0.2)  # large weights: attention far from uniform, so a wrong key shows
    return model.eval(), tok


def test_the_training_forward_is_transformers_decoding_a_canvas_over_its_prompt():
    model, tok = tiny_dgemma()
    ref = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(
        **{**diffusion_gemma.hf_config(model.config), "vision_config": TINY_VISION})).eval()
    missing, unexpected = ref.load_state_dict(checkpoint_state(model), strict=False)
    assert not unexpected  # missing: the vision tower, and the encoder's and head's weights (tied to the decoder's)
    assert all(k.startswith(("model.encoder.", "lm_head.")) and "layer_scalar" not in k for k in missing)
    prompts, lengths, answers = train_tiny.encode(tok, "dgemma", make_split("train", 3, families=["copy"]), 24)
    assert lengths.unique().numel() > 1  # left padding
    x = train_tiny.uniform_noise_inputs(model, prompts, lengths, answers, torch.Generator().manual_seed(0))
    canvas = x["tokens"][:, -answers.shape[1]:]
    previous = torch.randn(len(answers), answers.shape[1], model.config.vocab_size) * 3
    with torch.no_grad():
        for conditioning in (None, previous):
            ours = model.run(**x, self_conditioning=conditioning)
            for row, p in enumerate(lengths.tolist()):
                cache = DynamicCache(config=ref.config.get_text_config())
                ref.model.encoder(input_ids=prompts[row:row + 1, -p:], cache=cache)
                theirs = ref(cache=cache, decoder_input_ids=canvas[row:row + 1],
                             decoder_position_ids=torch.arange(p, p + answers.shape[1])[None],
                             self_conditioning_logits=None if conditioning is None else conditioning[row:row + 1])
                assert torch.allclose(ours[row], theirs.logits[0], atol=1e-4), (row, conditioning is None)
        assert (model.run(**x, self_conditioning=previous) - model.run(**x)).abs().max() > 0.1


def test_the_noise_is_uniform_at_a_rate_per_row():
    model, tok = tiny_dgemma(canvas=48)
    prompts, lengths, answers = train_tiny.encode(tok, "dgemma", make_split("train", 400, families=["copy"]), 48)
    noisy = train_tiny.uniform_noise_inputs(model, prompts, lengths, answers, torch.Generator().manual_seed(1)
                                            )["tokens"][:, -48:]
    changed = (noisy != answers).float().mean(1)
    assert changed.min() < 0.1 and changed.max() > 0.85  # t ~ U(0, 1) per row
    drawn = torch.bincount(noisy[noisy != answers], minlength=model.config.vocab_size)
    assert drawn.min() > 0 and drawn.max() < 2 * drawn.float().mean()  # every id, none much more often


def test_a_trained_dgemma_saves_and_loads_back_with_one_canvas_per_answer(tmp_path):
    out = tmp_path / "tiny-dgemma"
    train_tiny.main(["--arch", "dgemma", "--out", str(out), "--state", str(tmp_path / "state"), "--steps", "2",
                     "--d", "16", "--layers", "2", "--heads", "2", "--batch-size", "4", "--train-per-family", "20",
                     "--eval-per-family", "1", "--eval-every", "2", "--save-every", "1"])
    model, tok = dllm.load(str(out))
    cfg = model.config
    assert (cfg.arch, cfg.mask_id, cfg.canvas_length, cfg.tied_head) == ("diffusion_gemma", None, 48, True)
    assert cfg.stop_ids == tuple(sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")}))
    assert decoding_lengths(model) == {"gen_length": 48, "block_length": 48, "steps": 48}
