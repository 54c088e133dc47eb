"""`--tensor-parallel N` on the command line (issue #48): `dllm generate --tensor-parallel 2` answers as one process
does; what cannot run split is refused in one line before anything loads; `dllm serve --tensor-parallel 2` answers
requests with mixed settings as one process does, and a killed rank fails the request in flight with 500 and ends
the server (exit 1, one line naming the rank, every rank process gone) within seconds."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import serve

import dllm
from dllm.cli import main

pytestmark = pytest.mark.distributed

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread per rank: the ranks share the cores
WAIT = 120  # seconds any one wait may take before the test fails (nothing hangs)


@pytest.fixture(scope="module")
def tiny():
    return dllm.load("tiny-llada")


def dllm_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dllm.cli", *argv], capture_output=True, text=True, env=ENV,
                          timeout=WAIT)


def test_generate_with_two_ranks_answers_as_one_process(tiny):
    model, tok = tiny
    prompts = ["reverse: hello123", "sort: 42,07,19,03"]
    flags = ["--sampler", "threshold", "--cache", "dual", "--threads", "1"]
    done = dllm_cli("generate", *prompts, *flags, "--tensor-parallel", "2", "--json")
    assert done.returncode == 0, done.stderr
    want = dllm.generate(model, tok, prompts, sampler="threshold", cache="dual")
    got = json.loads(done.stdout)
    assert [o["token_ids"] for o in got["outputs"]] == want.token_ids
    assert got["stats"]["nfe"] == want.stats.nfe
    assert got["outputs"][0]["text"] == "#### 321olleh"


@pytest.mark.parametrize("argv, environ, message", [
    (["generate", "x", "--tensor-parallel", "2", "--quantize", "int8"], {},
     "--tensor-parallel splits plain weights, and --quantize makes quantized ones; drop one"),
    (["generate", "x", "--tensor-parallel", "2", "--gen-length", "auto"], {},
     "--gen-length auto grows each answer's canvas on one process only"),
    (["generate", "x", "--tensor-parallel", "0"], {}, "--tensor-parallel must be at least 1, got 0"),
    (["generate", "x", "--tensor-parallel", "3"], {},
     "llada cannot run on 3 tensor-parallel ranks: its 4 attention heads do not split evenly over 3 ranks"),
    (["serve", "--tensor-parallel", "2", "--replicas", "2"], {}, "drop --replicas or --tensor-parallel"),
    (["serve", "--tensor-parallel", "2"], {"WORLD_SIZE": "2"}, "run it as one process, not under torchrun"),
    (["eval", "--tensor-parallel", "2", "--limit", "1"], {"WORLD_SIZE": "2"}, "run it as one plain process"),
    (["generate", "x"], {"WORLD_SIZE": "2"},
     "torchrun started 2 processes, and each would decode alone; add --tensor-parallel 2 to split the model"),
])
def test_what_cannot_run_split_is_refused_in_one_line(argv, environ, message, capsys, monkeypatch):
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def served(*flags: str) -> tuple[subprocess.Popen, str]:
    return serve("--threads", "1", *flags, env=ENV, wait=WAIT)


def in_flight(url: str, bodies: list[dict]) -> tuple[list, list[threading.Thread]]:
    from dllm.serve import post

    results: list = [None] * len(bodies)

    def one(i):
        results[i] = post(url + "/v1/completions", bodies[i], timeout=WAIT)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    return results, threads


@pytest.mark.filterwarnings("ignore:.*outside the prompts this model was trained on")  # raw prompts, as sent
def test_serve_with_two_ranks_answers_as_one_process_and_a_killed_rank_ends_it(tiny):
    psutil = pytest.importorskip("psutil")
    pytest.importorskip("fastapi")
    from test_serve import wait_rows

    model, tok = tiny
    cases = [("reverse: hello123", {}), ("sort: 42,07,19,03", {"threshold": 0.5}),
             ("add: 0457+0168", {"temperature": 0.8, "seed": 3}), ("copy: k3x9a", {"cache": "none"})]
    proc, url = served("--tensor-parallel", "2", "--sampler", "threshold", "--cache", "dual")
    try:
        engine = psutil.Process(proc.pid).children()[0]
        (follower,) = engine.children()  # rank 1, the engine's child
        bodies = [{"model": "tiny-llada", "prompt": p, "gen_length": 32, **kw} for p, kw in cases]
        results, threads = in_flight(url, bodies)
        for thread in threads:
            thread.join(WAIT)
        for (prompt, kw), (status, answer) in zip(cases, results):
            want = dllm.generate(model, tok, prompt, chat=False, gen_length=32,
                                 **{"sampler": "threshold", "cache": "dual", **kw})
            assert status == 200, answer
            assert answer["choices"][0]["text"] == want.texts[0], (prompt, kw)

        long = {"model": "tiny-llada", "prompt": "reverse: hello123", "gen_length": 224, "ignore_eos": True}
        results, threads = in_flight(url, [long])
        wait_rows(url, 1, WAIT)
        follower.kill()
        began = time.monotonic()
        threads[0].join(WAIT)
        (status, answer), = results
        assert status == 500 and "tensor-parallel rank 1 exited (code -9)" in answer["error"]["message"], answer
        assert proc.wait(timeout=WAIT) == 1
        assert time.monotonic() - began < 30
        last = [line for line in proc.stdout.read().splitlines() if line.startswith("dllm: ")][-1]
        assert "tensor-parallel rank 1 exited" in last and last.endswith("the server stops"), last
        assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(WAIT)


@pytest.mark.filterwarnings("ignore:.*outside the prompts this model was trained on")
def test_sigterm_drains_a_served_request_then_every_rank_exits_0(tiny):
    psutil = pytest.importorskip("psutil")
    pytest.importorskip("fastapi")
    from test_serve import wait_rows

    model, tok = tiny
    proc, url = served("--tensor-parallel", "2")
    try:
        processes = psutil.Process(proc.pid).children(recursive=True)  # the engine (rank 0) and rank 1
        assert len(processes) == 2
        body = {"model": "tiny-llada", "prompt": "copy: k3x9a", "gen_length": 64, "ignore_eos": True}
        results, threads = in_flight(url, [body])
        wait_rows(url, 1, WAIT)
        proc.send_signal(signal.SIGTERM)
        threads[0].join(WAIT)
        assert proc.wait(timeout=WAIT) == 0, proc.stdout.read()
        (status, answer), = results
        want = dllm.generate(model, tok, "copy: k3x9a", chat=False, gen_length=64, stop_early=False)
        assert status == 200 and answer["choices"][0]["text"] == want.texts[0], answer
        psutil.wait_procs(processes, timeout=WAIT)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)
    finally:
        if proc.poll() is None:
            proc.kill()
