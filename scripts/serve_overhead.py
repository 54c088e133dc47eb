"""The server's own cost per request, apart from decoding (BENCHMARKS.md, "Serving mixed settings").

1. The engine thread's wall time outside `Batch.run_block` (admission, layout hand-off, delivery), per request,
   while `--clients` clients send `--requests` chat requests (threshold/dual on tiny-llada).
2. The end-to-end latency of a trivial request (a 4-token answer in one block of 4) from one client, against
   `dllm.generate` of the same prompt in-process, the two interleaved: the difference is what HTTP, validation,
   tokenization and the hand-offs add.

Run with OMP_NUM_THREADS=1: `python scripts/serve_overhead.py [--requests 32 --clients 8 --trivial 100]`."""
import argparse
import statistics
import threading
import time

import torch

import dllm
from dllm.engine import Batch
from dllm.eval.synthetic import make_split
from dllm.serve import Engine, LocalServer, load, post

DEFAULTS = {"sampler": "threshold", "cache": "dual", "sampler_args": {}, "cache_args": {}, "gen_length": None,
            "block_length": None, "steps": None, "seed": 0}
TRIVIAL = {"prompt": "copy: ab", "max_tokens": 4, "block_length": 4}


class EngineClock:
    """Wall time of the engine thread in `Batch.run_block` and waiting for work, so the rest is its own cost."""

    def __init__(self, engine: Engine):
        self.blocks = self.waiting = 0.0
        run_block, wait = Batch.run_block, engine.cond.wait
        clock = self

        def timed_block(batch):
            began = time.perf_counter()
            try:
                return run_block(batch)
            finally:
                clock.blocks += time.perf_counter() - began

        def timed_wait(*args, **kwargs):
            began = time.perf_counter()
            try:
                return wait(*args, **kwargs)
            finally:
                if threading.current_thread() is engine.thread:
                    clock.waiting += time.perf_counter() - began

        Batch.run_block, engine.cond.wait = timed_block, timed_wait

    def reset(self) -> None:
        self.blocks = self.waiting = 0.0
        self.began = time.perf_counter()

    def other(self) -> float:
        return time.perf_counter() - self.began - self.blocks - self.waiting


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--trivial", type=int, default=100, help="trivial requests sent one after another")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = dllm.load("tiny-llada")
    engine = Engine(model, tok, "tiny-llada", DEFAULTS, max_batch=8)
    clock = EngineClock(engine)
    bodies = [{"messages": [{"role": "user", "content": ex.prompt}]}
              for ex in make_split("test", -(-args.requests // 5))][:args.requests]
    with LocalServer(engine) as local:
        url = local.url
        for _ in range(3):
            post(url + "/v1/completions", TRIVIAL)
        load(url + "/v1/chat/completions", bodies[:8], args.clients)  # warm-up
        clock.reset()
        run = load(url + "/v1/chat/completions", bodies, args.clients)
        other, blocks = clock.other(), clock.blocks
        assert all(status == 200 for status, _, _ in run["results"])
        served, alone = [], []  # interleaved, so that both see the same load on a shared machine
        options = dict(sampler="threshold", cache="dual", gen_length=4, block_length=4, chat=False)
        for _ in range(args.trivial):
            began = time.perf_counter()
            status, answer = post(url + "/v1/completions", TRIVIAL)
            served.append(time.perf_counter() - began)
            assert status == 200, answer
            began = time.perf_counter()
            dllm.generate(model, tok, TRIVIAL["prompt"], **options)
            alone.append(time.perf_counter() - began)
    print(f"{args.requests} chat requests from {args.clients} clients: {run['seconds']:.2f} s; engine thread "
          f"{blocks / args.requests * 1000:.2f} ms per request in run_block, {other / args.requests * 1000:.2f} ms "
          f"outside it")
    served_ms, alone_ms = statistics.median(served) * 1000, statistics.median(alone) * 1000
    print(f"trivial request, median of {args.trivial}: served {served_ms:.2f} ms, dllm.generate {alone_ms:.2f} ms, "
          f"server overhead {served_ms - alone_ms:.2f} ms")


if __name__ == "__main__":
    main()
