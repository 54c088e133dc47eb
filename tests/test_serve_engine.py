"""The engine process of `dllm serve` (issue #47): SIGTERM drains both processes (new requests 503, those in flight
finish or end at the timeout, both exit 0); an engine killed mid-answer ends every request in flight with a 5xx or
an SSE error event within seconds, /health answers 503, and the server exits non-zero unless --engine-restart starts
a new engine, which then serves again. Nothing hangs; no request is answered twice."""
import http.client
import json
import os
import signal
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


def test_sigterm_lets_requests_finish_then_both_processes_exit_0(tiny):
    proc, url = serve()
    engine = engine_of(proc)
    results, threads = in_flight(url, [(LONG, False)])
    wait_rows(url, 1)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(OSError):  # the listener is closed: new requests are refused
        urllib.request.urlopen(url + "/health", timeout=5)
    joined(threads)
    assert proc.wait(timeout=WAIT) == 0, proc.stdout.read()  # only when the engine exited 0 too
    assert not engine.is_running()
    (status, answer), = results
    assert status == 200 and text_of(answer) == long_answer(*tiny)


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
    """Draining (what SIGTERM starts): new requests and /health get 503, the request in flight is answered, and
    the engine process exits 0."""
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
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url + "/health", timeout=5)
        assert info.value.code == 503
        joined(threads)
        (status, answer), = results
        assert status == 200 and text_of(answer) == long_answer(*tiny)
        link = engine.link
    assert link.wait() == 0 and not engine.failed


def test_an_engine_whose_server_was_killed_exits():
    """The HTTP process killed (SIGKILL: no drain): its engine process notices within seconds and exits, not left
    holding the model."""
    proc, url = serve()
    engine = engine_of(proc)
    proc.kill()
    proc.wait(timeout=WAIT)
    engine.wait(timeout=30)
