"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B): a full-attention masked-diffusion LM with OLMoE-style MoE layers (spec
`block_diffusion_moe.md` section 3). Qwen3-MoE checkpoint names, per-head q/k RMSNorm before RoPE, a softmax
router whose top-k probabilities are used as they are (dInfer's block fixes `norm_topk_prob` off), an optional
expert bias added to the probabilities, optional dense layers and shared expert; position-aligned logits."""
from __future__ import annotations

import dllm.models.dream as dream
import dllm.models.sdar as sdar

from .moe import MoEConfig, swiglu_names
from .transformer import ModelConfig, end_ids

MODEL_TYPE = "llada"  # as LLaDA's: `dllm.models.architecture_of` tells them apart by class and `num_experts`
HF_CLASSES = ("LLaDAMoEModelLM", "FusedLLaDAMoEModelLM")
END_OF_TURN = "<|role_end|>"
AUTHORS_DECODING = "LLaDA's generate.py (the LLaDA-MoE model card): low_confidence, temperature 0"  # as ours
TOKENIZER_STYLE = "llada"  # of the character tokenizer a random: model gets

_LAYER = "model.layers.{i}."
WEIGHT_NAMES = {  # Qwen3-MoE's names (SDAR's table) with optional q/k/v biases (Dream's), expert bias, shared expert
    **dream.WEIGHT_NAMES,
    **sdar.WEIGHT_NAMES,
    _LAYER + "mlp.expert_bias": "layers.{i}.moe.expert_bias",
    **swiglu_names(_LAYER + "shared_expert.", "layers.{i}.moe.shared.gate_up_proj.weight",
                   "layers.{i}.moe.shared.down_proj.weight"),
}


def config_from_hf(hf: dict, end_of_turn_id: int | None = None) -> ModelConfig:
    for key in ("tie_word_embeddings", "rope_scaling", "clip_qkv"):
        if hf.get(key):
            raise ValueError(f"config.json has {key}={hf[key]!r}; this LLaDA-MoE implementation does not support it")
    if hf.get("moe_router_score_function", "softmax") not in (None, "softmax"):
        raise ValueError(f"config.json has moe_router_score_function={hf['moe_router_score_function']!r}; "
                         f"LLaDA-MoE routes with a softmax")
    layers = hf["num_hidden_layers"]
    routed = [bool(x) for x in hf.get("moe_layer_freq") or [1] * layers]
    dense = routed.index(True) if True in routed else layers
    if len(routed) != layers or not all(routed[dense:]):
        raise ValueError(f"config.json has moe_layer_freq={hf.get('moe_layer_freq')!r}; only leading dense layers "
                         f"followed by MoE layers are supported")
    heads, d = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or d // heads
    moe = MoEConfig(n_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                    expert_size=hf["expert_intermediate_size"],
                    shared_size=hf.get("shared_expert_intermediate_size") or 0, dense_layers=dense,
                    router="softmax", expert_bias=bool(hf.get("moe_router_enable_expert_bias")))
    return ModelConfig(
        arch="llada_moe", vocab_size=hf["vocab_size"], hidden_size=d,
        intermediate_size=hf.get("dense_intermediate_size") or 0, n_layers=layers, n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=hf["rope_theta"], qkv_bias=bool(hf.get("attention_bias")), logit_shift=0,
        mask_id=hf.get("mask_token_id", 156895), **end_ids(hf, 156892, end_of_turn_id),
        max_length=hf.get("max_position_embeddings", 4096), head_size=head_dim,
        qk_norm=bool(hf.get("qk_layernorm", True)),
        rotary_dim=int(head_dim * (hf.get("partial_rotary_factor") or 1.0)), moe=moe)


def hf_config(cfg: ModelConfig) -> dict:
    moe = cfg.moe
    return {"model_type": MODEL_TYPE, "architectures": [HF_CLASSES[0]], "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "partial_rotary_factor": cfg.rope_dim / cfg.head_dim, "dense_intermediate_size": cfg.intermediate_size,
            "expert_intermediate_size": moe.expert_size, "shared_expert_intermediate_size": moe.shared_size or None,
            "moe_layer_freq": [int(cfg.is_moe_layer(i)) for i in range(cfg.n_layers)], "num_experts": moe.n_experts,
            "num_experts_per_tok": moe.top_k, "moe_router_enable_expert_bias": moe.expert_bias,
            "moe_router_score_function": "softmax", "norm_topk_prob": False, "qk_layernorm": cfg.qk_norm,
            "attention_bias": cfg.qkv_bias, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "hidden_act": "silu", "tie_word_embeddings": False,
            "max_position_embeddings": cfg.max_length, "mask_token_id": cfg.mask_id, "eos_token_id": cfg.filler_id,
            "pad_token_id": cfg.pad_id}


def _preset(d, layers, heads, head_dim, experts, expert_size, top_k, vocab, max_length=4096, **ids) -> ModelConfig:
    ids = ids or dict(mask_id=vocab - 1, pad_id=vocab - 2, stop_ids=(vocab - 3, vocab - 2), filler_id=vocab - 2)
    moe = MoEConfig(n_experts=experts, top_k=top_k, expert_size=expert_size, router="softmax")
    return ModelConfig(arch="llada_moe", vocab_size=vocab, hidden_size=d, intermediate_size=0, n_layers=layers,
                       n_heads=heads, n_kv_heads=heads, rms_norm_eps=1e-5, rope_theta=50000.0, qkv_bias=False,
                       logit_shift=0, max_length=max_length, head_size=head_dim, qk_norm=True, moe=moe, **ids)


PRESETS = {  # 7B-A1B: the sizes of the spec (unverified against a released config.json)
    "llada-moe-7b": _preset(2048, 16, 16, 128, 64, 1024, 8, 157184, mask_id=156895, pad_id=156892,
                            stop_ids=(156892,), filler_id=156892),
    "llada-moe-tiny": _preset(64, 2, 4, 16, 8, 16, 2, 128, max_length=512),
}
