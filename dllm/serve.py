"""`dllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, extra `serve`) over the engine's `Batch`.

One engine thread runs the decode loop. Requests wait in a queue and join the running batch between blocks
(continuous batching) when the batch's sampler and cache allow it (`Batch.joins_between_blocks`); otherwise a
batch is formed from the waiting requests and runs to its end. Requests share a batch only when they decode with
the same sampler, cache and block layout; each row has its own random stream, so an answer is the one
`dllm generate` gives for that prompt and those parameters alone.

Endpoints: POST /v1/completions (raw prompt, like `dllm generate --no-chat`), POST /v1/chat/completions (the
tokenizer's chat template, like `dllm generate`), GET /v1/models, /health, /metrics (Prometheus). Decoding
parameters ride in the request body next to OpenAI's fields (the `extra_body` of OpenAI's client): `sampler`,
`cache`, `gen_length`, `block_length`, `steps`, `sampler_args`, `cache_args` and any sampler or cache parameter
by name. Bad input is HTTP 400 with the CLI's one-line message."""

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from .engine import (Batch, Canvas, answer_text, check_int, check_plain_text, check_policies, check_seed,
                     decoding_lengths, encode_prompts, lengths_for_answer, split_params)
from .errors import DllmError

OPENAI_FIELDS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "seed", "stream",
                 "n", "stop", "user", "stream_options", "ignore_eos",  # ignore_eos as vLLM: decode every block
                 "top_p", "frequency_penalty", "presence_penalty"}
NEUTRAL = {"top_p": 1, "frequency_penalty": 0, "presence_penalty": 0}  # what clients send by default; no other value
LAYOUT_FIELDS = ("gen_length", "block_length", "steps")


class ShuttingDown(Exception):
    pass


@dataclass
class Job:
    """One request: what to decode and where its events go (an asyncio queue, fed from the engine thread)."""

    ids: list[int]
    lengths: dict[str, int | None]
    max_tokens: int | None
    seed: int
    sampler: Any
    cache: Any
    stop: list[str]
    stream: bool
    chat: bool
    key: tuple  # requests with equal keys can share a batch
    steps_per_block: int = 0
    stop_early: bool = True
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: float = field(default_factory=time.time)
    submitted: float = field(default_factory=time.perf_counter)
    first_block: float | None = None
    text: str = ""  # answer text sent so far
    delivered: bool = False

    def send(self, kind: str, **payload) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, {"kind": kind, **payload})


class Metrics:
    """Prometheus metrics of one server (its own registry)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("dllm_requests", "Requests answered, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("dllm_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.tokens = Counter("dllm_generated_tokens", "Answer tokens sent", registry=r)
        self.committed = Counter("dllm_committed_tokens", "Tokens committed by the sampler", registry=r)
        self.forwards = Counter("dllm_forwards", "Model forwards", registry=r)
        self.tokens_per_forward = Gauge("dllm_tokens_per_forward", "Committed tokens per forward (all rows), "
                                        "since start", registry=r)
        self.queue = Gauge("dllm_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.rows = Gauge("dllm_batch_rows", "Rows in the running batch", registry=r)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.latency = Histogram("dllm_request_latency_seconds", "Request latency, submit to last block",
                                 buckets=buckets, registry=r)
        self.first_block = Histogram("dllm_first_block_seconds", "Submit to the first final block",
                                     buckets=buckets, registry=r)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def _stop_start(text: str, stops: list[str]) -> int:
    """The length of the longest end of `text` that begins one of `stops` (0 if none)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def _tokens_through_stop(tokenizer, ids: list[int], stops: list[str]) -> int:
    """How many of `ids` it takes for the text to contain one of `stops` (as vLLM counts a stopped completion)."""
    low, high = 1, len(ids)
    while low < high:  # a stop found in a prefix stays found in every longer one
        mid = (low + high) // 2
        text = answer_text(tokenizer, ids[:mid])
        low, high = (low, mid) if any(s in text for s in stops) else (mid + 1, high)
    return low


class Engine:
    """The decode loop's driver: admits waiting jobs between blocks, runs blocks, sends each job its new text."""

    def __init__(self, model, tokenizer, name: str, defaults: dict[str, Any], max_batch: int = 8,
                 compile: bool = False):
        check_int("max_batch", max_batch, 1)
        self.model, self.tokenizer, self.name, self.defaults = model, tokenizer, name, defaults
        self.max_batch, self.compile = max_batch, compile
        self.metrics = Metrics()
        self.waiting: deque[Job] = deque()
        self.cond = threading.Condition()
        self.batch: Batch | None = None
        self.jobs: dict[Any, Job] = {}  # the batch's rows -> their requests
        self.draining = self.stopping = False
        self.key: tuple | None = None  # the running batch's Job.key
        self.forwards = self.committed = 0
        self.samplers: dict[tuple, Any] = {}  # prepared samplers by configuration, least recently used first
        self.thread = threading.Thread(target=self._run, name="dllm-engine", daemon=True)

    # -- requests ---------------------------------------------------------------------------------------------
    def job(self, body: Any, chat: bool) -> Job:
        """Validate a request body into a Job (DllmError: the one-line reason)."""
        if not isinstance(body, dict):
            raise DllmError("the request body must be a JSON object")
        if body.get("model") not in (None, self.name):
            raise DllmError(f"model {body['model']!r} is not served here; this server serves {self.name!r} "
                            f"(GET /v1/models)")
        if body.get("n", 1) != 1:
            raise DllmError(f"n must be 1, got {body['n']!r}; send one request per answer")
        for name, neutral in NEUTRAL.items():
            if body.get(name, neutral) not in (None, neutral):
                raise DllmError(f"{name} is not supported (the sampler decides what to commit); drop it or send "
                                f"{neutral}")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise DllmError(f"stream must be true or false, got {stream!r}")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise DllmError(f"ignore_eos must be true or false, got {ignore_eos!r}")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise DllmError(f"stop must be a string or a list of non-empty strings, got {body.get('stop')!r}")
        ids = self._prompt_ids(body, chat)
        params = {k: v for k, v in body.items() if k not in OPENAI_FIELDS and k not in LAYOUT_FIELDS
                  and k not in ("sampler", "cache", "sampler_args", "cache_args")}
        if body.get("temperature") is not None:
            params["temperature"] = body["temperature"]
        for name in ("sampler_args", "cache_args"):
            if not isinstance(body.get(name) or {}, dict):
                raise DllmError(f"{name} must be a JSON object of parameters, got {body[name]!r}")
        d = self.defaults
        same_sampler = body.get("sampler", d["sampler"]) == d["sampler"]
        same_cache = body.get("cache", d["cache"]) == d["cache"]
        sampler, cache = split_params(
            body.get("sampler", d["sampler"]), body.get("cache", d["cache"]), params,
            {**(d["sampler_args"] if same_sampler else {}), **(body.get("sampler_args") or {})},
            {**(d["cache_args"] if same_cache else {}), **(body.get("cache_args") or {})})
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None:
            check_int("max_tokens", max_tokens, 1)
        layout = {k: body.get(k, d.get(k)) for k in LAYOUT_FIELDS}
        lengths = lengths_for_answer(decoding_lengths(self.model, **layout), max_tokens)
        lengths = decoding_lengths(self.model, **lengths)  # validated again after rounding
        seed = check_seed(body.get("seed", d["seed"]))
        Canvas.check(self.model, [ids], lengths["gen_length"])  # prompt too long etc.
        check_policies(self.model, sampler, cache, self.compile)
        sampler_key = (sampler.name, json.dumps(sampler.config(), sort_keys=True, default=str))
        sampler = self._prepared(sampler_key, sampler)
        block, gen = lengths["block_length"], lengths["gen_length"]
        steps_per_block = (lengths["steps"] or gen) // (gen // block)
        key = (*sampler_key, cache.name, json.dumps(cache.config(), sort_keys=True, default=str), block,
               steps_per_block, not ignore_eos)
        if not (sampler.block_local and cache.block_fresh):
            key += (gen,)  # a batch that runs to its end decodes one layout
        if cache.rows_coupled:
            key += (uuid.uuid4().hex,)  # decoded alone, so the answer is the prompt's alone
        return Job(ids, lengths, max_tokens, seed, sampler, cache, stop, stream, chat, key,
                   steps_per_block=steps_per_block, stop_early=not ignore_eos)

    def _prepared(self, key: tuple, sampler):
        """One prepared sampler object per configuration (the last 32 used): `prepare` reads the tokenizer once
        (AdaBlock scans the whole vocabulary), and a sampler keeps no per-run state, so requests share it."""
        with self.cond:
            known = self.samplers.pop(key, None)
        if known is None:
            sampler.prepare(self.tokenizer)
            known = sampler
        with self.cond:
            self.samplers[key] = known
            while len(self.samplers) > 32:
                self.samplers.pop(next(iter(self.samplers)))
        return known

    def _prompt_ids(self, body: dict, chat: bool) -> list[int]:
        tok = self.tokenizer
        if not chat:
            prompt = body.get("prompt")
            if prompt is None:
                raise DllmError("prompt is missing; give a string (or a list of token ids)")
            if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                if len(prompt) > 1:
                    raise DllmError("send one prompt per request (got a list of strings)")
                prompt = prompt[0]
            return encode_prompts(tok, [prompt], chat=False)[0]
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise DllmError("messages must be a non-empty list of {\"role\": ..., \"content\": \"text\"} objects")
        if getattr(tok, "chat_template", None) is None:
            raise DllmError("this model's tokenizer has no chat template; use /v1/completions")
        for i, m in enumerate(messages):
            check_plain_text(tok, m["content"], f"message {i}")
        if len(messages) == 1 and messages[0]["role"] == "user":
            return encode_prompts(tok, [messages[0]["content"]], chat=True)[0]  # exactly `dllm generate`'s
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return encode_prompts(tok, [text], chat=False)[0]

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.draining:
                raise ShuttingDown("the server is shutting down; send the request to another instance")
            self.waiting.append(job)
            self.metrics.queue.set(len(self.waiting))
            self.cond.notify()

    # -- the engine thread ------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Cancel what is left and end the thread (after uvicorn's bounded graceful shutdown)."""
        with self.cond:
            self.draining = self.stopping = True
            for job in list(self.waiting) + list(self.jobs.values()):
                job.cancelled = True
            self.cond.notify()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self.cond:
                while not (self.waiting or self.jobs or self.stopping):
                    self.cond.wait()
                if self.stopping and not self.jobs:
                    for job in self.waiting:
                        job.send("error", status=503, message="the server is shutting down")
                    return
            try:
                self._admit()
                if self.jobs:
                    self._block()
            except Exception as error:  # every request of the batch gets the message, once; the server goes on
                message = str(error) if isinstance(error, DllmError) else f"{type(error).__name__}: {error}"
                for job in self.jobs.values():
                    job.send("error", status=400 if isinstance(error, DllmError) else 500, message=message)
                    self.metrics.requests.labels(self._endpoint(job), "error").inc()
                self.jobs, self.batch = {}, None

    def _admit(self) -> None:
        """Between blocks: drop delivered and cancelled rows, then fill free slots from the queue (FIFO; a
        request that cannot share the batch waits until the batch drains)."""
        batch = self.batch
        if batch is not None:
            leaving = [row for row, job in self.jobs.items() if job.delivered or job.cancelled]
            if batch.joins_between_blocks:
                for row in leaving:
                    batch.remove(row)
                    del self.jobs[row]
            elif len(leaving) == len(self.jobs):
                self.jobs = {}
            if not self.jobs:
                self.batch = batch = None
        if batch is not None and batch.block and not batch.joins_between_blocks:
            return
        with self.cond:
            while self.waiting and len(self.jobs) < self.max_batch:
                job = self.waiting[0]
                if job.cancelled:
                    self.waiting.popleft()
                    continue
                if batch is not None and job.key != self.key:
                    break
                self.waiting.popleft()
                try:
                    if batch is None:
                        batch = self.batch = Batch(self.model, job.sampler, job.cache, job.lengths["block_length"],
                                                   job.steps_per_block, stop_early=job.stop_early, compile=self.compile,
                                                   callback=self._step)
                        self.key = job.key
                    row = batch.add(job.ids, job.lengths["gen_length"], job.seed)
                except Exception as e:  # checked in `job` already; this request alone gets any error left
                    job.send("error", status=400 if isinstance(e, DllmError) else 500,
                             message=str(e) if isinstance(e, DllmError) else f"{type(e).__name__}: {e}")
                    self.metrics.requests.labels(self._endpoint(job), "error").inc()
                    continue
                self.jobs[row] = job
            self.metrics.queue.set(len(self.waiting))
        self.metrics.rows.set(len(self.jobs))

    def _step(self, info: dict) -> None:
        """After every step: a cancelled request's row stops decoding (it leaves at the block's end)."""
        for row, job in self.jobs.items():
            if job.cancelled and not job.delivered:
                self.batch.cancel(row)
                job.delivered = True
                self.metrics.requests.labels(self._endpoint(job), "cancelled").inc()

    def _block(self) -> None:
        batch, metrics = self.batch, self.metrics
        nfe, committed = batch.stats.nfe, batch.stats.gen_tokens
        batch.run_block()
        self.forwards += batch.stats.nfe - nfe
        self.committed += batch.stats.gen_tokens - committed
        metrics.forwards.inc(batch.stats.nfe - nfe)
        metrics.committed.inc(batch.stats.gen_tokens - committed)
        metrics.tokens_per_forward.set(self.committed / self.forwards if self.forwards else 0.0)
        now = time.perf_counter()
        for row, job in self.jobs.items():
            if job.delivered:
                continue
            if job.first_block is None:
                job.first_block = now
                metrics.first_block.observe(now - job.submitted)
            self._deliver(batch, row, job, now)

    def _deliver(self, batch: Batch, row, job: Job, now: float) -> None:
        """Send the text of `row`'s newly decoded blocks; at its end the finish reason and usage."""
        answer, finished, stop_token = batch.answer(row), batch.done(row), row.finished
        over = job.max_tokens is not None and len(answer) > job.max_tokens  # cut at max_tokens
        ids = answer[:job.max_tokens] if job.max_tokens is not None else answer
        text = answer_text(self.tokenizer, ids)
        hits = [i for i in (text.find(s) for s in job.stop) if i >= 0]
        text = text[:min(hits)] if hits else text
        done = finished or bool(hits) or job.max_tokens is not None and len(ids) >= job.max_tokens
        if not done:  # text that may begin a stop string waits for the next block
            text = text[:len(text) - _stop_start(text, job.stop)]
        if done or not text.endswith("\ufffd"):  # a character split between blocks waits for its end
            delta, job.text = text[len(job.text):], text
            if delta and job.stream:
                job.send("delta", text=delta)
        if not done:
            return
        if not finished:
            batch.cancel(row)  # complete at max_tokens or a stop string: the row stops decoding
        job.delivered = True
        reason = "stop" if hits or stop_token and not over else "length"
        if hits:  # tokens decoded past the stop string are not the answer's
            ids = ids[:_tokens_through_stop(self.tokenizer, ids, job.stop)]
        usage = {"prompt_tokens": len(job.ids), "completion_tokens": len(ids), "total_tokens": len(job.ids) + len(ids)}
        job.send("done", text=job.text, finish_reason=reason, usage=usage)
        metrics = self.metrics
        metrics.tokens.inc(len(ids))
        metrics.prompt_tokens.inc(len(job.ids))
        metrics.latency.observe(now - job.submitted)
        metrics.requests.labels(self._endpoint(job), "ok").inc()

    @staticmethod
    def _endpoint(job: Job) -> str:
        return "chat" if job.chat else "completions"


def create_app(engine: Engine):
    """The FastAPI application over `engine` (started and stopped with the app's lifespan)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="dllm", lifespan=lifespan)

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    async def answer(request: Request, chat: bool):
        raw = await _read_body(request)
        if raw is None:
            return error(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB; send a shorter prompt")
        try:
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"the request body is not valid JSON ({e}); send a JSON object")
        try:
            job = await asyncio.to_thread(engine.job, body, chat)  # tokenizing a long prompt: off the event loop
        except DllmError as e:
            engine.metrics.requests.labels("chat" if chat else "completions", "bad_request").inc()
            return error(400, str(e))
        job.loop, job.events = asyncio.get_running_loop(), asyncio.Queue()
        try:
            engine.submit(job)
        except ShuttingDown as e:
            return error(503, str(e), "unavailable")
        base = {"id": ("chatcmpl-" if chat else "cmpl-") + job.id, "created": int(job.created), "model": engine.name}
        if job.stream:
            return StreamingResponse(_sse(job, base, chat, request), media_type="text/event-stream")
        while True:
            event = await _next_event(job, request)
            if event is None:
                return Response(status_code=499)
            if event["kind"] == "error":
                return error(event["status"], event["message"], "server_error")
            if event["kind"] == "done":
                choice = {"index": 0, "finish_reason": event["finish_reason"]}
                if chat:
                    choice["message"] = {"role": "assistant", "content": event["text"]}
                else:
                    choice.update(text=event["text"], logprobs=None)
                return {**base, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                        "usage": event["usage"]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": 0, "owned_by": "dllm"}]}

    @app.get("/health")
    async def health():
        if engine.draining:
            return error(503, "shutting down", "unavailable")
        return {"status": "ok", "waiting": len(engine.waiting), "running": len(engine.jobs)}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


MAX_BODY_BYTES = 4 << 20  # far past any prompt a model's context holds


async def _read_body(request) -> bytes | None:
    """The request body, or None past `MAX_BODY_BYTES` (read no further)."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > MAX_BODY_BYTES:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            return None
    return bytes(body)


async def _next_event(job: Job, request) -> dict | None:
    """The job's next event; None (and the job cancelled: its row stops at the next step) once the client has
    gone."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled = True
                return None


async def _sse(job: Job, base: dict, chat: bool, request):
    """Server-sent events: a chunk per decoded block, then the finish reason (and usage), then [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, reason: str | None, **extra) -> str:
        if chat:
            delta = {} if text is None else {"role": "assistant", "content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
        return f"data: {json.dumps({**base, 'object': kind, 'choices': [choice], **extra})}\n\n"

    try:
        while True:
            event = await _next_event(job, request)
            if event is None:
                return
            if event["kind"] == "delta":
                yield chunk(event["text"], None)
            elif event["kind"] == "error":
                yield f"data: {json.dumps({'error': {'message': event['message'], 'code': event['status']}})}\n\n"
                break
            else:
                yield chunk(None, event["finish_reason"], usage=event["usage"])
                break
        yield "data: [DONE]\n\n"
    finally:
        if not job.delivered:
            job.cancelled = True  # the client went away: its row stops at the next step


def server(app, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0, engine: Engine | None = None,
           log_level: str = "info"):
    """A uvicorn server for `app` whose SIGTERM/SIGINT first makes `engine` refuse new requests, then lets
    in-flight ones finish (at most `shutdown_timeout` seconds)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if engine is not None:
                engine.draining = True
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                 timeout_graceful_shutdown=shutdown_timeout))


class LocalServer:
    """`create_app(engine)` served on a free loopback port from a background thread (tests, `dllm bench-serve`)."""

    def __init__(self, engine: Engine):
        import socket

        self.engine = engine
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = server(create_app(engine), engine=engine, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LocalServer":
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise DllmError("the local server did not start; see the log above")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.sock.close()


def post(url: str, body: dict | bytes, timeout: float = 300.0) -> tuple[int, dict]:
    """POST a JSON body; returns the status and the decoded JSON answer (errors included)."""
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def load(url: str, bodies: list[dict], concurrency: int) -> dict:
    """Send `bodies` to `url` from `concurrency` client threads, each one request after another; returns the
    answers in order with their latencies, and the wall time."""
    from concurrent.futures import ThreadPoolExecutor

    def one(body):
        began = time.perf_counter()
        status, answer = post(url, body)
        return status, answer, time.perf_counter() - began

    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, bodies))
    return {"results": results, "seconds": time.perf_counter() - began}


def bench_serve(model, tokenizer, name: str, defaults: dict[str, Any], max_batch: int = 8, requests: int = 64,
                concurrency: tuple[int, ...] = (1, 4, 16), compile: bool = False, seed: int = 0) -> dict:
    """Throughput and latency of `requests` chat requests (synthetic tasks) at each client concurrency against a
    loopback server, and of the same prompts decoded one after another with `dllm.generate`; every served answer
    is compared with its sequential one."""
    from .engine import generate
    from .eval.synthetic import FAMILIES, make_split

    prompts = [ex.prompt for ex in make_split("test", -(-requests // len(FAMILIES)), seed=seed)][:requests]
    engine = Engine(model, tokenizer, name, defaults, max_batch, compile)
    bodies = [{"messages": [{"role": "user", "content": p}]} for p in prompts]
    job = engine.job(bodies[0], chat=True)  # the decoding every request gets
    options = dict(sampler=job.sampler, cache=job.cache, **job.lengths, seed=job.seed, chat=True, compile=compile)
    generate(model, tokenizer, prompts[0], **options)  # warm-up
    began = time.perf_counter()
    sequential = [generate(model, tokenizer, p, **options) for p in prompts]
    seconds = time.perf_counter() - began
    want = [g.texts[0] for g in sequential]
    tokens = sum(len(g.token_ids[0]) for g in sequential)
    rows = [{"concurrency": "sequential", "seconds": seconds, "requests_per_s": len(prompts) / seconds,
             "tokens_per_s": tokens / seconds, "p50_s": None, "p99_s": None, "speedup": 1.0, "errors": 0,
             "mismatches": 0}]
    with LocalServer(engine) as local:
        post(local.url + "/v1/chat/completions", bodies[0])  # warm-up
        for level in concurrency:
            run = load(local.url + "/v1/chat/completions", bodies, level)
            ok = [(answer, latency) for status, answer, latency in run["results"] if status == 200]
            texts = [answer["choices"][0]["message"]["content"] if status == 200 else None
                     for status, answer, _ in run["results"]]
            served = sum(answer["usage"]["completion_tokens"] for answer, _ in ok)
            latencies = sorted(latency for _, latency in ok) or [float("nan")]
            rows.append({"concurrency": level, "seconds": run["seconds"],
                         "requests_per_s": len(ok) / run["seconds"], "tokens_per_s": served / run["seconds"],
                         "p50_s": latencies[len(latencies) // 2],
                         "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                         "speedup": served / run["seconds"] / (tokens / seconds),
                         "errors": len(prompts) - len(ok),
                         "mismatches": sum(t is not None and t != w for t, w in zip(texts, want))})
    config = {"model": name, "sampler": job.sampler.name, "cache": job.cache.name, **job.lengths,
              "max_batch": max_batch, "requests": len(prompts), "device": str(model.device),
              "threads": torch.get_num_threads()}
    return {"config": config, "rows": rows}


def format_bench(result: dict) -> str:
    c = result["config"]
    lines = [f"{c['model']} {c['sampler']}/{c['cache']} gen {c['gen_length']} block {c['block_length']} | "
             f"max batch {c['max_batch']} | {c['requests']} requests | {c['device']}, {c['threads']} threads",
             f"{'clients':>10} {'req/s':>7} {'tok/s':>8} {'p50 s':>7} {'p99 s':>7} {'speedup':>8} {'errors':>6} "
             f"{'differ':>6}"]
    for r in result["rows"]:
        p50 = "-" if r["p50_s"] is None else f"{r['p50_s']:.3f}"
        p99 = "-" if r["p99_s"] is None else f"{r['p99_s']:.3f}"
        lines.append(f"{r['concurrency']:>10} {r['requests_per_s']:7.2f} {r['tokens_per_s']:8.1f} {p50:>7} "
                     f"{p99:>7} {r['speedup']:7.2f}x {r['errors']:6d} {r['mismatches']:6d}")
    return "\n".join(lines) + "\n"


def plot_bench(result: dict, path: str) -> bool:
    """Served tokens/s against client concurrency, sequential decoding as a line; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    served = [r for r in result["rows"] if r["concurrency"] != "sequential"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r["concurrency"] for r in served], [r["tokens_per_s"] for r in served], "o-", label="dllm serve")
    ax.axhline(result["rows"][0]["tokens_per_s"], color="grey", ls="--", label="sequential dllm.generate")
    c = result["config"]
    ax.set(xscale="log", xlabel="concurrent clients", ylabel="answer tokens / s",
           title=f"{c['model']} {c['sampler']}/{c['cache']}, max batch {c['max_batch']}")
    ax.set_xticks([r["concurrency"] for r in served], [str(r["concurrency"]) for r in served])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
