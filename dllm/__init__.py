"""Fast parallel decoding for diffusion LLMs (LLaDA, Dream).

    model, tok = dllm.load("tiny-llada")            # or a local LLaDA/Dream directory, or "random:llada-8b"
    out = dllm.generate(model, tok, ["2+2?"], sampler="threshold", cache="dual", gen_length=64, block_length=32)
    out.texts, out.stats.nfe, out.stats.tpf
    dllm.likelihood(model, tok, "reverse: abc12", "#### 21cba")  # log p(answer | prompt), an estimate in nats

Layers, each a folder importing only those before it (tests/test_layers.py; ARCHITECTURE.md):
`core` -> `models` -> policies (`samplers`, `cache`; never each other) -> `engine` (the decode loop, `generate`,
`stream`, `bench`, `likelihood`) -> `eval` -> `serve` -> `cli`.
The names below are imported on first use, so `import dllm.core.params` does not pull in the engine.
"""
import importlib

_EXPORTS = {"DllmError": "core.errors", "DllmNotice": "core.errors", "Generation": "engine", "Stats": "engine",
            "decode": "engine", "generate": "engine", "stream": "engine", "likelihood": "engine.api",
            "available_models": "models.loading", "load": "models.loading", "save_pretrained": "models.checkpoint"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'dllm' has no attribute {name!r}")
