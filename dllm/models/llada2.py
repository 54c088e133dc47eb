"""LLaDA2.0 / LLaDA2.1 (inclusionAI/LLaDA2.0-mini, -flash): block-causal MoE diffusion LMs (spec
`block_diffusion_moe.md` section 2). Fused `query_key_value` (Q|K|V), per-head q/k RMSNorm before RoPE on the
first 64 of 128 head dims, GQA, no biases; layer 0 a dense SwiGLU, later layers 256 experts (top 8) with DeepSeek-V3's
sigmoid group-limited router, expert bias and routed scaling, plus one shared expert; block-causal attention over
blocks of 32 (dFactory's `generate`), position-aligned logits. LLaDA2.2 (inclusionAI/LLaDA2.2-flash) is the same
network with two edit tokens for insert/delete decoding (`delete_token_id`, `split_token_id`; sampler
`joint_threshold_indel`). Its block routing in the MoE (per 32-token block, admit the experts with the highest
router score over the block, then each token's top-8 among them) is known only second-hand, with no official
modeling file to pin the formula (the capacity, ties, the shared expert), so the router here stays per token."""
from __future__ import annotations

from .moe import MoEConfig, swiglu_names
from .transformer import ModelConfig, block_size_of, end_ids

MODEL_TYPE = "llada2_moe"
HF_CLASSES = ("LLaDA2MoeModelLM",)
END_OF_TURN = "<|role_end|>"
AUTHORS_DECODING = "inclusionAI/dFactory LLaDA2.0 generate(): threshold 0.95, 32 steps per block of 32, temperature 0"
TOKENIZER_STYLE = "llada"  # of the character tokenizer a random: model gets
BLOCK_SIZE = 32  # the training and decoding block of the released models (config.json does not say)


def decoding(cfg: ModelConfig, generation: dict) -> dict:
    """How LLaDA2's authors decode when their `generate` is called with no options (`AUTHORS_DECODING`): commit
    what clears 0.95, at least one position a step, in the model's blocks (block_length: its `BLOCK_SIZE`)."""
    return {"sampler": "low_confidence_dynamic", "sampler_args": {"threshold": 0.95}}


_LAYER = "model.layers.{i}."
WEIGHT_NAMES = {
    "model.word_embeddings.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    _LAYER + "input_layernorm.weight": "layers.{i}.attn_norm.weight",
    _LAYER + "attention.query_key_value.weight": "layers.{i}.qkv_proj.weight",
    _LAYER + "attention.query_layernorm.weight": "layers.{i}.q_norm.weight",
    _LAYER + "attention.key_layernorm.weight": "layers.{i}.k_norm.weight",
    _LAYER + "attention.dense.weight": "layers.{i}.o_proj.weight",
    _LAYER + "post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
    **swiglu_names(_LAYER + "mlp.", "layers.{i}.gate_up_proj.weight", "layers.{i}.down_proj.weight"),  # dense
    _LAYER + "mlp.gate.weight": "layers.{i}.moe.router.weight",
    _LAYER + "mlp.gate.expert_bias": "layers.{i}.moe.expert_bias",
    **swiglu_names(_LAYER + "mlp.experts.{e}.", "layers.{i}.moe.experts_gate_up@{e}",
                   "layers.{i}.moe.experts_down@{e}"),
    **swiglu_names(_LAYER + "mlp.shared_experts.", "layers.{i}.moe.shared.gate_up_proj.weight",
                   "layers.{i}.moe.shared.down_proj.weight"),
}

# Fields whose values this implementation assumes; anything else is a different network.
_REQUIRED = {"hidden_act": "silu", "score_function": "sigmoid", "use_qkv_bias": False, "use_bias": False,
             "tie_word_embeddings": False, "use_sliding_window": False, "rope_scaling": None, "norm_head": False}


def config_from_hf(hf: dict, end_of_turn_id: int | None = None) -> ModelConfig:
    for key, want in _REQUIRED.items():
        if key in hf and hf[key] != want:
            raise ValueError(f"config.json has {key}={hf[key]!r}; this LLaDA2 implementation needs {want!r}")
    heads, head_dim = hf["num_attention_heads"], hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    rotary = hf.get("rotary_dim") or int(head_dim * hf.get("partial_rotary_factor", 1.0))
    shared = hf.get("num_shared_experts") or 0
    moe = MoEConfig(n_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                    expert_size=hf["moe_intermediate_size"], shared_size=shared * hf["moe_intermediate_size"],
                    dense_layers=hf.get("first_k_dense_replace", 0), router="sigmoid",
                    expert_bias=bool(hf.get("moe_router_enable_expert_bias", True)), groups=hf.get("n_group") or 1,
                    groups_kept=hf.get("topk_group") or 1, normalize=hf["num_experts_per_tok"] > 1,  # the official
                    # gate renormalizes whenever top-k > 1, whatever norm_topk_prob says
                    scaling=hf.get("routed_scaling_factor", 1.0))
    return ModelConfig(
        arch="llada2", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=hf.get("rope_theta", 600000.0), qkv_bias=False, logit_shift=0, mask_id=hf["mask_token_id"],
        **end_ids(hf, 156892, end_of_turn_id),
        max_length=hf.get("max_position_embeddings", 32768), head_size=head_dim, qk_norm=True,
        block_size=block_size_of(hf, "block_size", BLOCK_SIZE), rotary_dim=rotary, moe=moe, edit_ids=edit_ids(hf))


def edit_ids(hf: dict) -> tuple[int, int] | None:
    """LLaDA2.2's (delete, split) token ids, when config.json names both."""
    ids = hf.get("delete_token_id"), hf.get("split_token_id")
    if ids == (None, None):
        return None
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < hf["vocab_size"] for i in ids):
        raise ValueError(f"delete_token_id and split_token_id must both be token ids, got {ids}")
    return ids


def hf_config(cfg: ModelConfig) -> dict:
    moe = cfg.moe
    return {"model_type": MODEL_TYPE, "architectures": list(HF_CLASSES), "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "rotary_dim": cfg.rope_dim,
            "partial_rotary_factor": cfg.rope_dim / cfg.head_dim, "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.max_length, "num_experts": moe.n_experts,
            "num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.expert_size,
            "num_shared_experts": moe.shared_size // moe.expert_size, "first_k_dense_replace": moe.dense_layers,
            "moe_router_enable_expert_bias": moe.expert_bias, "n_group": moe.groups, "topk_group": moe.groups_kept,
            "norm_topk_prob": moe.normalize, "routed_scaling_factor": moe.scaling, "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_id, "eos_token_id": cfg.filler_id, "pad_token_id": cfg.pad_id,
            **({} if cfg.edit_ids is None else dict(zip(("delete_token_id", "split_token_id"), cfg.edit_ids))),
            **{k: v for k, v in _REQUIRED.items() if v is not None}}


def _preset(d, layers, heads, kv_heads, head_dim, rotary, dense, experts, expert_size, top_k, groups, kept, vocab,
            block=BLOCK_SIZE, max_length=32768, **ids) -> ModelConfig:
    ids = ids or dict(mask_id=vocab - 1, pad_id=vocab - 2, stop_ids=(vocab - 3, vocab - 2), filler_id=vocab - 2)
    moe = MoEConfig(n_experts=experts, top_k=top_k, expert_size=expert_size, shared_size=expert_size,
                    dense_layers=1, router="sigmoid", expert_bias=True, groups=groups, groups_kept=kept,
                    normalize=True, scaling=2.5)
    return ModelConfig(arch="llada2", vocab_size=vocab, hidden_size=d, intermediate_size=dense, n_layers=layers,
                       n_heads=heads, n_kv_heads=kv_heads, rms_norm_eps=1e-6, rope_theta=600000.0, qkv_bias=False,
                       logit_shift=0, max_length=max_length, head_size=head_dim, qk_norm=True, block_size=block,
                       rotary_dim=rotary, moe=moe, **ids)


PRESETS = {  # ../shared/data/llada2-mini: 16B parameters, 1.4B active
    "llada2-mini": _preset(2048, 20, 16, 4, 128, 64, 5120, 256, 512, 8, 8, 4, 157184, mask_id=156895,
                           pad_id=156892, stop_ids=(156892,), filler_id=156892),
    "llada2-tiny": _preset(64, 2, 4, 2, 16, 8, 96, 8, 16, 2, 4, 2, 128, block=4, max_length=512),
    "llada2.2-tiny": _preset(64, 2, 4, 2, 16, 8, 96, 8, 16, 2, 4, 2, 128, block=8, max_length=512, mask_id=127,
                             pad_id=126, stop_ids=(125, 126), filler_id=126, edit_ids=(123, 124)),
}
