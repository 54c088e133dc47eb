"""DiffusionGemma (google/diffusiongemma-26B-A4B-it; spec `new_families.md` section 1): a uniform-state block
diffusion model on the Gemma 4 26B-A4B backbone (`gemma.py`), text only. The checkpoint stores the decoder's
weights, which the encoder shares (transformers ties them), plus the encoder's own per-layer scalars; the vision
tower and its projection are skipped (`SKIPPED_WEIGHTS`): a prompt holding the image token is refused."""
from __future__ import annotations

from ..core.errors import DllmError
from .gemma import DiffusionGemma, GemmaConfig
from .moe import MoEConfig, swiglu_names
from .transformer import end_ids

MODEL_TYPE = "diffusion_gemma"
HF_CLASSES = ("DiffusionGemmaForBlockDiffusion",)
MODEL_CLASS = DiffusionGemma
END_OF_TURN = None  # Gemma 4's end of turn is among generation_config.json's eos ids, which stop a row
TOKENIZER_STYLE = "llada"  # of the character tokenizer a random: model gets
AUTHORS_DECODING = "transformers' DiffusionGemma generate (DiffusionGemmaGenerationConfig)"

_DECODER, _LAYER = "model.decoder.", "model.decoder.layers.{i}."
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_out_norm",
          "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm_1": "mlp_out_norm",
          "pre_feedforward_layernorm_2": "moe_norm", "post_feedforward_layernorm_2": "moe_out_norm",
          "post_feedforward_layernorm": "ffn_out_norm"}
WEIGHT_NAMES = {
    _DECODER + "embed_tokens.weight": "embed.weight",
    _DECODER + "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    _DECODER + "self_conditioning.pre_norm.weight": "self_conditioning.norm.weight",
    **swiglu_names(_DECODER + "self_conditioning.", "self_conditioning.mlp.gate_up_proj.weight",
                   "self_conditioning.mlp.down_proj.weight"),
    **{f"{_LAYER}{theirs}.weight": f"layers.{{i}}.{ours}.weight" for theirs, ours in _NORMS.items()},
    **{f"{_LAYER}self_attn.{p}.weight": f"layers.{{i}}.{p}.weight"
       for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")},  # full layers have no v_proj
    **swiglu_names(_LAYER + "mlp.", "layers.{i}.mlp.gate_up_proj.weight", "layers.{i}.mlp.down_proj.weight"),
    _LAYER + "router.proj.weight": "layers.{i}.moe.router.weight",
    _LAYER + "router.scale": "layers.{i}.moe.router_scale",
    _LAYER + "router.per_expert_scale": "layers.{i}.moe.per_expert_scale",
    _LAYER + "experts.gate_up_proj": "layers.{i}.moe.experts_gate_up",  # [E, 2F, D], gate first, as ours
    _LAYER + "experts.down_proj": "layers.{i}.moe.experts_down",
    _LAYER + "layer_scalar": "layers.{i}.decoder_scale",
    "model.encoder.language_model.layers.{i}.layer_scalar": "layers.{i}.encoder_scale",
}
# Not loaded: the vision tower, and copies of the decoder's weights under the encoder's names (tied in transformers)
SKIPPED_WEIGHTS = ("model.encoder.vision_tower.", "model.encoder.embed_vision.", "model.encoder.language_model.")

# generation_config.json keys of transformers' DiffusionGemmaGenerationConfig -> the entropy_bound sampler's parameters
SAMPLER_KEYS = {"t_min": "t_min", "t_max": "t_max", "stability_threshold": "stability",
                "confidence_threshold": "confidence"}
GENERATION_KEYS = ("max_denoising_steps", "sampler_config")  # kept as they are by the loader, for `decoding`
MAX_NEW_TOKENS, DENOISING_STEPS = 256, 48  # transformers' defaults where the file sets none


def decoding(cfg: GemmaConfig, generation: dict) -> dict:
    """How DiffusionGemma decodes when the caller does not say, as transformers' `generate` does over the
    generation_config.json keys `generation` holds (`GENERATION_KEYS`; the file's `SAMPLER_KEYS` reach the
    sampler through `read_generation_config`; the others: entropy_bound's defaults, which are transformers'): the
    sampler entropy_bound with the file's bound, a block per canvas, max_denoising_steps steps per block, 256
    answer tokens in whole canvases."""
    args = {}
    bound = generation.get("sampler_config")
    if isinstance(bound, dict) and bound.get("entropy_bound") is not None:
        args["bound"] = bound["entropy_bound"]
    steps = generation.get("max_denoising_steps", DENOISING_STEPS)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise DllmError(f"generation_config.json: max_denoising_steps must be a positive integer, got {steps!r}; "
                        f"fix or delete it")
    return {"sampler": "entropy_bound", "sampler_args": args, "block_length": cfg.canvas_length,
            "steps_per_block": steps, "gen_length": -(-MAX_NEW_TOKENS // cfg.canvas_length) * cfg.canvas_length}


_SLIDING, _FULL = "sliding_attention", "full_attention"
_ROPE = {_SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},  # transformers' defaults
         _FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


def _layer_types(text: dict) -> list[str]:
    """`layer_types`, else transformers' default (every sixth layer full); the last layer is always full."""
    n = text["num_hidden_layers"]
    types = list(text.get("layer_types") or [_FULL if (i + 1) % 6 == 0 else _SLIDING for i in range(n)])
    if len(types) != n or set(types) - {_SLIDING, _FULL}:
        raise ValueError(f"layer_types must name {n} layers, each {_SLIDING} or {_FULL}, got {types!r}")
    return types[:-1] + [_FULL]


def _full_layer_shape(text: dict, full: list[int]) -> tuple[int, int]:
    """Head size and key/value heads of the full layers: `per_layer_config` (a config written by transformers),
    else `global_head_dim` (default 512) and `num_global_key_value_heads` (default: the sliding layers')."""
    overrides = {(o.get("head_dim"), o.get("num_key_value_heads"))
                 for o in ((text.get("per_layer_config") or {}).get(str(i)) or {} for i in full)}
    if len(overrides) > 1:
        raise ValueError(f"per_layer_config gives the full-attention layers different shapes {sorted(overrides)}")
    size, heads = overrides.pop()
    return (size or text.get("global_head_dim") or 512,
            heads or text.get("num_global_key_value_heads") or text["num_key_value_heads"])


def config_from_hf(hf: dict, end_of_turn_id: int | None = None) -> GemmaConfig:
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("config.json has no text_config; a DiffusionGemma config nests its text model there")
    text = {key: value for key, value in text.items() if value is not None}  # null: unset, our defaults apply
    for key, want in (("hidden_activation", "gelu_pytorch_tanh"), ("attention_bias", False)):
        if text.get(key, want) != want:
            raise ValueError(f"text_config has {key}={text[key]!r}; this DiffusionGemma implementation needs {want!r}")
    if text.get("use_bidirectional_attention") == "all":
        raise ValueError("text_config has use_bidirectional_attention='all' (a bidirectional encoder); "
                         "DiffusionGemma's encoder is causal")
    types = _layer_types(text)
    full = [i for i, t in enumerate(types) if t == _FULL]
    rope = {**_ROPE, **(text.get("rope_parameters") or {})}
    if rope[_SLIDING].get("rope_type", "default") != "default" or rope[_FULL].get("rope_type") != "proportional" \
            or rope[_FULL].get("factor", 1.0) != 1.0:
        raise ValueError(f"rope_parameters {rope!r}: this implementation needs default RoPE in sliding layers and "
                         f"unscaled proportional RoPE in full layers")
    size, kv_heads = _full_layer_shape(text, full)
    moe = MoEConfig(n_experts=text["num_experts"], top_k=text["top_k_experts"],
                    expert_size=text["moe_intermediate_size"], router="gemma", normalize=True,
                    activation="gelu_tanh", norm_eps=text.get("rms_norm_eps", 1e-6))
    return GemmaConfig(
        arch="diffusion_gemma", vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"], n_layers=text["num_hidden_layers"],
        n_heads=text["num_attention_heads"], n_kv_heads=text["num_key_value_heads"],
        rms_norm_eps=text.get("rms_norm_eps", 1e-6), rope_theta=rope[_SLIDING]["rope_theta"], qkv_bias=False,
        logit_shift=0, mask_id=None, **end_ids({"pad_token_id": 0, **text}, 1, end_of_turn_id),
        max_length=text.get("max_position_embeddings", 131_072), head_size=text.get("head_dim") or 256,
        qk_norm=True, causal_prefix=True, canvas_length=hf.get("canvas_length", 256), moe=moe,
        tied_head=bool(hf.get("tie_word_embeddings", True) and text.get("tie_word_embeddings", True)),
        sliding_window=text.get("sliding_window", 512), full_layers=tuple(full), full_head_size=size,
        full_kv_heads=kv_heads, full_rope_theta=rope[_FULL]["rope_theta"],
        full_rope_fraction=rope[_FULL].get("partial_rotary_factor", 1.0),
        logit_softcap=text.get("final_logit_softcapping", 30.0), image_token_id=hf.get("image_token_id"))


def hf_config(cfg: GemmaConfig) -> dict:
    types = [_FULL if i in cfg.full_layers else _SLIDING for i in range(cfg.n_layers)]
    eos = [cfg.filler_id, *(i for i in cfg.stop_ids if i != cfg.filler_id)]
    rope = {_SLIDING: {"rope_type": "default", "rope_theta": cfg.rope_theta},
            _FULL: {"rope_type": "proportional", "partial_rotary_factor": cfg.full_rope_fraction,
                    "rope_theta": cfg.full_rope_theta}}
    text = {"model_type": "diffusion_gemma_text", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "global_head_dim": cfg.full_head_size, "num_global_key_value_heads": cfg.full_kv_heads,
            "sliding_window": cfg.sliding_window, "layer_types": types, "rope_parameters": rope,
            "rms_norm_eps": cfg.rms_norm_eps, "final_logit_softcapping": cfg.logit_softcap,
            "num_experts": cfg.moe.n_experts, "top_k_experts": cfg.moe.top_k,
            "moe_intermediate_size": cfg.moe.expert_size, "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": cfg.max_length, "pad_token_id": cfg.pad_id,
            "eos_token_id": eos if len(eos) > 1 else eos[0], "tie_word_embeddings": cfg.tied_head}
    out = {"model_type": MODEL_TYPE, "architectures": list(HF_CLASSES), "canvas_length": cfg.canvas_length,
           "tie_word_embeddings": cfg.tied_head, "text_config": text}
    return out if cfg.image_token_id is None else {**out, "image_token_id": cfg.image_token_id}


def _preset(d, layers, full, heads, kv_heads, head, full_kv_heads, full_head, window, dense, experts, expert_size,
            top_k, vocab, canvas, max_length, **ids) -> GemmaConfig:
    moe = MoEConfig(n_experts=experts, top_k=top_k, expert_size=expert_size, router="gemma", normalize=True,
                    activation="gelu_tanh")
    return GemmaConfig(arch="diffusion_gemma", vocab_size=vocab, hidden_size=d, intermediate_size=dense,
                       n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, rms_norm_eps=1e-6, rope_theta=10_000.0,
                       qkv_bias=False, logit_shift=0, mask_id=None, max_length=max_length, head_size=head,
                       qk_norm=True, causal_prefix=True, canvas_length=canvas, moe=moe, tied_head=True,
                       sliding_window=window, full_layers=full, full_head_size=full_head, full_kv_heads=full_kv_heads,
                       **ids)


PRESETS = {  # the released text config (spec section 1); max_length: transformers' default, not verified
    "diffusion-gemma-26b-a4b": _preset(2816, 30, (5, 11, 17, 23, 29), 16, 8, 256, 2, 512, 1024, 2112, 128, 704, 8,
                                       262_144, 256, 131_072, pad_id=0, stop_ids=(1, 50, 106), filler_id=1,
                                       image_token_id=258_880),
    "diffusion-gemma-tiny": _preset(64, 3, (2,), 4, 2, 16, 1, 32, 8, 96, 8, 16, 2, 128, 16, 512, pad_id=0,
                                    stop_ids=(1,), filler_id=1),
}
