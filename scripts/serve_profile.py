"""Where a served request's CPU goes, process by process, against `dllm.generate` one request after another, and
what a one-token request waits while other clients stream (BENCHMARKS.md, "The engine in its own process").
tiny-llada, threshold/dual, chat requests of the synthetic tasks, every other one at threshold 0.5.

It starts `python -m dllm.cli serve` with this interpreter (its dllm: run it with an older checkout's Python to
measure that checkout) and reaches it over HTTP only. CPU times are read per process from
/proc/PID/task/*/schedstat, so a shared machine's load hardly enters them; latencies are wall time.

1. CPU ms per request: sequential `dllm.generate` in this process; served by `--clients` client threads (in this
   process), split by the server's processes (one before issue #47; the HTTP process and the engine process after).
2. The engine's busy share over the served passes (where /metrics has dllm_engine_busy_seconds_total).
3. A one-token request's latency (max_tokens 1 in a block of 1), median and 90th percentile over `--trivial` sent
   one after another: on an idle server, and while `--clients` clients stream the workload's requests.

Run with OMP_NUM_THREADS=1: `python scripts/serve_profile.py [--requests 32 --clients 8 --repeats 3 --trivial 50]`."""
import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import torch

import dllm
from dllm.eval.synthetic import make_split
from dllm.serve.client import post

SERVE = ["--sampler", "threshold", "--cache", "dual", "--max-batch", "8"]
TRIVIAL = {"prompt": "copy: ab", "max_tokens": 1, "block_length": 1}


def cpu_seconds(pid: int) -> float:
    """CPU seconds of every thread of process `pid` (the scheduler's nanosecond counts)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # ended meanwhile
            continue
    return total / 1e9


def start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "dllm.cli", "serve", "--port", str(port), *SERVE],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(1200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the server did not start")


def busy_seconds(url: str) -> float | None:
    with urllib.request.urlopen(url + "/metrics") as r:
        for line in r.read().decode().splitlines():
            if line.startswith("dllm_engine_busy_seconds_total "):
                return float(line.split()[1])
    return None


def streamed(url: str, body: dict) -> None:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    for _ in conn.getresponse():
        pass
    conn.close()


def trivial_latencies(url: str, count: int) -> list[float]:
    out = []
    for _ in range(count):
        began = time.perf_counter()
        status, answer = post(url + "/v1/completions", TRIVIAL)
        out.append(time.perf_counter() - began)
        assert status == 200, answer
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="passes measured (after one warm-up)")
    ap.add_argument("--trivial", type=int, default=50, help="one-token requests sent one after another")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = dllm.load("tiny-llada")
    bodies = [{"messages": [{"role": "user", "content": ex.prompt}], **({"threshold": 0.5} if i % 2 else {})}
              for i, ex in enumerate(make_split("test", -(-args.requests // 5)))][:args.requests]
    options = [dict(sampler="threshold", cache="dual", **({"threshold": 0.5} if i % 2 else {}))
               for i in range(len(bodies))]
    prompts = [body["messages"][0]["content"] for body in bodies]
    for prompt, option in zip(prompts, options):  # warm-up
        dllm.generate(model, tok, prompt, **option)
    n = args.requests * args.repeats
    began = time.process_time()
    for _ in range(args.repeats):
        for prompt, option in zip(prompts, options):
            dllm.generate(model, tok, prompt, **option)
    sequential = time.process_time() - began
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, url = start_server(port), f"http://127.0.0.1:{port}"
    try:
        processes = [server.pid] + [child.pid for child in psutil.Process(server.pid).children(recursive=True)]
        with ThreadPoolExecutor(args.clients) as pool:
            chat = url + "/v1/chat/completions"
            assert list(pool.map(lambda b: post(chat, b)[0], bodies)) == [200] * len(bodies)  # warm-up
            cpu, own, busy, began = [cpu_seconds(p) for p in processes], time.process_time(), busy_seconds(url), \
                time.perf_counter()
            for _ in range(args.repeats):
                assert list(pool.map(lambda b: post(chat, b)[0], bodies)) == [200] * len(bodies)
            wall, clients = time.perf_counter() - began, time.process_time() - own
            cpu = [cpu_seconds(p) - before for p, before in zip(processes, cpu)]
            busy = None if busy is None else (busy_seconds(url) - busy) / wall
        idle = trivial_latencies(url, args.trivial)
        stop = threading.Event()

        def stream_on(i):
            while not stop.is_set():
                streamed(url, bodies[i % len(bodies)])
                i += args.clients

        streams = [threading.Thread(target=stream_on, args=(i,)) for i in range(args.clients)]
        for t in streams:
            t.start()
        time.sleep(1.0)
        loaded = trivial_latencies(url, args.trivial)
        stop.set()
        for t in streams:
            t.join()
    finally:
        server.terminate()
        server.wait(60)
    ms = lambda seconds: f"{seconds / n * 1000:.2f}"  # noqa: E731
    names = ["server process"] if len(processes) == 1 else ["HTTP process", "engine process"]
    print(f"1. CPU ms per request: sequential dllm.generate {ms(sequential)}; served ({args.clients} clients, "
          f"{wall / n * 1000:.2f} ms wall each): " + ", ".join(f"{name} {ms(c)}" for name, c in zip(names, cpu)) +
          f", clients {ms(clients)}")
    print("2. engine busy: " + ("not exported" if busy is None else f"{busy:.1%} of the served wall time"))
    q = lambda xs: f"median {statistics.median(xs) * 1000:.1f} ms, p90 {sorted(xs)[int(0.9 * len(xs))] * 1000:.1f} ms"  # noqa: E731
    print(f"3. one-token request, {args.trivial} one after another: idle server {q(idle)}; while {args.clients} "
          f"clients stream {q(loaded)}")


if __name__ == "__main__":
    main()
