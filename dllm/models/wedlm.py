"""WeDLM (Tencent/WeDLM, arXiv 2512.22737): an unmodified Qwen2.5 or Qwen3 decoder under a plain causal mask that
recovers masks from their own rows (position-aligned logits), decoded in a sliding window whose filled slots are fed
before its masks with their true RoPE positions (spec `wedlm.md` sections 1-2). Qwen checkpoint names: Qwen2.5's
q/k/v biases (WeDLM-7B) or Qwen3's per-head q/k norms (WeDLM-8B), as `attention_bias` and `qk_norm` say."""
from __future__ import annotations

import dllm.models.dream as dream
import dllm.models.sdar as sdar
from .transformer import ModelConfig, end_ids

MODEL_TYPE = "wedlm"
HF_CLASSES = ("WeDLMForCausalLM",)
END_OF_TURN = "<|im_end|>"
TOKENIZER_STYLE = "dream"  # the Qwen chat format
AUTHORS_DECODING = ("Tencent/WeDLM's engine (wedlm/engine): streaming parallel decoding in a window of 16, entropy "
                    "threshold 0.4, position penalty 0.02")
# the engine's parameters (`Config.wedlm_window_size`, `SamplingParams.wedlm_*`) under their names, where a checkpoint's
# generation_config.json sets them -> the sampler wedlm's
SAMPLER_KEYS = {"wedlm_window_size": "window_size", "wedlm_entropy_threshold": "entropy_threshold",
                "wedlm_pos_penalty_factor": "pos_penalty"}
MASK_ID = 151665  # the engine's and trainer's id when config.json names none (spec `wedlm.md` 1.1, open question 1)

WEIGHT_NAMES = {  # Qwen2's names with the q/k/v biases (WeDLM-7B) and Qwen3's q/k norms (WeDLM-8B); a checkpoint
    # holds the ones its config asks for
    **dream.WEIGHT_NAMES,
    **{ckpt: ours for ckpt, ours in sdar.WEIGHT_NAMES.items() if ckpt.endswith(("q_norm.weight", "k_norm.weight"))},
}


def config_from_hf(hf: dict, end_of_turn_id: int | None = None) -> ModelConfig:
    """`attention_bias` (default true, as WeDLMConfig) and `qk_norm` (default false) must differ: the authors'
    engine builds q/k norms exactly when there is no bias and never reads `qk_norm`, so a config where both agree
    is a network the engine and transformers would run differently."""
    bias, qk_norm = bool(hf.get("attention_bias", True)), bool(hf.get("qk_norm", False))
    if bias == qk_norm:
        raise ValueError(f"config.json has attention_bias={bias} and qk_norm={qk_norm}; a WeDLM network has one of "
                         "them (Qwen2.5: biases, Qwen3: q/k norms)")
    for key in ("use_sliding_window", "rope_scaling"):
        if hf.get(key):
            raise ValueError(f"config.json has {key}={hf[key]!r}; this WeDLM implementation does not support it")
    heads = hf["num_attention_heads"]
    return ModelConfig(
        arch="wedlm", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=hf.get("rope_theta", 1000000.0), qkv_bias=bias, qk_norm=qk_norm, logit_shift=0,
        mask_id=MASK_ID if hf.get("mask_token_id") is None else hf["mask_token_id"],
        **end_ids(hf, 151643, 151645 if end_of_turn_id is None else end_of_turn_id),
        max_length=hf.get("max_position_embeddings", 32768), head_size=hf.get("head_dim") or 0,
        tied_head=bool(hf.get("tie_word_embeddings")), causal=True)


def hf_config(cfg: ModelConfig) -> dict:
    return {"model_type": MODEL_TYPE, "architectures": list(HF_CLASSES), "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
            "attention_bias": cfg.qkv_bias, "qk_norm": cfg.qk_norm, "tie_word_embeddings": cfg.tied_head,
            "max_position_embeddings": cfg.max_length, "mask_token_id": cfg.mask_id, "eos_token_id": cfg.filler_id,
            "pad_token_id": cfg.pad_id, "bos_token_id": cfg.filler_id}


def _preset(d, layers, heads, kv_heads, head_dim, ff, vocab, max_length=32768, **ids) -> ModelConfig:
    ids = ids or dict(mask_id=vocab - 1, pad_id=vocab - 2, stop_ids=(vocab - 3, vocab - 2), filler_id=vocab - 2)
    return ModelConfig(arch="wedlm", vocab_size=vocab, hidden_size=d, intermediate_size=ff, n_layers=layers,
                       n_heads=heads, n_kv_heads=kv_heads, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       qkv_bias=False, qk_norm=True, logit_shift=0, max_length=max_length, head_size=head_dim,
                       causal=True, **ids)


PRESETS = {  # Qwen3 layout
    # Qwen3-8B's shape (the spec's expectation, no config.json read), the engine's default mask id
    "wedlm-8b": _preset(4096, 36, 32, 8, 128, 12288, 151936, mask_id=MASK_ID, pad_id=151643,
                        stop_ids=(151643, 151645), filler_id=151643),
    "wedlm-tiny": _preset(64, 2, 4, 2, 32, 96, 128, max_length=2048),
}


def decoding(cfg: ModelConfig, generation: dict) -> dict:
    """How the authors decode (`AUTHORS_DECODING`): the sampler `wedlm` at its defaults (the engine's)."""
    return {"sampler": "wedlm"}
