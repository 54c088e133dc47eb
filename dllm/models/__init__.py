"""Native LLaDA, Dream and SDAR networks: one transformer, one checkpoint-name table per architecture."""
from . import dream, llada, sdar
from .transformer import DiffusionLM, KVAccess, ModelConfig, Rows

ARCHITECTURES = {llada.MODEL_TYPE: llada, dream.MODEL_TYPE: dream, sdar.MODEL_TYPE: sdar}  # by config.json model_type
ARCHITECTURES_BY_NAME = {"llada": llada, "dream": dream, "sdar": sdar}  # by ModelConfig.arch
PRESETS = {**llada.PRESETS, **dream.PRESETS, **sdar.PRESETS}

__all__ = ["ARCHITECTURES", "ARCHITECTURES_BY_NAME", "PRESETS", "DiffusionLM", "KVAccess", "ModelConfig", "Rows"]
