"""Fast-dLLM v2 (NVlabs, Efficient-Large-Model/Fast_dLLM_v2_7B): Qwen2.5 turned block-diffusion (spec
`block_diffusion_moe.md` section 4). Qwen2 checkpoint names (Dream's table, q/k/v bias), AR-shifted logits
(hidden i-1 scores token i, so a block's first token is scored by the last position of the block before it),
block-causal attention over blocks of `bd_size` 32."""
from __future__ import annotations

import dataclasses

import dllm.models.dream as dream

from .transformer import ModelConfig, block_size_of

MODEL_TYPE = "Fast_dLLM_Qwen"
HF_CLASSES = ("Fast_dLLM_QwenForCausalLM",)
END_OF_TURN = "<|im_end|>"
AUTHORS_DECODING = "NVlabs/Fast-dLLM v2 generate(): sub-blocks of 8, threshold 0.9, temperature 0"
TOKENIZER_STYLE = "dream"  # the Qwen chat format
WEIGHT_NAMES = dream.WEIGHT_NAMES


def decoding(cfg: ModelConfig, generation: dict) -> dict:
    """How Fast-dLLM v2's authors decode (`AUTHORS_DECODING`): the sampler sub_block, whose defaults are theirs."""
    return {"sampler": "sub_block"}


def config_from_hf(hf: dict, end_of_turn_id: int | None = None) -> ModelConfig:
    cfg = dream.config_from_hf({"mask_token_id": 151665, **hf, "tie_word_embeddings": False}, end_of_turn_id)
    return dataclasses.replace(cfg, arch="fast_dllm_v2", block_size=block_size_of(hf, "bd_size", 32),
                               max_length=hf.get("max_position_embeddings", 32768),
                               tied_head=bool(hf.get("tie_word_embeddings")))  # as Qwen2.5-1.5B


def hf_config(cfg: ModelConfig) -> dict:
    return {**dream.hf_config(cfg), "model_type": MODEL_TYPE, "architectures": list(HF_CLASSES),
            "bd_size": cfg.block_size, "tie_word_embeddings": cfg.tied_head}


PRESETS = {
    "fast-dllm-v2-7b": dataclasses.replace(dream.PRESETS["dream-7b"], arch="fast_dllm_v2", mask_id=151665,
                                           block_size=32, max_length=32768),
    "fast-dllm-v2-tiny": dataclasses.replace(dream.PRESETS["dream-tiny"], arch="fast_dllm_v2", block_size=4),
}
