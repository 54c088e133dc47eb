"""Fast parallel decoding for diffusion LLMs (LLaDA, Dream).

    model, tok = dllm.load("tiny-llada")            # or a local LLaDA/Dream directory, or "random:llada-8b"
    out = dllm.generate(model, tok, ["2+2?"], sampler="threshold", cache="dual", gen_length=64, block_length=32)
    out.texts, out.stats.nfe, out.stats.tpf

Layers, each importing only those before it (tests/test_layers.py):
core (`errors`, `params`) -> models (`models`, `loading`, `tokenizer`) -> policies (`samplers`, `cache`; never
each other) -> engine (`engine`: the decode loop and `generate`; `bench`) -> `eval` -> `cli`.
The names below are imported on first use, so `import dllm.params` does not pull in the engine.
"""
import importlib

_EXPORTS = {"DllmError": "errors", "Generation": "engine", "Stats": "engine", "decode": "engine",
            "generate": "engine", "stream": "engine", "available_models": "loading", "load": "loading",
            "save_pretrained": "loading"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'dllm' has no attribute {name!r}")
