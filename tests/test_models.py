"""Native LLaDA/Dream equal transformers' Llama/Qwen2 on the same weights (spec models.md section 6)."""
import json

import pytest
import torch
from conftest import shared_path
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import dllm
from dllm.models import DiffusionLM, dream, llada
from dllm.models.checkpoint import checkpoint_state, save_pretrained, weight_names
from dllm.models.loading import load_weights

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            tie_word_embeddings=False)


def _randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


# transformers Llama names -> official LLaDA names
LLAMA_TO_LLADA = {
    "model.embed_tokens.weight": "model.transformer.wte.weight",
    "model.norm.weight": "model.transformer.ln_f.weight",
    "lm_head.weight": "model.transformer.ff_out.weight",
    "model.layers.{i}.input_layernorm.weight": "model.transformer.blocks.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "model.transformer.blocks.{i}.q_proj.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "model.transformer.blocks.{i}.k_proj.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "model.transformer.blocks.{i}.v_proj.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "model.transformer.blocks.{i}.attn_out.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "model.transformer.blocks.{i}.ff_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "model.transformer.blocks.{i}.ff_proj.weight",
    "model.layers.{i}.mlp.up_proj.weight": "model.transformer.blocks.{i}.up_proj.weight",
    "model.layers.{i}.mlp.down_proj.weight": "model.transformer.blocks.{i}.ff_out.weight",
}


def _reference(arch):
    if arch == "llada":
        cfg = LlamaConfig(**TINY, num_key_value_heads=4, rms_norm_eps=1e-5, rope_theta=5e5, attention_bias=False,
                          mlp_bias=False, attn_implementation="sdpa")
        ref = LlamaForCausalLM(cfg)
        hf = dict(model_type="llada", d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=96,
                  vocab_size=128, embedding_size=128, rms_norm_eps=1e-5, rope_theta=5e5, mask_token_id=127,
                  eos_token_id=126, pad_token_id=126)
        rename = weight_names(LLAMA_TO_LLADA, 2)
    else:
        cfg = Qwen2Config(**TINY, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6, use_sliding_window=False,
                          attn_implementation="sdpa")
        ref = Qwen2ForCausalLM(cfg)
        hf = dict(model_type="Dream", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, vocab_size=128, rms_norm_eps=1e-6, rope_theta=1e6,
                  mask_token_id=127, eos_token_id=126, pad_token_id=126)
        rename = None
    _randomize(ref)
    state = {(rename[k] if rename else k): v for k, v in ref.state_dict().items()}
    return ref.eval(), hf, state


def _write_checkpoint(path, hf, state):
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))


def _native(arch, hf, state, tmp_path):
    mod = llada if arch == "llada" else dream
    model = DiffusionLM(mod.config_from_hf(hf))
    _write_checkpoint(tmp_path, hf, state)
    load_weights(model, tmp_path, mod.WEIGHT_NAMES)
    return model.eval()


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_logits_equal_transformers(arch, tmp_path):
    ref, hf, state = _reference(arch)
    model = _native(arch, hf, state, tmp_path)
    ids = torch.randint(0, 120, (2, 12), generator=torch.Generator().manual_seed(1))
    visible = torch.ones(2, 1, 12, 12, dtype=torch.bool)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=visible).logits
        causal = ref(input_ids=ids).logits
        raw = model.run(ids, torch.arange(12).expand(2, 12), None, None)
        aligned = model(ids)
    assert (raw - want).abs().max() < 1e-4
    assert (want - causal).abs().max() > 1e-2  # the all-visible mask took effect
    if arch == "dream":  # aligned[i] = raw[i-1]
        assert torch.equal(aligned[:, 1:], raw[:, :-1]) and torch.equal(aligned[:, 0], raw[:, 0])
    else:
        assert torch.equal(aligned, raw)


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_left_padding_matches_reference(arch, tmp_path):
    ref, hf, state = _reference(arch)
    model = _native(arch, hf, state, tmp_path)
    ids = torch.randint(0, 120, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, :3] = False
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask[:, None, None, :].expand(2, 1, 10, 10),
                   position_ids=positions).logits
        got = model.run(ids, positions, mask[:, None, None, :], None)
        alone = model.run(ids[:1, 3:], torch.arange(7)[None], None, None)
    assert (got[mask] - want[mask]).abs().max() < 1e-4
    assert (got[0, 3:] - alone[0]).abs().max() < 1e-5  # a padded row equals the prompt alone


def test_official_llada_names_load(tmp_path):
    """A fake checkpoint with the real LLaDA-8B-Instruct config fields and tensor names (shrunk) loads."""
    hf = json.loads(shared_path("data", "llada-8b-instruct", "config.json").read_text())
    index = json.loads(shared_path("data", "llada-8b-instruct", "model.safetensors.index.json").read_text())
    official = set(index["weight_map"])
    hf.update(d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=48, vocab_size=126464,
              embedding_size=126464)
    cfg = llada.config_from_hf(hf)
    assert (cfg.mask_id, cfg.pad_id, cfg.rope_theta, cfg.rms_norm_eps) == (126336, 126081, 500000.0, 1e-5)
    names = weight_names(llada.WEIGHT_NAMES, 32)
    assert {n for n in names if not n.endswith(".bias")} == official  # exactly the official 8B names (+ the
    # q/k/v biases of include_qkv_bias configs)
    model = DiffusionLM(cfg)
    _randomize(model)
    _write_checkpoint(tmp_path, hf, checkpoint_state(model))
    loaded = DiffusionLM(cfg)
    load_weights(loaded, tmp_path, llada.WEIGHT_NAMES)
    ids = torch.randint(0, 1000, (1, 6))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


@pytest.mark.parametrize("preset,params", [("llada-8b", 8_015_581_184), ("dream-7b", 7_615_616_512)])
def test_official_shapes(preset, params):
    from dllm.models import PRESETS
    assert PRESETS[preset].num_parameters() == params


@pytest.mark.parametrize("preset", ["llada-tiny", "dream-tiny"])
def test_save_and_load_roundtrip(preset, tmp_path):
    model, tok = dllm.load(f"random:{preset}", seed=3)
    save_pretrained(model, tok, tmp_path)
    loaded, tok2 = dllm.load(str(tmp_path))
    assert (loaded.config.mask_id, loaded.config.pad_id, loaded.config.arch) == \
        (model.config.mask_id, model.config.pad_id, model.config.arch)
    ids = torch.randint(0, 100, (1, 8))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_official_llada_chat_template_renders_through_our_prompt_path():
    """The real LLaDA-8B-Instruct template (with its always-appended assistant header) gives the prompt our
    loop encodes; our tiny tokenizers render the same format."""
    from dllm.engine.text import encode_prompts
    from dllm.models.tokenizer import build_char_tokenizer

    official = json.loads(shared_path("data", "llada-8b-instruct", "tokenizer_config.json").read_text())
    assert official["bos_token"] == "<|startoftext|>"
    tok = build_char_tokenizer("llada")
    want = "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nadd: 1+2<|eot_id|>" \
           "<|start_header_id|>assistant<|end_header_id|>\n\n"
    for template in (official["chat_template"], tok.chat_template):
        tok.chat_template = template
        ids = encode_prompts(tok, [" add: 1+2 "], chat=True)[0]
        assert tok.decode(ids) == want


def test_fused_projection_gives_the_same_parts_both_ways():
    """The GPU path (one matmul, then split) and the CPU path (a matmul per row block) agree."""
    from dllm.models.transformer import fused_linear
    layer = torch.nn.Linear(16, 8 + 4 + 4, bias=True)
    x = torch.randn(2, 5, 16)
    one, per_part = fused_linear(x, layer, (8, 4, 4), per_part=False), fused_linear(x, layer, (8, 4, 4), per_part=True)
    assert [p.shape[-1] for p in one] == [8, 4, 4]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(one, per_part))


def test_same_layout_checkpoints_stop_where_their_answers_end(tmp_path):
    """LLaDA-8B-Base/-Instruct/1.5 stop at <|endoftext|> 126081 and <|eot_id|> 126348 (the real ids, from the
    presets); a Dream-layout checkpoint whose tokenizer has DiffuCoder's <|dlm_pad|> stops there too."""
    from dllm.models import PRESETS

    assert set(PRESETS["llada-8b"].stop_ids) == {126081, 126348}
    model, tok = dllm.load("random:dream-tiny", seed=3)
    save_pretrained(model, tok, tmp_path / "dream")
    tok.add_special_tokens({"additional_special_tokens": ["<|dlm_pad|>"]})
    save_pretrained(model, tok, tmp_path / "diffucoder")
    plain, _ = dllm.load(str(tmp_path / "dream"))
    padded, tok2 = dllm.load(str(tmp_path / "diffucoder"))
    pad = tok2.convert_tokens_to_ids("<|dlm_pad|>")
    assert pad not in plain.config.stop_ids
    assert set(padded.config.stop_ids) == {*plain.config.stop_ids, pad}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary", [16, 8])
def test_rope_equals_rotate_half_bit_for_bit(dtype, rotary):
    """`rope`'s roll with a signed sin table gives exactly rotate-half RoPE (x cos + rotate_half(x) sin, fp32),
    full and partial (LLaDA2's first R dims)."""
    from dllm.models.transformer import rope

    x = torch.randn(2, 3, 5, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    angles = torch.randn(2, 5, rotary // 2, generator=torch.Generator().manual_seed(1))
    cos, sin = torch.cat((angles.cos(),) * 2, -1)[:, None], torch.cat((angles.sin(),) * 2, -1)[:, None]
    xf = x[..., :rotary].float()
    half = torch.cat((-xf[..., rotary // 2:], xf[..., :rotary // 2]), -1)
    want = torch.cat(((xf * cos + half * sin).to(dtype), x[..., rotary:]), -1)
    signed = torch.cat((-angles.sin(), angles.sin()), -1)[:, None]
    assert torch.equal(rope(x, cos, signed), want)
