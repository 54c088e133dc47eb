"""Dream (Dream-org/Dream-v0-*-7B): Qwen2 checkpoint names, q/k/v bias, GQA, AR-shifted logits
(spec `models.md` 1.2, 2.2)."""
from __future__ import annotations

from .moe import swiglu_names
from .transformer import ModelConfig, end_ids

MODEL_TYPE = "Dream"
TOKENIZER_STYLE = "dream"  # of the character tokenizer a random: model gets
END_OF_TURN = "<|im_end|>"
AUTHORS_DECODING = "Dream's diffusion_generate (generation_utils.py), which reads generation_config.json"
# generation_config.json keys diffusion_generate reads (`DreamGenerationConfig`) -> ours; `alg` names the sampler, one
# of ALGORITHMS (our samplers of those names). Without a file: ours (low_confidence in blocks), not Dream's origin.
SAMPLER_KEYS = {"alg": "sampler", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                "alg_temp": "alg_temp", "eps": "eps"}
ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")

_LAYER = "model.layers.{i}."
WEIGHT_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    _LAYER + "input_layernorm.weight": "layers.{i}.attn_norm.weight",
    **{_LAYER + f"self_attn.{p}_proj.{t}": f"layers.{{i}}.qkv_proj.{t}:{p}" for p in "qkv" for t in ("weight", "bias")},
    _LAYER + "self_attn.o_proj.weight": "layers.{i}.o_proj.weight",
    _LAYER + "post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
    **swiglu_names(_LAYER + "mlp.", "layers.{i}.gate_up_proj.weight", "layers.{i}.down_proj.weight"),  # :shard =
    # rows of a fused tensor
}


def config_from_hf(hf: dict, end_of_turn_id: int | None = None) -> ModelConfig:
    if hf.get("tie_word_embeddings"):
        raise ValueError("config.json has tie_word_embeddings=true; this Dream implementation needs an untied lm_head")
    if hf.get("use_sliding_window"):
        raise ValueError("config.json has use_sliding_window=true; this implementation needs full attention")
    if hf.get("rope_scaling"):
        raise ValueError(f"config.json has rope_scaling={hf['rope_scaling']!r}; only default RoPE is supported")
    return ModelConfig(
        arch="dream", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=hf.get("rope_theta", 1000000.0), qkv_bias=True,
        logit_shift=1, mask_id=hf.get("mask_token_id", 151666),
        max_length=min(hf.get("max_position_embeddings", 2048), 2048),
        **end_ids(hf, 151643, 151645 if end_of_turn_id is None else end_of_turn_id))


def hf_config(cfg: ModelConfig) -> dict:
    return {"model_type": MODEL_TYPE, "architectures": ["DreamModel"], "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "hidden_act": "silu", "tie_word_embeddings": False,
            "max_position_embeddings": cfg.max_length, "mask_token_id": cfg.mask_id,
            "eos_token_id": cfg.filler_id, "pad_token_id": cfg.pad_id, "bos_token_id": cfg.filler_id}


def _preset(d, layers, heads, kv_heads, ff, vocab, max_length=2048, **ids) -> ModelConfig:
    ids = ids or dict(mask_id=vocab - 1, pad_id=vocab - 2, stop_ids=(vocab - 3, vocab - 2), filler_id=vocab - 2)
    return ModelConfig(arch="dream", vocab_size=vocab, hidden_size=d, intermediate_size=ff, n_layers=layers,
                       n_heads=heads, n_kv_heads=kv_heads, rms_norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True,
                       logit_shift=1, max_length=max_length, **ids)


PRESETS = {
    "dream-7b": _preset(3584, 28, 28, 4, 18944, 152064, mask_id=151666, pad_id=151643,
                        stop_ids=(151643, 151645), filler_id=151643),
    "dream-small": _preset(640, 10, 10, 2, 1728, 32768),
    "dream-tiny": _preset(64, 2, 4, 2, 96, 128, max_length=512),
}
