"""The HTTP process's side of the engine: it starts the engine (a child process, `engine_process`; for tests the same
`serve` on a thread), sends it each validated request (`Add`) and the aborts, turns its deltas into each request's
events (text, stop strings, logprobs: `Job.read`), exports its numbers, and notices when it dies.

Everything but the start runs on the HTTP server's event loop: a reader thread hands each message from the engine
to the loop, a watcher thread the engine's exit. An engine that dies answers every request in flight with an error
(503 when a new engine will be started, else 500); then, with `restart`, a new engine is started (at most
`RESTARTS` in `RESTART_WINDOW` seconds), else `on_fatal` is called (`dllm serve` exits non-zero)."""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from typing import Any, Callable

from ..cache import CACHES, PrefixBlocks
from ..core.errors import DllmError, DllmNotice
from .engine_process import EngineSpec, serve
from .messages import Abort, Delta, Exit, Outputs, Ready, Shutdown, Stats, Steps, encode, from_engine
from .metrics import Metrics
from .requests import Job, RequestReader
from .scheduler import Engine

READY_SECONDS = 600.0  # a new engine process has this long to load its model
RESTARTS, RESTART_WINDOW = 3, 300.0  # at most this many engine restarts in this many seconds
EXIT_SECONDS = 10.0  # after its drain deadline, an engine process has this long to exit before it is killed
SILENT_SECONDS = 10.0  # an engine not heard from for this long is not ready (it sends its numbers every second)


class Unavailable(Exception):
    """The server takes no request now (HTTP 503): it is shutting down, or its engine is starting or has died."""


class Full(Exception):
    """`max_waiting` requests wait for a batch slot already (HTTP 429 with Retry-After)."""


class _Link:
    """One engine (a generation of it): its sockets, and its process or thread."""

    def __init__(self, context, make_engine: Callable[[], Engine] | None, spec: EngineSpec | None):
        import zmq

        self.directory = tempfile.mkdtemp(prefix="dllm-engine-")  # private (0700): the sockets' files
        inbox, outbox = f"ipc://{self.directory}/in", f"ipc://{self.directory}/out"
        self.push, self.pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.bind(inbox)
        self.pull.bind(outbox)
        self.exit: Exit | None = None
        self.code: int | None = None
        self.lost = False  # known dead (its Exit said it failed, or its process ended): its requests were ended
        self.heard = time.monotonic()  # when the engine last sent a message
        self.stopping = False  # its reader thread ends
        self.followed = False  # a reader thread owns `pull`
        if spec is not None:
            self.process = subprocess.Popen(spec.argv(inbox, outbox))
            self.pid, self.thread = self.process.pid, None
        else:
            self.process, self.pid = None, os.getpid()
            self.thread = threading.Thread(target=lambda: setattr(self, "code", serve(make_engine, inbox, outbox)),
                                           name="dllm-engine", daemon=True)
            self.thread.start()

    def wait_ready(self, timeout: float) -> None:
        """Until the engine says Ready (DllmError: it stopped first, or did not answer in `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while not self.pull.poll(100):
            if not self.alive():
                raise DllmError(f"the engine did not start: it exited with code {self.returncode()}; see its log "
                                f"above")
            if time.monotonic() > deadline:
                self.kill()
                raise DllmError(f"the engine did not load its model within {timeout:.0f} s")
        message = from_engine(self.pull.recv())
        if isinstance(message, Exit):
            self.join(EXIT_SECONDS)
            raise DllmError(f"the engine did not start: {_last_line(message.error)}")
        assert isinstance(message, Ready), message
        self.heard = time.monotonic()

    def alive(self) -> bool:
        return self.process.poll() is None if self.process is not None else self.thread.is_alive()

    def returncode(self) -> int | None:
        return self.process.poll() if self.process is not None else self.code

    def send(self, message) -> bool:
        """Send without waiting; False where no engine is connected (it has died)."""
        import zmq

        try:
            self.push.send(encode(message), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def wait(self) -> int:
        """Until the engine has ended; its exit status."""
        if self.process is not None:
            return self.process.wait()
        self.thread.join()
        return self.code if self.code is not None else 1

    def join(self, timeout: float) -> None:
        """Wait for the engine to end for at most `timeout` seconds, then kill its process."""
        if self.process is not None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        else:
            self.thread.join(timeout)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def close(self) -> None:
        self.stopping = True
        self.push.close(linger=0)
        if not self.followed:
            self.pull.close(linger=0)
        shutil.rmtree(self.directory, ignore_errors=True)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].removeprefix(f"{DllmError.__module__}.{DllmError.__name__}: ") if lines else "no reason given"


class EngineClient:
    """The engine as the HTTP side sees it. `reader` validates request bodies into Jobs (on the model without its
    weights); `spec` is the engine process to start, or `engine` a ready engine to run on a thread (tests).
    `start` (blocking) launches it and waits until its model is loaded; `attach` (on the event loop) starts the
    delivery; `submit`, `cancel`, `drain` and `close` run on the event loop."""

    def __init__(self, reader: RequestReader, spec: EngineSpec | None = None, engine: Engine | None = None,
                 restart: bool = False, metrics: Metrics | None = None, ready_timeout: float = READY_SECONDS,
                 max_waiting: int = 256):
        import zmq

        if (spec is None) == (engine is None):
            raise DllmError("an engine client needs an engine spec (a process) or an engine (a thread), not both")
        self.reader, self.spec, self.engine, self.restart = reader, spec, engine, restart
        self.prefix_cache_mb = spec.prefix_cache_mb if spec is not None else (1 if engine.prefix else 0)
        self.metrics = metrics or Metrics(with_prefix_cache=bool(self.prefix_cache_mb))
        self.ready_timeout = ready_timeout
        # requests in flight at most: a full batch and `max_waiting` waiting for a slot (the engine admits a waiting
        # request whenever a slot is free, so requests wait only behind a full batch)
        self.max_waiting = max_waiting
        self.max_jobs = (spec.max_batch if spec is not None else engine.max_batch) + max_waiting
        self.context = zmq.Context.instance()
        self.jobs: dict[str, Job] = {}  # requests in flight, by id (touched on the event loop only)
        self.link: _Link | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.state = "new"  # new, ready, draining, restarting, dead, closed
        self.stats = Stats()  # the engine's latest numbers
        self.restarts: deque[float] = deque()
        self.failed = False  # the engine died and no new one was started: the server exits non-zero
        self.failure = ""  # why, in a line
        self.on_fatal: Callable[[], None] | None = None
        self.on_drained: Callable[[], None] | None = None  # a drain is over: the engine has exited
        self.drain_timeout = 0.0

    @classmethod
    def spawn(cls, spec: EngineSpec, defaults: dict[str, Any], name: str | None = None, restart: bool = False,
              metrics: Metrics | None = None, max_waiting: int = 256) -> EngineClient:
        """A client of the engine process `spec` describes (started by `start`), which checks requests on the model
        without its weights; `defaults`: the server's decoding defaults (`requests.served_defaults`)."""
        model, tokenizer = spec.load(weights=False)
        return cls(RequestReader(model, tokenizer, name or spec.model, defaults, spec.compile), spec, restart=restart,
                   metrics=metrics, max_waiting=max_waiting)

    @classmethod
    def on_thread(cls, model, tokenizer, name: str, defaults: dict[str, Any], max_batch: int = 8,
                  compile: bool = False, prefix_cache_mb: float = 0) -> EngineClient:
        """The same engine on a thread of this process, over `model` as loaded, behind the same messages (tests
        that reach into the engine, `client.engine`)."""
        engine = Engine(model, tokenizer, max_batch, compile, prefix_cache_mb)
        return cls(RequestReader(model, tokenizer, name, defaults, compile), engine=engine)

    @property
    def name(self) -> str:
        return self.reader.name

    @property
    def tokenizer(self):
        return self.reader.tokenizer

    @property
    def pid(self) -> int | None:
        """The engine process's pid (this process's for a thread)."""
        return self.link.pid if self.link is not None else None

    # -- before serving ---------------------------------------------------------------------------------------
    def job(self, body: Any, chat: bool) -> Job:
        """Validate a request body into a Job (DllmError: the one-line reason)."""
        return self.reader.job(body, chat)

    def decoding(self) -> dict[str, Any]:
        """GET /decoding: the samplers, caches and defaults requests may choose from (`RequestReader.decoding`)."""
        return self.reader.decoding()

    def check_defaults(self) -> None:
        """Fail now (DllmError) on defaults that would fail every request: they decode a one-token prompt; a
        prefix cache needs a model and a default cache that keep finished blocks."""
        import warnings

        reader = self.reader
        cache = reader.defaults["cache"]
        if self.prefix_cache_mb:
            PrefixBlocks(reader.model, self.prefix_cache_mb)  # the model keeps decoded blocks' keys fixed
            if not CACHES.get(cache).keeps_final_blocks:
                raise DllmError(f"--prefix-cache-mb reuses the keys and values cache 'block' keeps; the default cache "
                                f"{cache!r} recomputes them: use --cache block or drop --prefix-cache-mb")
        try:
            with warnings.catch_warnings():  # a one-token prompt is outside any prompt format: not the user's
                warnings.simplefilter("ignore", DllmNotice)
                self.job({"prompt": [reader.model.config.filler_id]}, chat=False)
        except DllmError as e:
            raise DllmError(f"the server's defaults cannot answer any request: {e}") from None

    def start(self) -> None:
        """Launch the engine and wait until it has loaded its model (DllmError: it did not start)."""
        self.link = self._launch()
        self.state = "ready"

    def _launch(self) -> _Link:
        link = _Link(self.context, (lambda: self.engine) if self.engine is not None else None, self.spec)
        try:
            link.wait_ready(self.ready_timeout)
        except BaseException:
            link.kill()
            link.close()
            raise
        return link

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start delivering the engine's messages on `loop` (the server's event loop)."""
        self.loop = loop
        self._follow(self.link)

    def _follow(self, link: _Link) -> None:
        link.followed = True
        threading.Thread(target=self._read, args=(link,), name="dllm-engine-reader", daemon=True).start()
        threading.Thread(target=self._watch, args=(link,), name="dllm-engine-watcher", daemon=True).start()

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed: the server has stopped
            pass

    def _read(self, link: _Link) -> None:
        """The reader thread: each message from `link`'s engine, to the event loop (one it cannot read ends the
        engine, whose death then ends the requests in flight: nothing waits for an answer that cannot come)."""
        try:
            while not link.stopping:
                if not link.pull.poll(200):
                    continue
                message = from_engine(link.pull.recv())
                self._call(self._received, link, message)
                if isinstance(message, Exit):
                    break
        except Exception:  # noqa: BLE001  (a bug: reported, and the engine stopped)
            traceback.print_exc()
            link.kill()
        finally:
            link.pull.close(linger=0)

    def _watch(self, link: _Link) -> None:
        """The watcher thread: `link`'s engine's end, to the event loop."""
        code = link.wait()
        self._call(self._exited, link, code)

    # -- requests ---------------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Send `job` to the engine (on the event loop); Unavailable: it takes no requests now; Full: too many
        wait."""
        if self.state != "ready":
            raise Unavailable(self.unavailable())
        if len(self.jobs) >= self.max_jobs:
            raise Full(f"{self.max_waiting} requests wait for a batch slot already (this server's --max-waiting); "
                       f"retry later")
        self.jobs[job.id] = job
        if not self.link.send(job.message()):
            del self.jobs[job.id]
            raise Unavailable("the engine is not answering; retry in a moment")

    def cancel(self, job: Job) -> None:
        """The client has gone: the engine stops the row at its next step (on the event loop)."""
        if self.jobs.pop(job.id, None) is not None:
            self.link.send(Abort([job.id]))
            self.metrics.requests.labels(_endpoint(job), "cancelled").inc()

    def unavailable(self) -> str:
        """Why no request is taken now (the 503's message)."""
        return {"new": "the engine has not started", "ready": "",
                "draining": "the server is shutting down; send the request to another instance",
                "restarting": "the engine is restarting after a failure; retry in a moment",
                "closed": "the server has stopped"}.get(self.state, "the engine has stopped after a failure")

    def _received(self, link: _Link, message) -> None:
        if link is not self.link:
            return
        link.heard = time.monotonic()
        if isinstance(message, Outputs):
            self.stats = message.stats
            self.metrics.engine(message.stats)
            for delta in message.deltas:
                self._deliver(delta)
        elif isinstance(message, Steps):
            for event in message.events:
                job = self.jobs.get(event.req_id)
                if job is not None:
                    job.events.put_nowait(job.step(self.tokenizer, event))
        elif isinstance(message, Exit):
            link.exit = message
            if message.error:
                print(f"dllm: the engine failed:\n{message.error}", file=sys.stderr, flush=True)
                self._lost(link, _last_line(message.error))  # dead to us now, however long its process takes to end

    def _deliver(self, delta: Delta) -> None:
        """A delta becomes its job's events: text (with its logprobs), then the finish reason and usage; an error."""
        job = self.jobs.get(delta.req_id)
        if job is None:  # cancelled, or already answered
            return
        if delta.status:
            self._end(job, {"kind": "error", "status": delta.status, "message": delta.message})
            return
        if job.first_block is None:
            job.first_block = time.perf_counter()
            self.metrics.first_block.observe(job.first_block - job.submitted)
        job.answer[delta.start:] = delta.token_ids
        if delta.logprobs is not None:
            job.answer_logprobs[delta.start:] = delta.logprobs
        done = delta.finish_reason is not None
        for event in job.read(self.tokenizer, job.answer, done, delta.finish_reason or "length",
                              job.answer_logprobs if job.logprobs is not None else None):
            job.events.put_nowait(event)
            if event["kind"] == "done":
                self.metrics.answered(_endpoint(job), event["usage"], time.perf_counter() - job.submitted)
        if job.complete:
            del self.jobs[job.id]
            if not done:  # a stop string ended the answer: the row stops
                self.link.send(Abort([job.id]))

    def _end(self, job: Job, event: dict) -> None:
        """End `job` with an error event (counted before it is answered)."""
        self.jobs.pop(job.id, None)
        self.metrics.requests.labels(_endpoint(job), "error").inc()
        job.events.put_nowait(event)

    # -- the engine's end -------------------------------------------------------------------------------------
    def _exited(self, link: _Link, code: int) -> None:
        """`link`'s engine has ended (on the event loop): a shutdown carried out, or a failure."""
        if link is not self.link or link.lost:
            return
        link.code = code
        if self.state in ("draining", "closed") and code == 0:
            self._end_all(503, "the server shut down before the answer was complete")
            if self.on_drained is not None:
                self.on_drained()
            return
        self._lost(link, _last_line(link.exit.error) if link.exit is not None and link.exit.error else
                   f"its process ended with code {code}")

    def _lost(self, link: _Link, reason: str) -> None:
        """`link`'s engine is dead (on the event loop): its requests are ended at once (503 where a new engine is
        started, else 500), /health and new requests get 503; then a restart, or the server stops."""
        link.lost = True
        wanted = self.state == "ready" and self.restart and self.spec is not None
        restart = wanted and self._may_restart()
        self._end_all(503 if restart else 500, f"the engine failed ({reason}); the request was not completed")
        link.close()
        if link.returncode() is None:  # it said it failed: its process has this long to end
            threading.Thread(target=link.join, args=(EXIT_SECONDS,), daemon=True).start()
        if restart:
            self.state = "restarting"
            print(f"dllm: the engine failed ({reason}); starting a new one", file=sys.stderr, flush=True)
            threading.Thread(target=self._relaunch, name="dllm-engine-restart", daemon=True).start()
        elif wanted:
            self._fatal(f"{reason}; --engine-restart gave up: {RESTARTS} restarts within {RESTART_WINDOW:.0f} s "
                        f"is its limit")
        else:
            self._fatal(reason)

    def _end_all(self, status: int, message: str) -> None:
        for job in list(self.jobs.values()):
            self._end(job, {"kind": "error", "status": status, "message": message})

    def _may_restart(self) -> bool:
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > RESTART_WINDOW:
            self.restarts.popleft()
        if len(self.restarts) >= RESTARTS:
            return False
        self.restarts.append(now)
        return True

    def _relaunch(self) -> None:
        """The restart thread: a new engine, adopted on the event loop once ready."""
        try:
            link = self._launch()
        except Exception as e:  # noqa: BLE001  (reported on the event loop)
            self._call(self._fatal, f"the new engine did not start: {e}")
            return
        self._call(self._adopt, link)

    def _adopt(self, link: _Link) -> None:
        if self.state != "restarting":  # shut down meanwhile
            link.send(Shutdown(0))
            threading.Thread(target=lambda: (link.join(EXIT_SECONDS), link.close()), daemon=True).start()
            return
        self.link, self.state, self.stats = link, "ready", Stats()
        self.metrics.engine_restarted()
        self._follow(link)
        print("dllm: the new engine is ready", file=sys.stderr, flush=True)

    def _fatal(self, reason: str) -> None:
        self.state, self.failed = "dead", True
        self.failure = f"the engine failed ({reason}); the server stops"
        print(f"dllm: {self.failure}", file=sys.stderr, flush=True)
        if self.on_fatal is not None:
            self.on_fatal()

    # -- shutting down ----------------------------------------------------------------------------------------
    def drain_soon(self, timeout: float) -> None:
        """`drain`, from any thread (a signal handler)."""
        if self.loop is not None:
            self._call(self.drain, timeout)
        elif self.on_drained is not None:
            self.on_drained()

    def drain(self, timeout: float) -> None:
        """Take no new requests (503); the engine finishes those in flight for at most `timeout` seconds, then exits
        and `on_drained` is called (on the event loop; at once where no engine runs)."""
        if self.state == "ready":
            self.state, self.drain_timeout = "draining", timeout
            self.link.send(Shutdown(timeout))
            return
        if self.state == "restarting":
            self.state = "closed"
        if self.state != "draining" and self.on_drained is not None:
            self.on_drained()

    async def close(self) -> None:
        """Stop the engine (now, unless it is draining) and wait for it; then release the sockets."""
        link = self.link
        if link is None or self.state == "closed":
            self.state = "closed"
            return
        if self.state == "ready":
            link.send(Shutdown(0))
        self.state = "closed"
        if link.returncode() is None:
            await asyncio.to_thread(link.join, self.drain_timeout + EXIT_SECONDS)
        link.close()
        self._end_all(503, "the server has stopped")

    def health(self) -> tuple[int, dict | str]:
        """/health (liveness): 200 with the engine's queue while its engine process runs (also while it drains),
        else 503 and why: it is restarting, or dead."""
        if self.state not in ("ready", "draining") or self.link.lost:
            return 503, self.unavailable()
        return 200, {"status": "ok", "waiting": self.stats.waiting, "running": self.stats.rows}

    def ready(self) -> tuple[int, dict | str]:
        """/ready (readiness): 200 while requests are taken, the model is loaded and the engine has answered within
        `SILENT_SECONDS` (it sends its numbers every second, busy or idle), else 503 and why."""
        if self.state != "ready":
            return 503, self.unavailable()
        silent = time.monotonic() - self.link.heard
        if silent > SILENT_SECONDS:
            return 503, f"the engine has not answered for {silent:.0f} s; it may be stuck in a long step"
        return 200, {"status": "ready"}


def _endpoint(job: Job) -> str:
    return "chat" if job.chat else "completions"
