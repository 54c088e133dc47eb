"""Nemotron-Labs-Diffusion (NVIDIA, 3B / 8B; spec `new_families.md` section 3): Ministral 3 trained at once as a
causal LM and a masked block-diffusion LM. Mistral's layer names under `encoder.`, the untied head
`diffusion_head`, GQA with head_dim 128, no biases, YaRN RoPE and Llama 4's per-position query scale after RoPE
(as transformers' Ministral 3), mask id 100, position-aligned logits.

Attention is NVIDIA's two modes (`generate_with_prefix_cache_block_diff`; vLLM PR 48279): the prompt and every
finished block are encoded causally, the block being decoded sees itself and everything before it
(`ModelConfig.causal_prefix`). Blocks of 32 start at the prompt's end; the exact `block` cache applies. Each
block's first token is the causal next-token prediction (NVIDIA's `causal_context`, the samplers'
`causal_first`), by default as NVIDIA's `generate_diffusion` does; `causal_first=False` starts blocks all-mask, as
vLLM's version."""
from __future__ import annotations

import dllm.models.dream as dream

from .rope_scaling import YaRN
from .transformer import ModelConfig, end_ids

MODEL_TYPE = "nemotron_labs_diffusion"
HF_CLASSES = ("NemotronLabsDiffusionModel", "MinistralDiffEncoderModel")  # released name; NVIDIA's code, vLLM's
END_OF_TURN = "</s>"  # Mistral's end of turn; config.json's eos (11, the tokenizer's pad) fills after the answer
TOKENIZER_STYLE = "llada"  # of the character tokenizer a random: model gets
BLOCK_SIZE = 32  # config.json `block_size`: the block it was trained and decodes in
AUTHORS_DECODING = ("NVIDIA's generate_diffusion: each block seeded with the causal next token (causal_context), "
                    "low_confidence, temperature 0")


def decoding(cfg: ModelConfig, generation: dict) -> dict:
    """How NVIDIA decodes (`AUTHORS_DECODING`): `generate_diffusion` defaults to causal_context=True, so every
    sampler that takes `causal_first` gets it on (`causal_first=False`: vLLM's all-mask blocks)."""
    return {"any_sampler_args": {"causal_first": True}}

WEIGHT_NAMES = {  # Mistral's names (Dream's table without biases), the backbone under `encoder.`
    ("diffusion_head.weight" if ckpt == "lm_head.weight" else ckpt.replace("model.", "encoder.", 1)): ours
    for ckpt, ours in dream.WEIGHT_NAMES.items() if not ckpt.endswith(".bias")
}

# Ministral 3's RoPE when config.json names none (transformers' `Ministral3Config` defaults)
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings":
                   16384, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "llama_4_scaling_beta": 0.1}

# Fields whose values this implementation assumes; anything else is a different network.
_REQUIRED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
             "dlm_type": "llada", "num_ar_layers": 0, "num_diffusion_layers": 0}


def config_from_hf(hf: dict, end_of_turn_id: int | None = None) -> ModelConfig:
    for key, want in _REQUIRED.items():
        if key in hf and hf[key] != want:
            raise ValueError(f"config.json has {key}={hf[key]!r}; this Nemotron-Labs-Diffusion implementation needs "
                             f"{want!r}")
    if hf.get("sliding_window"):
        raise ValueError(f"config.json has sliding_window={hf['sliding_window']!r}; this implementation needs full "
                         f"attention")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or MINISTRAL3_ROPE
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("yarn", "default"):
        raise ValueError(f"config.json has RoPE type {kind!r}; this implementation reads yarn or default")
    max_length = hf.get("max_position_embeddings", 262144)
    beta = rope.get("llama_4_scaling_beta")
    heads = hf["num_attention_heads"]
    return ModelConfig(
        arch="nemotron_diffusion", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=rope.get("rope_theta", hf.get("rope_theta", 1000000.0)), qkv_bias=False, logit_shift=0,
        mask_id=hf.get("mask_token_id", 100), **end_ids(hf, 11, end_of_turn_id), max_length=max_length,
        head_size=hf.get("head_dim") or 0, yarn=YaRN.from_hf(rope, max_length) if kind == "yarn" else None,
        query_scale=(float(beta), rope["original_max_position_embeddings"]) if beta else None, causal_prefix=True)


def hf_config(cfg: ModelConfig) -> dict:
    rope = cfg.yarn.to_hf(cfg.rope_theta) if cfg.yarn else {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.query_scale:
        rope.update(llama_4_scaling_beta=cfg.query_scale[0], original_max_position_embeddings=cfg.query_scale[1])
    return {"model_type": MODEL_TYPE, "architectures": [HF_CLASSES[0]], "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "rope_parameters": rope,
            "max_position_embeddings": cfg.max_length, "block_size": BLOCK_SIZE, "dlm_paradigm": "bidirectional",
            "mask_token_id": cfg.mask_id, "pad_token_id": cfg.pad_id,
            "eos_token_id": [cfg.filler_id, *(i for i in cfg.stop_ids if i != cfg.filler_id)],
            "bos_token_id": 1, **{k: v for k, v in _REQUIRED.items() if not k.startswith("num_")}}


def _preset(d, layers, heads, kv_heads, head_dim, ff, vocab, original, max_length, **ids) -> ModelConfig:
    ids = ids or dict(mask_id=vocab - 1, pad_id=vocab - 2, stop_ids=(vocab - 3, vocab - 2), filler_id=vocab - 2)
    return ModelConfig(arch="nemotron_diffusion", vocab_size=vocab, hidden_size=d, intermediate_size=ff,
                       n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, rms_norm_eps=1e-5, rope_theta=1000000.0,
                       qkv_bias=False, logit_shift=0, max_length=max_length, head_size=head_dim,
                       yarn=YaRN(16.0, original), query_scale=(0.1, original), causal_prefix=True, **ids)


PRESETS = {  # 8B: the released config.json as the spec quotes it (second-hand)
    "nemotron-diffusion-8b": _preset(4096, 34, 32, 8, 128, 14336, 131072, 16384, 262144, mask_id=100, pad_id=11,
                                     stop_ids=(11,), filler_id=11),
    "nemotron-diffusion-tiny": _preset(64, 2, 4, 2, 16, 96, 128, 64, 1024),  # the query scale grows from position 64
}
