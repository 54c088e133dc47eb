"""LLaDA (GSAI-ML/LLaDA-8B-*): OLMo-style checkpoint names, MHA, no bias, aligned logits (spec `models.md` 1.1, 2.1)."""
from __future__ import annotations

from .transformer import ModelConfig, end_ids

MODEL_TYPE = "llada"
TOKENIZER_STYLE = "llada"  # of the character tokenizer a random: model gets
END_OF_TURN = "<|eot_id|>"
AUTHORS_DECODING = "ML-GSAI/LLaDA generate.py: low_confidence, temperature 0, cfg_scale 0"  # as ours

# checkpoint name -> our parameter name ({i} = layer index)
WEIGHT_NAMES = {
    "model.transformer.wte.weight": "embed.weight",
    "model.transformer.ln_f.weight": "norm.weight",
    "model.transformer.ff_out.weight": "lm_head.weight",
    "model.transformer.blocks.{i}.attn_norm.weight": "layers.{i}.attn_norm.weight",
    "model.transformer.blocks.{i}.q_proj.weight": "layers.{i}.qkv_proj.weight:q",  # :shard = rows of a fused one
    "model.transformer.blocks.{i}.k_proj.weight": "layers.{i}.qkv_proj.weight:k",
    "model.transformer.blocks.{i}.v_proj.weight": "layers.{i}.qkv_proj.weight:v",
    **{f"model.transformer.blocks.{{i}}.{p}_proj.bias": f"layers.{{i}}.qkv_proj.bias:{p}"  # include_qkv_bias
       for p in "qkv"},
    "model.transformer.blocks.{i}.attn_out.weight": "layers.{i}.o_proj.weight",
    "model.transformer.blocks.{i}.ff_norm.weight": "layers.{i}.mlp_norm.weight",
    "model.transformer.blocks.{i}.ff_proj.weight": "layers.{i}.gate_up_proj.weight:gate",  # the silu branch
    "model.transformer.blocks.{i}.up_proj.weight": "layers.{i}.gate_up_proj.weight:up",
    "model.transformer.blocks.{i}.ff_out.weight": "layers.{i}.down_proj.weight",  # not the LM head
}

# Fields whose values our implementation assumes; anything else is a different network.
_REQUIRED = {"block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu", "rope": True,
             "alibi": False, "weight_tying": False, "include_bias": False, "attention_layer_norm": False,
             "scale_logits": False, "input_emb_norm": False}


def config_from_hf(hf: dict, end_of_turn_id: int | None = None) -> ModelConfig:
    for key, want in _REQUIRED.items():
        if key in hf and hf[key] != want and not (key == "include_bias" and hf.get("include_qkv_bias")):
            raise ValueError(f"config.json has {key}={hf[key]!r}; this LLaDA implementation needs {want!r}")
    if hf.get("rope_scaling"):
        raise ValueError(f"config.json has rope_scaling={hf['rope_scaling']!r}; only default RoPE is supported")
    n_heads = hf["n_heads"]
    return ModelConfig(
        arch="llada", vocab_size=hf.get("embedding_size") or hf["vocab_size"], hidden_size=hf["d_model"],
        intermediate_size=hf.get("mlp_hidden_size") or hf["mlp_ratio"] * hf["d_model"],
        n_layers=hf["n_layers"], n_heads=n_heads, n_kv_heads=hf.get("n_kv_heads") or n_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5), rope_theta=hf.get("rope_theta", 10000.0),
        qkv_bias=bool(hf.get("include_qkv_bias", False)), logit_shift=0,
        mask_id=hf.get("mask_token_id", 126336), max_length=hf.get("max_sequence_length", 4096),
        **end_ids(hf, 126081, 126348 if end_of_turn_id is None else end_of_turn_id))


def hf_config(cfg: ModelConfig) -> dict:
    """The `config.json` fields of a checkpoint with this architecture (for saving our own models)."""
    return {"model_type": MODEL_TYPE, "architectures": ["LLaDAModelLM"], "d_model": cfg.hidden_size,
            "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
            "mlp_hidden_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
            "embedding_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "max_sequence_length": cfg.max_length, "mask_token_id": cfg.mask_id, "eos_token_id": cfg.filler_id,
            "pad_token_id": cfg.pad_id, **_REQUIRED, "include_qkv_bias": cfg.qkv_bias}


def _preset(d, layers, heads, ff, vocab, max_length=4096, **ids) -> ModelConfig:
    ids = ids or dict(mask_id=vocab - 1, pad_id=vocab - 2, stop_ids=(vocab - 3, vocab - 2), filler_id=vocab - 2)
    return ModelConfig(arch="llada", vocab_size=vocab, hidden_size=d, intermediate_size=ff, n_layers=layers,
                       n_heads=heads, n_kv_heads=heads, rms_norm_eps=1e-5, rope_theta=500000.0, qkv_bias=False,
                       logit_shift=0, max_length=max_length, **ids)


PRESETS = {
    "llada-8b": _preset(4096, 32, 32, 12288, 126464, mask_id=126336, pad_id=126081,
                        stop_ids=(126081, 126348), filler_id=126081),
    "llada-small": _preset(640, 10, 10, 1728, 32768),  # ~92M parameters, for CPU speed runs
    "llada-tiny": _preset(64, 2, 4, 96, 128, max_length=512),  # for tests
}
