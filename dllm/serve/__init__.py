"""`dllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, extra `serve`) over the engine's `Batch`.

A request body becomes a `Job` (`requests`); the engine thread (`scheduler`) lets jobs join the running batch
between blocks (continuous batching) when the batch's sampler and cache allow it (`Batch.joins_between_blocks`),
else forms a batch from the waiting jobs and runs it to its end; requests share a batch only when they decode with
the same sampler, cache and block layout, and each row has its own random stream, so an answer is the one `dllm
generate` gives for that prompt and those parameters alone. `http` serves the endpoints, `metrics` the Prometheus
counters; `client` and `bench` (`dllm bench-serve`) load a server from outside.

Endpoints: POST /v1/completions (raw prompt, like `dllm generate --no-chat`), POST /v1/chat/completions (the
tokenizer's chat template, like `dllm generate`), GET /v1/models, /health, /metrics (Prometheus). Decoding
parameters ride in the request body next to OpenAI's fields (the `extra_body` of OpenAI's client): `sampler`,
`cache`, `gen_length`, `block_length`, `steps`, `sampler_args`, `cache_args` and any sampler or cache parameter
by name. Bad input is HTTP 400 with the CLI's one-line message."""
from .client import load, post
from .http import LocalServer, create_app, server
from .scheduler import Engine

__all__ = ["Engine", "LocalServer", "create_app", "load", "post", "server"]
