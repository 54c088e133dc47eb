"""Native LLaDA and Dream networks: one transformer, one checkpoint-name table per architecture."""
from . import dream, llada
from .transformer import DiffusionLM, KVAccess, ModelConfig, Rows

ARCHITECTURES = {llada.MODEL_TYPE: llada, dream.MODEL_TYPE: dream}  # by config.json model_type
ARCHITECTURES_BY_NAME = {"llada": llada, "dream": dream}  # by ModelConfig.arch
PRESETS = {**llada.PRESETS, **dream.PRESETS}

__all__ = ["ARCHITECTURES", "ARCHITECTURES_BY_NAME", "PRESETS", "DiffusionLM", "KVAccess", "ModelConfig", "Rows"]
