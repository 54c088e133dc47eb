"""The bottom layer: one-line errors (`errors`), typed and validated policy parameters with their registries
(`params`), and the argument checks every layer shares (`checks`). It imports nothing else of `dllm`."""
