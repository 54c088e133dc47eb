"""The server's own cost per request, apart from decoding (BENCHMARKS.md, "Serving mixed settings").

1. CPU time per request of each part of the server while `--clients` clients send `--requests` chat requests
   (tiny-llada, threshold/dual, every other request at threshold 0.5), read from /proc per thread, so that a shared
   machine's load hardly enters: the engine thread inside `Batch.run_block` (decoding) and outside it (admission,
   layout hand-off, delivery), the HTTP side (event loop and worker threads: HTTP, JSON, validation, tokenization,
   text), and the client threads.
2. The end-to-end latency of a trivial request (a 4-token answer in one block of 4) from one client against
   `dllm.generate` of the same prompt in-process, the two interleaved: the difference is what HTTP, validation,
   tokenization and the hand-offs between threads add.

Run with OMP_NUM_THREADS=1: `python scripts/serve_overhead.py [--requests 32 --clients 8 --repeats 3]`. It uses
only what every version of the server has, so the same script measures an older checkout (PYTHONPATH)."""
import argparse
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import dllm
from dllm.engine import Batch
from dllm.eval.synthetic import make_split
from dllm.serve import Engine, LocalServer, post

DEFAULTS = {"sampler": "threshold", "cache": "dual", "sampler_args": {}, "cache_args": {}, "gen_length": None,
            "block_length": None, "steps": None, "seed": 0}
TRIVIAL = {"prompt": "copy: ab", "max_tokens": 4, "block_length": 4}


def thread_cpu() -> dict[int, float]:
    """CPU seconds of every thread of this process, by native id (the scheduler's nanosecond count)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except FileNotFoundError:  # ended meanwhile
            continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="load runs measured (after one warm-up)")
    ap.add_argument("--trivial", type=int, default=100, help="trivial requests sent one after another")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = dllm.load("tiny-llada")
    engine = Engine(model, tok, "tiny-llada", DEFAULTS, max_batch=8)
    decoding = [0.0]  # engine thread CPU inside run_block
    run_block = Batch.run_block

    def timed_block(batch):
        began = time.thread_time()
        try:
            return run_block(batch)
        finally:
            decoding[0] += time.thread_time() - began

    Batch.run_block = timed_block
    bodies = [{"messages": [{"role": "user", "content": ex.prompt}], **({"threshold": 0.5} if i % 2 else {})}
              for i, ex in enumerate(make_split("test", -(-args.requests // 5)))][:args.requests]
    clients: set[int] = set()

    def send(url, body):
        clients.add(threading.get_native_id())
        return post(url, body)[0]

    with LocalServer(engine) as local, ThreadPoolExecutor(args.clients) as pool:
        url = local.url + "/v1/chat/completions"
        assert list(pool.map(lambda b: send(url, b), bodies)) == [200] * len(bodies)  # warm-up
        decoding[0], before, began = 0.0, thread_cpu(), time.perf_counter()
        for _ in range(args.repeats):
            assert list(pool.map(lambda b: send(url, b), bodies)) == [200] * len(bodies)
        wall, after, decoded = time.perf_counter() - began, thread_cpu(), decoding[0]
        served, alone = [], []  # interleaved, so that both see the same load on a shared machine
        options = dict(sampler="threshold", cache="dual", gen_length=4, block_length=4, chat=False)
        for _ in range(args.trivial):
            began = time.perf_counter()
            status, answer = post(local.url + "/v1/completions", TRIVIAL)
            served.append(time.perf_counter() - began)
            assert status == 200, answer
            began = time.perf_counter()
            dllm.generate(model, tok, TRIVIAL["prompt"], **options)
            alone.append(time.perf_counter() - began)
    n = args.requests * args.repeats
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    engine_cpu = used.get(engine.thread.native_id, 0.0)
    client_cpu = sum(used.get(tid, 0.0) for tid in clients)
    http_cpu = sum(used.values()) - engine_cpu - client_cpu
    ms = lambda seconds: f"{seconds / n * 1000:.2f}"  # noqa: E731
    print(f"{n} chat requests from {args.clients} clients, {wall / n * 1000:.2f} ms wall each; CPU ms per request: "
          f"engine thread decoding {ms(decoded)}, engine thread outside run_block {ms(engine_cpu - decoded)}, "
          f"HTTP side {ms(http_cpu)}, clients {ms(client_cpu)}")
    served_ms, alone_ms = statistics.median(served) * 1000, statistics.median(alone) * 1000
    print(f"trivial request, median of {args.trivial}: served {served_ms:.2f} ms, dllm.generate {alone_ms:.2f} ms, "
          f"server overhead {served_ms - alone_ms:.2f} ms")


if __name__ == "__main__":
    main()
