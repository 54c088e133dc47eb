"""The engine process of `dllm serve` (issue #47): SIGTERM drains both processes (new requests 503, those in flight
finish or end at the timeout, both exit 0); an engine killed mid-answer ends every request in flight with a 5xx or
an SSE error event within seconds, /health answers 503, and the server exits non-zero unless --engine-restart starts
a new engine, which then serves again. Nothing hangs; no request is answered twice."""
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("zmq")
psutil = pytest.importorskip("psutil")

import dllm  # noqa: E402
import dllm.serve  # noqa: E402
from conftest import serve  # noqa: E402
from dllm.serve import EngineClient, LocalServer, post  # noqa: E402
from test_serve import DEFAULTS, SPEC, chat, metric_values, text_of, wait_rows  # noqa: E402

WAIT = 120  # seconds any one wait may take before the test fails (nothing hangs)
LONG = chat("reverse: hello123", gen_length=224, block_length=32, ignore_eos=True)  # 7 blocks, one token a step


@pytest.fixture(scope="module")
def tiny():
    return dllm.load("tiny-llada")


def long_answer(model, tok) -> str:
    return dllm.generate(model, tok, "reverse: hello123", gen_length=224, stop_early=False).texts[0]


def engine_of(proc: subprocess.Popen) -> psutil.Process:
    (child,) = psutil.Process(proc.pid).children()
    return child


def streamed(url: str, body: dict, out: list) -> None:
    """The data lines of a streamed answer, into `out` as they arrive (until the stream ends or is cut)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        for line in conn.getresponse():
            if line.startswith(b"data: "):
                out.append(line[6:].decode().strip())
    except (OSError, http.client.HTTPException):
        out.append("cut")
    finally:
        conn.close()


def in_flight(url: str, bodies: list[tuple[dict, bool]]) -> tuple[list, list[threading.Thread]]:
    """Send each (body, streamed?) from a thread of its own; their results fill the returned list."""
    results: list = [[] if stream else None for _, stream in bodies]

    def one(i, body, stream):
        if stream:
            streamed(url, body, results[i])
        else:
            results[i] = post(url + "/v1/chat/completions", body, timeout=WAIT)

    threads = [threading.Thread(target=one, args=(i, body, stream)) for i, (body, stream) in enumerate(bodies)]
    for thread in threads:
        thread.start()
    return results, threads


def joined(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(WAIT)
    assert not any(thread.is_alive() for thread in threads), "a request hung"


def stream_error(lines: list[str]) -> dict:
    """A stream that ended in an error event: that event (one, and no finish chunk after it)."""
    assert lines[-1] == "[DONE]", lines
    events = [json.loads(line) for line in lines[:-1]]
    assert [e for e in events if "error" in e] == events[-1:], events
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    return events[-1]["error"]


def answer_of(url: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """A GET (or a POST of `body`): its status and JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data), timeout=WAIT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_sigterm_lets_requests_finish_then_both_processes_exit_0(tiny):
    """While the request in flight finishes, the port stays open: a new request and /ready get 503, /health 200
    (the engine runs); then the port closes and both processes exit 0."""
    proc, url = serve()
    engine = engine_of(proc)
    results, threads = in_flight(url, [(LONG, False)])
    wait_rows(url, 1)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    status, answer = answer_of(url, "/v1/chat/completions", chat("copy: abcd"))
    assert status == 503 and "shutting down" in answer["error"]["message"], answer
    assert answer_of(url, "/ready")[0] == 503 and answer_of(url, "/health")[0] == 200
    joined(threads)
    assert proc.wait(timeout=WAIT) == 0, proc.stdout.read()  # only when the engine exited 0 too
    assert not engine.is_running()
    (status, answer), = results
    assert status == 200 and text_of(answer) == long_answer(*tiny)
    with pytest.raises(OSError):  # the port has closed
        urllib.request.urlopen(url + "/health", timeout=5)


def test_sigterm_ends_what_does_not_finish_within_the_timeout():
    """--shutdown-timeout 1 with eight long answers in flight: each ends (a complete answer, an SSE error event, or
    the connection closed) soon after the timeout, some before their end; both processes exit 0."""
    proc, url = serve("--shutdown-timeout", "1")
    results, threads = in_flight(url, [(LONG, i % 2 == 0) for i in range(8)])
    wait_rows(url, 8)
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    joined(threads)
    assert time.monotonic() - began < 1 + 30
    assert proc.wait(timeout=WAIT) == 0, proc.stdout.read()
    complete = [r for r in results if isinstance(r, tuple) and r[0] == 200 or isinstance(r, list) and
                r[-2:-1] and r[-1] == "[DONE]" and "error" not in r[-2]]
    assert len(complete) < 8, results
    for r in results:
        if isinstance(r, tuple) and r[0] != 200:
            assert r[0] == 503 and "shut down" in r[1]["error"]["message"], r


def test_a_killed_engine_ends_its_requests_and_the_server_exits_1():
    """The engine process killed mid-answer: the whole request gets 500 and the stream an error event within
    seconds, each once; the server says so and exits 1."""
    proc, url = serve()
    results, threads = in_flight(url, [(LONG, False), (LONG, True)])
    wait_rows(url, 2)
    engine_of(proc).kill()
    began = time.monotonic()
    joined(threads)
    assert time.monotonic() - began < 10
    (status, answer), lines = results
    assert status == 500 and "the engine failed" in answer["error"]["message"], answer
    assert stream_error(lines)["code"] == 500
    assert proc.wait(timeout=WAIT) == 1
    assert "the engine failed" in proc.stdout.read()


def test_engine_restart_fails_the_requests_in_flight_then_serves_again(tiny):
    """--engine-restart: the requests in flight when the engine dies get 503 (a stream its error event), /health
    answers 503 until the new engine has loaded its model, then requests are answered again, as alone."""
    model, tok = tiny
    with LocalServer(EngineClient.spawn(SPEC, DEFAULTS, restart=True)) as local:
        engine, url = local.engine, local.url
        old = engine.pid
        results, threads = in_flight(url, [(LONG, False), (LONG, True)])
        wait_rows(url, 2)
        os.kill(old, signal.SIGKILL)
        began = time.monotonic()
        joined(threads)
        assert time.monotonic() - began < 10
        (status, answer), lines = results
        assert status == 503 and "the engine failed" in answer["error"]["message"]
        assert stream_error(lines)["code"] == 503
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url + "/health", timeout=5)
        assert info.value.code == 503 and "restarting" in json.loads(info.value.read())["error"]["message"]
        deadline = time.monotonic() + WAIT
        while engine.state != "ready":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert engine.pid != old
        status, answer = post(url + "/v1/chat/completions", LONG)
        assert status == 200 and text_of(answer) == long_answer(model, tok)
        assert metric_values(url)["dllm_engine_restarts_total"] == 1


def test_a_draining_server_answers_503_and_finishes_what_it_holds(tiny):
    """Draining (what SIGTERM starts): new requests and /ready get 503 (/health 200: the engine runs), the request
    in flight is answered, and the engine process exits 0."""
    with LocalServer(EngineClient.spawn(SPEC, DEFAULTS)) as local:
        engine, url = local.engine, local.url
        results, threads = in_flight(url, [(LONG, False)])
        wait_rows(url, 1)
        engine.drain_soon(30)
        deadline = time.monotonic() + WAIT
        while engine.state != "draining":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        status, answer = post(url + "/v1/chat/completions", chat("copy: abcd"))
        assert status == 503 and "shutting down" in answer["error"]["message"]
        assert answer_of(url, "/ready")[0] == 503 and answer_of(url, "/health")[0] == 200
        joined(threads)
        (status, answer), = results
        assert status == 200 and text_of(answer) == long_answer(*tiny)
        link = engine.link
    assert link.wait() == 0 and not engine.failed


def test_an_engine_whose_server_was_killed_exits():
    """The HTTP process killed (SIGKILL: no drain): its engine process notices within seconds and exits, not left
    holding the model, and removes the sockets' folder that the HTTP process would have removed."""
    proc, url = serve()
    engine = engine_of(proc)
    inbox = engine.cmdline()[-3]
    folder = os.path.dirname(inbox.removeprefix("ipc://"))
    assert inbox.startswith("ipc://") and os.path.isdir(folder)
    proc.kill()
    proc.wait(timeout=WAIT)
    engine.wait(timeout=30)
    assert not os.path.exists(folder)


FAILING_ENGINE = """
import os, sys, time, zmq
from dllm.serve.messages import Add, Exit, Ready, encode, to_engine
context = zmq.Context()
pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
pull.connect(sys.argv[1])
push.connect(sys.argv[2])
if os.path.exists(sys.argv[3]):  # a restart: ready after the test has looked
    time.sleep(30)
open(sys.argv[3], "w").close()
push.send(encode(Ready(os.getpid())))
while not isinstance(to_engine(pull.recv()), Add):
    pass
push.send(encode(Exit("error", "RuntimeError: the engine broke")))
time.sleep(60)  # (a failed engine whose process takes its time to end: ranks to stop, memory to free)
"""


class FailingEngine(dllm.serve.EngineSpec):
    """An engine process that fails at its first request, says so, and lingers before it exits."""

    def __init__(self, marker: str):
        super().__init__("tiny-llada")
        self.marker = marker

    def argv(self, inbox: str, outbox: str) -> list[str]:
        return [sys.executable, "-c", FAILING_ENGINE, inbox, outbox, self.marker]


def test_an_engine_that_says_it_failed_is_dead_at_once(tmp_path):
    """The engine says it failed (its process still running): the request in flight gets the error at once, and
    /health, /ready and a new request 503 while a new engine starts (they waited for the process's end: 200s,
    and a request that hung on the dying engine)."""
    client = EngineClient.spawn(FailingEngine(str(tmp_path / "started")), DEFAULTS, restart=True)
    with LocalServer(client) as local:
        began = time.monotonic()
        status, answer = post(local.url + "/v1/chat/completions", chat("copy: abcd"), timeout=WAIT)
        assert status == 503 and "the engine broke" in answer["error"]["message"], answer
        assert time.monotonic() - began < 20
        for path in ("/health", "/ready", "/v1/chat/completions"):
            status, answer = answer_of(local.url, path, chat("copy: abcd") if path.startswith("/v1") else None)
            assert status == 503 and "restarting" in answer["error"]["message"], (path, answer)


def test_engine_restart_at_its_limit_says_so_in_the_last_line():
    """--engine-restart past its limit (0 restarts here, 3 in 300 s by default): the server stops, exit 1, and its
    last line says that --engine-restart gave up, and why the engine failed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import sys, dllm.serve.engine_client as c; c.RESTARTS = 0; from dllm.cli import main; "
            f"sys.exit(main(['serve', '--engine-restart', '--port', '{port}']))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + WAIT
    while answer_of_or_none(f"http://127.0.0.1:{port}/ready") != 200:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.2)
    engine_of(proc).kill()
    assert proc.wait(timeout=WAIT) == 1
    last = proc.stdout.read().strip().splitlines()[-1]
    assert last.startswith("dllm: the engine failed (its process ended with code -9; --engine-restart gave up: "
                           "0 restarts within 300 s is its limit)"), last


def answer_of_or_none(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def test_ready_says_whether_the_engine_answers_health_whether_it_runs(monkeypatch):
    """A stopped engine process (SIGSTOP: as one stuck in a step) is not ready after SILENT_SECONDS without a word
    from it (2 s here), though alive; once it runs again it is ready again."""
    import dllm.serve.engine_client as engine_client

    monkeypatch.setattr(engine_client, "SILENT_SECONDS", 2.0)
    with LocalServer(EngineClient.spawn(SPEC, DEFAULTS)) as local:
        assert answer_of(local.url, "/ready") == (200, {"status": "ready"})
        os.kill(local.engine.pid, signal.SIGSTOP)
        try:
            time.sleep(4)
            status, answer = answer_of(local.url, "/ready")
            assert status == 503 and "the engine has not answered for" in answer["error"]["message"], answer
            assert answer_of(local.url, "/health")[0] == 200
        finally:
            os.kill(local.engine.pid, signal.SIGCONT)
        deadline = time.monotonic() + WAIT
        while answer_of(local.url, "/ready")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
