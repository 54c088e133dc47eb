"""What the HTTP process and the engine process say to each other over ZeroMQ: typed msgspec messages (MessagePack,
positional fields, a tag naming the kind), one decoder per direction.

To the engine (`ToEngine`): `Add`, a request validated by the HTTP process (its prompt ids and its decoding);
`Abort`, requests whose client left or whose stop string ended them; `Shutdown`, finish or stop. From the engine
(`FromEngine`): `Ready` once its model is loaded; `Outputs` after every block (each request's newly final tokens, a
`Delta`, and the engine's counters, `Stats`) and every idle second; `Steps` after a step, for requests that asked
for step events; `Exit` as it stops (why, and a crash's traceback)."""
from __future__ import annotations

from typing import Any

import msgspec

from ..engine.logprobs import TokenLogprob


class _Message(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    pass


class Add(_Message):
    """A request to decode: what `dllm generate` would be given for one prompt, validated."""

    req_id: str
    prompt: list[int]  # token ids
    gen_length: int
    block_length: int
    steps_per_block: int
    sampler: dict[str, Any]  # `Sampler.config()`: its name and parameters
    cache: dict[str, Any]  # `Cache.config()`
    guidance: dict[str, Any]  # `Guidance.config()`: LLaDA's cfg_scale, logits_eos_inf, confidence_eos_eot_inf
    seed: int
    max_tokens: int | None = None  # the answer is complete at this many tokens
    stop_early: bool = True  # False: decode every block (ignore_eos)
    logprobs: int | None = None  # alternatives per answer token with its log-probability (None: none asked)
    step_events: bool = False  # send a `StepEvent` after every step that changed the answer's canvas
    request_id: str = ""  # the client's X-Request-ID (or the server's), for the engine's log lines


class Abort(_Message):
    """Stop these requests' rows at the next step (ids the engine does not hold are ignored)."""

    req_ids: list[str]


class Shutdown(_Message):
    """Take no more requests; let those in flight finish for at most `timeout` seconds (0: end them now), then
    exit."""

    timeout: float


class Delta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request's news after a block: its answer's tokens from `start` on (the newly final ones, left to right; the
    HTTP side makes the text), with their log-probabilities when asked; `finish_reason` once the answer is complete;
    or an error (`status`, `message`) that ends it."""

    req_id: str
    start: int = 0
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" (a stop token) or "length"
    status: int = 0  # an error's HTTP status (400: the request cannot decode; 500: it failed; 503: shutting down)
    message: str = ""


class StepEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one decoding step did to a request's answer canvas (`Add.step_events`), positions counted from the
    answer's first: tokens committed (or rewritten), positions re-masked (taken back), and on a uniform-state model
    the new random or draft tokens of positions not yet committed."""

    req_id: str
    step: int  # the request's steps so far (1, 2, ...)
    block: int  # the batch's block
    forwards: int  # the batch's forwards since the request joined it
    committed: list[tuple[int, int]] = []  # (position, token)
    remasked: list[int] = []
    drafts: list[tuple[int, int]] = []  # (position, token), uniform-state models


class PrefixStats(msgspec.Struct, array_like=True, gc=False):
    """The prefix cache's counters (`cache.PrefixBlocks`)."""

    queried: int
    hits: int
    evicted: int
    nbytes: int
    blocks: int


class Stats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The engine's own numbers: gauges now, counters since it started, and two rates over its last second."""

    waiting: int = 0  # requests waiting for a batch slot
    rows: int = 0  # rows in the running batches
    batches: int = 0
    forwards: int = 0
    committed: int = 0  # tokens committed by the sampler
    rows_computed: int = 0  # token rows the network computed, summed over layers
    steps: int = 0
    busy_seconds: float = 0.0  # inside the decode loop (`Batch.run_block`)
    held_seconds: float = 0.0  # holding at least one request (waiting or running)
    seconds: float = 0.0  # since the engine started
    busy: float = 0.0  # share of the last second spent inside the decode loop
    steps_per_s: float = 0.0  # over the last second
    rows_per_step: list[int] = []  # steps run, by the rows of their batch (index: rows)
    prefix: PrefixStats | None = None


class Ready(_Message):
    pid: int


class Outputs(_Message):
    deltas: list[Delta]
    stats: Stats


class Steps(_Message):
    """The step events of the rows that asked, sent after each step (before the block's `Outputs`)."""

    events: list[StepEvent]


class Exit(_Message):
    reason: str  # "shutdown" or "error"
    error: str = ""  # the traceback of an error


ToEngine = Add | Abort | Shutdown
FromEngine = Ready | Outputs | Steps | Exit

encode = msgspec.msgpack.Encoder().encode
to_engine = msgspec.msgpack.Decoder(ToEngine).decode
from_engine = msgspec.msgpack.Decoder(FromEngine).decode
