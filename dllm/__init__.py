"""Fast parallel decoding for diffusion LLMs (LLaDA, Dream).

    model, tok = dllm.load("tiny-llada")            # or a local LLaDA/Dream directory, or "random:llada-8b"
    out = dllm.generate(model, tok, ["2+2?"], sampler="threshold", cache="dual", gen_length=64, block_length=32)
    out.texts, out.stats.nfe, out.stats.tpf
"""
from .decode import Generation, Stats, decode, generate
from .errors import DllmError
from .loading import available_models, load, save_pretrained

__all__ = ["DllmError", "Generation", "Stats", "available_models", "decode", "generate", "load", "save_pretrained"]
