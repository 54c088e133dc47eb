"""`dllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, extra `serve`) over the engine's `Batch`, in
two processes that talk over ZeroMQ in typed msgspec messages (`messages`).

The HTTP process (`http`, `engine_client`) reads a request body into a `Job` (`requests`: every check, on the model
without its weights, the chat template, tokenization), sends it to the engine and turns the tokens the engine sends
back into text, stop strings, logprobs objects and server-sent events; it serves the Prometheus metrics (`metrics`).
The engine process (`engine_process`) holds the model and runs the scheduler (`scheduler`): requests join the
running batch between blocks (continuous batching) when the batch's sampler and cache allow it
(`Batch.joins_between_blocks`), else form a batch that runs to its end; requests share a batch only when they decode
with the same sampler, cache and block layout, and each row has its own random stream, so an answer is the one `dllm
generate` gives for that prompt and those parameters alone. `client` and `bench` (`dllm bench-serve`) load a server
from outside.

Endpoints: POST /v1/completions (raw prompt, like `dllm generate --no-chat`), POST /v1/chat/completions (the
tokenizer's chat template, like `dllm generate`), GET /v1/models, /health, /metrics (Prometheus). Decoding
parameters ride in the request body next to OpenAI's fields (the `extra_body` of OpenAI's client): `sampler`,
`cache`, `gen_length`, `block_length`, `steps`, `sampler_args`, `cache_args` and any sampler or cache parameter
by name. Bad input is HTTP 400 with the CLI's one-line message."""
from .client import load, post
from .engine_client import EngineClient
from .engine_process import EngineSpec
from .http import LocalServer, create_app, server
from .scheduler import Engine

__all__ = ["Engine", "EngineClient", "EngineSpec", "LocalServer", "create_app", "load", "post", "server"]
