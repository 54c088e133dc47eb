"""Native LLaDA, Dream, SDAR, LLaDA2, LLaDA-MoE, Fast-dLLM v2, Nemotron-Labs-Diffusion and WeDLM networks: one
transformer, one checkpoint-name table per architecture; DiffusionGemma's two-mode Gemma 4 network (`gemma.py`) beside it."""
from . import diffusion_gemma, dream, fast_dllm_v2, llada, llada2, llada_moe, nemotron_diffusion, sdar, wedlm
from .moe import MoEConfig
from .transformer import DiffusionLM, KVAccess, ModelConfig, Rows

ARCHITECTURES_BY_NAME = {"llada": llada, "dream": dream, "sdar": sdar, "llada2": llada2, "llada_moe": llada_moe,
                         "fast_dllm_v2": fast_dllm_v2, "nemotron_diffusion": nemotron_diffusion,
                         "diffusion_gemma": diffusion_gemma, "wedlm": wedlm}  # by ModelConfig.arch
PRESETS = {name: cfg for arch in ARCHITECTURES_BY_NAME.values() for name, cfg in arch.PRESETS.items()}


def architecture_of(hf: dict):
    """The architecture module of a `config.json`: by its model class (`architectures`), else its `model_type`
    (LLaDA-MoE's says "llada" like LLaDA's; its class and `num_experts` tell them apart). None if unknown."""
    for arch in ARCHITECTURES_BY_NAME.values():
        if set(getattr(arch, "HF_CLASSES", ())) & set(hf.get("architectures") or ()):
            return arch
    if hf.get("model_type") == llada.MODEL_TYPE and hf.get("num_experts"):
        return llada_moe
    return next((arch for arch in ARCHITECTURES_BY_NAME.values() if arch.MODEL_TYPE == hf.get("model_type")), None)


__all__ = ["ARCHITECTURES_BY_NAME", "PRESETS", "DiffusionLM", "KVAccess", "MoEConfig", "ModelConfig", "Rows",
           "architecture_of"]
