"""The HTTP process's face (FastAPI + uvicorn, extra `serve`): the OpenAI endpoints, server-sent events, body
limits, and a uvicorn server whose SIGTERM drains the engine first. The engine runs in a process of its own
(`engine_client`)."""
import asyncio
import json
import re
import signal
import threading
import time
import uuid
from importlib import resources

from ..core.errors import DllmError
from .bodies import ChatRequest, CompletionRequest
from .contract import declare
from .engine_client import EngineClient, Full, Unavailable
from .logprobs import LogprobsFormat
from .requests import Job


def create_app(engine: EngineClient):
    """The FastAPI application over `engine` (started before; its delivery starts with the app's lifespan, which
    stops the engine at its end)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

    @asynccontextmanager
    async def lifespan(app):
        engine.attach(asyncio.get_running_loop())
        yield
        await engine.close()

    app = FastAPI(title="dllm", lifespan=lifespan)
    app.add_middleware(RequestIds)
    app.openapi = lambda: app.openapi_schema or _openapi(app, engine)

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
        try:  # a long prompt is tokenized off the event loop; a short one costs less than the hop to a thread (but
            # for a new AdaBlock configuration's vocabulary scan, once: prepared samplers are kept)
            job = engine.job(body, chat) if len(raw) <= INLINE_BYTES else \
                await asyncio.to_thread(engine.job, body, chat)
        except DllmError as e:
            engine.metrics.requests.labels("chat" if chat else "completions", "bad_request").inc()
            return error(400, str(e))
        job.events, job.request_id = asyncio.Queue(), request.scope[RequestIds.KEY]
        try:
            engine.submit(job)
        except Unavailable as e:
            return error(503, str(e), "unavailable")
        except Full as e:
            answer = error(429, str(e), "rate_limit_error")
            answer.headers["Retry-After"] = str(RETRY_SECONDS)
            return answer
        base = {"id": ("chatcmpl-" if chat else "cmpl-") + job.id, "created": int(job.created), "model": engine.name}
        logprobs = LogprobsFormat(engine.tokenizer, chat)
        if job.stream:
            return StreamingResponse(_sse(engine, job, base, chat, request, logprobs), media_type="text/event-stream")
        while True:
            event = await _next_event(engine, job, request)
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

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatRequest))
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    @app.get("/", include_in_schema=False)
    async def playground():
        return HTMLResponse(PLAYGROUND)

    @app.get("/decoding")
    async def decoding():
        """The samplers and caches this server decodes with, their parameters and defaults (`dllm list --json`),
        and the server's own decoding defaults."""
        return Response(json.dumps(engine.decoding(), default=str), media_type="application/json")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": 0, "owned_by": "dllm"}]}

    @app.get("/health")
    async def health():
        status, answer = engine.health()
        return answer if status == 200 else error(status, answer, "unavailable")

    @app.get("/ready")
    async def ready():
        status, answer = engine.ready()
        return answer if status == 200 else error(status, answer, "unavailable")

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _body_schema(model) -> dict:
    """A route's request body in /openapi.json: `model` (the handler reads and checks the raw body itself, so that a
    body too large is refused before it is read and a bad one gets our one-line 400)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _openapi(app, engine: EngineClient) -> dict:
    """FastAPI's schema, with the request body models (and the models they use) among its components, made this
    server's contract (`contract.declare`)."""
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (CompletionRequest, ChatRequest):
        described = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(described.pop("$defs", {}))
        components[model.__name__] = described
    app.openapi_schema = declare(schema, engine.reader)
    return schema


PLAYGROUND = (resources.files(__package__) / "static" / "playground.html").read_text()  # the page at /, which
# decodes live over the server's own stream with step_events (same origin; nothing from another host)

MAX_BODY_BYTES = 4 << 20  # far past any prompt a model's context holds

RETRY_SECONDS = 1  # a 429's Retry-After: a block of a full batch takes about this long on a CPU

INLINE_BYTES = 16 << 10  # bodies up to this are read on the event loop

ANSWER_SECONDS = 5.0  # after the engine's drain, for the last answers to reach their clients

EXIT_AFTER = 20.0  # after the drain's deadline, the port closes even if the engine has not said it is done


class RequestIds:
    """X-Request-ID on every answer: the client's (1-128 visible ASCII characters, echoed), else a new one; a
    request's id rides to the engine (`Job.request_id`), whose log lines name it. A malformed one is a 400."""

    KEY = "dllm.request_id"  # where the handlers find it in the ASGI scope

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id")
        valid = given is not None and REQUEST_ID.fullmatch(given)
        scope[self.KEY] = given.decode() if valid else uuid.uuid4().hex
        send = _with_id(send, scope[self.KEY])
        if given is None or valid:
            return await self.app(scope, receive, send)
        body = json.dumps({"error": {"message": "X-Request-ID must be 1 to 128 visible ASCII characters; send "
                                               "another or none (the server makes one)",
                                     "type": "invalid_request_error", "code": 400}}).encode()
        await send({"type": "http.response.start", "status": 400, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


REQUEST_ID = re.compile(rb"[!-~]{1,128}")


def _with_id(send, request_id: str):
    """`send` with the X-Request-ID header added to the response's start."""
    async def sending(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
        await send(message)
    return sending


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


async def _next_event(engine: EngineClient, job: Job, request) -> dict | None:
    """The job's next event; None (and the job cancelled: its row stops at the next step) once the client has
    gone. A cancelled handler (a proxy in front, e.g. Ray Serve's, that saw the client go) cancels the job too."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                engine.cancel(job)
                return None
        except asyncio.CancelledError:
            engine.cancel(job)
            raise


async def _sse(engine: EngineClient, job: Job, base: dict, chat: bool, request, logprobs: LogprobsFormat):
    """Server-sent events: a chunk per decoded block (with its tokens' logprobs when asked), then the finish reason
    (and usage, and the logprobs of tokens whose text was not sent: a stop string's), then [DONE]. With
    step_events, a `dllm.step` event after every decoding step that changed the answer's canvas, before its
    block's chunk."""
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
            event = await _next_event(engine, job, request)
            if event is None:
                return
            if event["kind"] == "step":
                step = {k: v for k, v in event.items() if k != "kind"}
                yield f"data: {json.dumps({'id': base['id'], 'object': 'dllm.step', **step})}\n\n"
            elif event["kind"] == "delta":
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
            engine.cancel(job)  # the client went away: its row stops at the next step


def server(app, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
           engine: EngineClient | None = None, log_level: str = "info"):
    """A uvicorn server for `app`. SIGTERM/SIGINT drain: the port stays open and new requests (and /ready) get 503
    while the engine lets those in flight finish for at most `shutdown_timeout` seconds (then answers them 503) and
    exits; then uvicorn closes the port, waits `ANSWER_SECONDS` at most for the last answers to go out, and the
    server exits 0 (uvicorn would re-raise the signal). A second signal closes the port at once. An engine that
    fails for good stops the server too (`engine.failed`: `dllm serve` exits 1)."""
    import uvicorn

    class Server(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame):
            if engine is None or self.draining:
                return super().handle_exit(sig, frame)
            self.draining = True  # uvicorn's shutdown (the port closed) waits for the engine's drain: `drained`
            engine.drain_soon(shutdown_timeout)
            hung = threading.Timer(shutdown_timeout + EXIT_AFTER, self.drained)  # (an engine that hangs)
            hung.daemon = True
            hung.start()

        def drained(self):
            self.should_exit = True

        def run(self, sockets=None):
            # uvicorn re-raises the signal it caught once it has shut down, under the handlers it found: with ours
            # the process ends with its own status, not the signal's
            main = threading.current_thread() is threading.main_thread()
            found = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)} \
                if main else {}
            try:
                return super().run(sockets)
            finally:
                for sig, handler in found.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=ANSWER_SECONDS if engine else shutdown_timeout)
    served = Server(config)
    if engine is not None:
        engine.on_fatal = engine.on_drained = served.drained
    return served


class LocalServer:
    """`create_app(engine)` served on a free loopback port from a background thread (tests, `dllm bench-serve`); the
    engine is started first where it has not been."""

    def __init__(self, engine: EngineClient):
        import socket

        self.engine = engine
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = server(create_app(engine), engine=engine, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LocalServer":
        if self.engine.state == "new":
            self.engine.start()
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
