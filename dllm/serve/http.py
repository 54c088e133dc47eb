"""The HTTP face of the engine (FastAPI + uvicorn, extra `serve`): the OpenAI endpoints, server-sent events, body
limits, and a uvicorn server whose SIGTERM drains the engine first."""
import asyncio
import json
import threading
import time

from ..core.errors import DllmError
from .logprobs import LogprobsFormat
from .requests import Job
from .scheduler import Engine, ShuttingDown


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

    def feed(job: Job, event: dict) -> None:
        """An engine event, on the event loop: a block's ids become the job's text events (`Job.read`)."""
        if job.complete:  # a stop string ended it; the engine's later blocks are not the answer's
            return
        events = [event] if event["kind"] == "error" else job.read(engine.tokenizer, event["ids"], event["done"],
                                                                     event["reason"], event["logprobs"])
        for e in events:
            job.events.put_nowait(e)
            if e["kind"] == "done":
                engine.metrics.answered("chat" if job.chat else "completions", e["usage"],
                                        time.perf_counter() - job.submitted)

    async def answer(request: Request, chat: bool):
        raw = await _read_body(request)
        if raw is None:
            return error(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB; send a shorter prompt")
        try:
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"the request body is not valid JSON ({e}); send a JSON object")
        try:  # a long prompt is tokenized off the event loop; a short one costs less than the hop to a thread (but
            # for a new AdaBlock configuration's vocabulary scan, once: prepared samplers are kept)
            job = engine.job(body, chat) if len(raw) <= INLINE_BYTES else \
                await asyncio.to_thread(engine.job, body, chat)
        except DllmError as e:
            engine.metrics.requests.labels("chat" if chat else "completions", "bad_request").inc()
            return error(400, str(e))
        loop, job.events = asyncio.get_running_loop(), asyncio.Queue()
        job.emit = lambda event: loop.call_soon_threadsafe(feed, job, event)
        try:
            engine.submit(job)
        except ShuttingDown as e:
            return error(503, str(e), "unavailable")
        base = {"id": ("chatcmpl-" if chat else "cmpl-") + job.id, "created": int(job.created), "model": engine.name}
        logprobs = LogprobsFormat(engine.tokenizer, chat)
        if job.stream:
            return StreamingResponse(_sse(job, base, chat, request, logprobs), media_type="text/event-stream")
        while True:
            event = await _next_event(job, request)
            if event is None:
                return Response(status_code=499)
            if event["kind"] == "error":
                return error(event["status"], event["message"], "server_error")
            if event["kind"] == "done":
                choice = {"index": 0, "finish_reason": event["finish_reason"],
                          "logprobs": None if event["logprobs"] is None else logprobs(event["logprobs"])}
                if chat:
                    choice["message"] = {"role": "assistant", "content": event["text"]}
                else:
                    choice["text"] = event["text"]
                return Response(json.dumps({**base, "object": "chat.completion" if chat else "text_completion",
                                            "choices": [choice], "usage": event["usage"]}),
                                media_type="application/json")

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

INLINE_BYTES = 16 << 10  # bodies up to this are read on the event loop


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
    gone. A cancelled handler (a proxy in front, e.g. Ray Serve's, that saw the client go) cancels the job too."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled = True
                return None
        except asyncio.CancelledError:
            job.cancelled = True
            raise


async def _sse(job: Job, base: dict, chat: bool, request, logprobs: LogprobsFormat):
    """Server-sent events: a chunk per decoded block (with its tokens' logprobs when asked), then the finish reason
    (and usage, and the logprobs of tokens whose text was not sent: a stop string's), then [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, reason: str | None, tokens: list | None, **extra) -> str:
        choice = {"index": 0, "finish_reason": reason, "logprobs": logprobs(tokens) if tokens else None}
        if chat:
            choice["delta"] = {} if text is None else {"role": "assistant", "content": text}
        else:
            choice["text"] = text or ""
        return f"data: {json.dumps({**base, 'object': kind, 'choices': [choice], **extra})}\n\n"

    try:
        while True:
            event = await _next_event(job, request)
            if event is None:
                return
            if event["kind"] == "delta":
                yield chunk(event["text"], None, event["logprobs"])
            elif event["kind"] == "error":
                yield f"data: {json.dumps({'error': {'message': event['message'], 'code': event['status']}})}\n\n"
                break
            else:
                yield chunk(None, event["finish_reason"], event["logprobs"], usage=event["usage"])
                break
        yield "data: [DONE]\n\n"
    finally:
        if not job.complete:
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
