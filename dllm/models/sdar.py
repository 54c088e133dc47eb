"""SDAR (JetAstra/SDAR): Qwen3 with block-causal attention. Qwen3 checkpoint names, GQA, per-head q/k RMSNorm
before RoPE, head_dim 128 whatever the width, no biases, position-aligned logits; a position sees its own block
of `block_size` and every earlier block (spec `block_diffusion_moe.md` section 1). SDAR-30B-A3B: the same with
Qwen3-MoE's feed-forward layers (softmax router, top-k renormalised, `mlp.experts.{e}.*`; config unverified)."""
from __future__ import annotations

import dllm.models.dream as dream

from .moe import MoEConfig, swiglu_names
from .transformer import ModelConfig, block_size_of, end_ids

MODEL_TYPE = "sdar"
HF_CLASSES = ("SDARForCausalLM", "SDARMoeForCausalLM")
END_OF_TURN = "<|im_end|>"
AUTHORS_DECODING = ("JetAstra/SDAR's evaluation (evaluation/opencompass/configs/eval_sdar_hf.py): low_confidence, "
                    "greedy, steps = block length")  # as ours
TOKENIZER_STYLE = "dream"  # the Qwen chat format

_LAYER = "model.layers.{i}."
WEIGHT_NAMES = {  # Qwen3's names: Qwen2's (Dream's table) without the q/k/v biases, plus the per-head norms
    **{ckpt: ours for ckpt, ours in dream.WEIGHT_NAMES.items() if not ckpt.endswith(".bias")},
    _LAYER + "self_attn.q_norm.weight": "layers.{i}.q_norm.weight",
    _LAYER + "self_attn.k_norm.weight": "layers.{i}.k_norm.weight",
    _LAYER + "mlp.gate.weight": "layers.{i}.moe.router.weight",  # the MoE variant
    **swiglu_names(_LAYER + "mlp.experts.{e}.", "layers.{i}.moe.experts_gate_up@{e}",
                   "layers.{i}.moe.experts_down@{e}"),
}


def _moe(hf: dict) -> MoEConfig | None:
    if not hf.get("num_experts"):
        return None
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError("config.json has mlp_only_layers or decoder_sparse_step != 1; this SDAR implementation "
                         "supports MoE in every layer")
    return MoEConfig(n_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                     expert_size=hf["moe_intermediate_size"], router="softmax",
                     normalize=bool(hf.get("norm_topk_prob", True)))


def config_from_hf(hf: dict, end_of_turn_id: int | None = None) -> ModelConfig:
    for key in ("attention_bias", "use_sliding_window", "rope_scaling"):
        if hf.get(key):
            raise ValueError(f"config.json has {key}={hf[key]!r}; this SDAR implementation does not support it")
    heads = hf["num_attention_heads"]
    return ModelConfig(
        arch="sdar", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=hf.get("rope_theta", 1000000.0), qkv_bias=False, logit_shift=0, mask_id=hf["mask_token_id"],
        **end_ids(hf, 151643, 151645 if end_of_turn_id is None else end_of_turn_id),
        max_length=hf.get("max_position_embeddings", 32768), head_size=hf.get("head_dim") or 0, qk_norm=True,
        block_size=block_size_of(hf, "block_size"), moe=_moe(hf),
        tied_head=bool(hf.get("tie_word_embeddings")))  # SDAR-1.7B, as Qwen3-1.7B


def hf_config(cfg: ModelConfig) -> dict:
    moe = {} if cfg.moe is None else {"num_experts": cfg.moe.n_experts, "num_experts_per_tok": cfg.moe.top_k,
                                      "moe_intermediate_size": cfg.moe.expert_size, "norm_topk_prob": cfg.moe.normalize}
    return {**moe, "model_type": MODEL_TYPE, "architectures": [HF_CLASSES[cfg.moe is not None]],
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": cfg.tied_head, "max_position_embeddings": cfg.max_length,
            "block_size": cfg.block_size, "mask_token_id": cfg.mask_id, "eos_token_id": cfg.filler_id,
            "pad_token_id": cfg.pad_id, "bos_token_id": cfg.filler_id}


def _preset(d, layers, heads, kv_heads, head_dim, ff, vocab, block=4, max_length=32768, moe=None,
            **ids) -> ModelConfig:
    ids = ids or dict(mask_id=vocab - 1, pad_id=vocab - 2, stop_ids=(vocab - 3, vocab - 2), filler_id=vocab - 2)
    return ModelConfig(arch="sdar", vocab_size=vocab, hidden_size=d, intermediate_size=ff, n_layers=layers,
                       n_heads=heads, n_kv_heads=kv_heads, rms_norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=False,
                       logit_shift=0, max_length=max_length, head_size=head_dim, qk_norm=True, block_size=block,
                       moe=moe, **ids)


_QWEN3_IDS = dict(mask_id=151669, pad_id=151643, stop_ids=(151643, 151645), filler_id=151643)
PRESETS = {
    "sdar-4b": _preset(2560, 36, 32, 8, 128, 9728, 151936, **_QWEN3_IDS),  # ../shared/data/sdar-4b-chat
    "sdar-8b": _preset(4096, 36, 32, 8, 128, 12288, 151936, **_QWEN3_IDS),
    "sdar-tiny": _preset(64, 2, 4, 2, 32, 96, 128, max_length=2048),  # room for long shared prompts (bench-serve)
    "sdar-moe-tiny": _preset(64, 2, 4, 2, 16, 0, 128, max_length=512,
                             moe=MoEConfig(n_experts=8, top_k=2, expert_size=16, normalize=True)),
}
