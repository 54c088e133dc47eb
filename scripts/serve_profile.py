"""Where a served request's time goes, against `dllm.generate` one request after another (BENCHMARKS.md, "Serving
mixed settings"). tiny-llada, threshold/dual, chat requests of the synthetic tasks, every other at threshold 0.5.
CPU times are read per thread (/proc/self/task/*/schedstat, `time.thread_time`), so a shared machine's load
hardly enters them; only the trivial request's latency is wall time.

1. CPU per request: sequential `dllm.generate`; served by `--clients` clients, split into the engine thread inside
   `Batch.run_block` (decoding) and outside it (admission, hand-offs, delivery), the HTTP side (event loop and
   worker threads: HTTP, JSON, validation, tokenization, text) and the client threads.
2. Canvas positions the model computes per request (layer 0), sequential and served.
3. CPU per forward at batch 1 and 8: the block-start forward (every canvas position) and a block step (the dual
   cache's 32 block positions), per row.
4. A trivial request (a 4-token answer in one block of 4) from one client against `dllm.generate` of it
   in-process, interleaved: the difference is what HTTP, validation, tokenization and thread hand-offs add.

Run with OMP_NUM_THREADS=1: `python scripts/serve_profile.py [--requests 32 --clients 8 --repeats 3]`. It uses
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
from dllm.engine.runner import Runner
from dllm.eval.synthetic import make_split
from dllm.models.transformer import DiffusionLM
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


class Counted:
    """CPU seconds in `Batch.run_block` (of the calling thread) and canvas positions computed, while installed."""

    def __init__(self):
        self.decoding, self.positions = 0.0, 0
        run_block, run = Batch.run_block, DiffusionLM.run
        counted = self

        def timed_block(batch):
            began = time.thread_time()
            try:
                return run_block(batch)
            finally:
                counted.decoding += time.thread_time() - began

        def counted_run(model, tokens, *args, **kwargs):
            counted.positions += tokens.numel()
            return run(model, tokens, *args, **kwargs)

        Batch.run_block, DiffusionLM.run = timed_block, counted_run

    def take(self) -> tuple[float, int]:
        out, (self.decoding, self.positions) = (self.decoding, self.positions), (0.0, 0)
        return out


def forward_costs(model, tok, prompts: list[str]) -> dict[int, tuple[float, float]]:
    """CPU ms of a block-start forward and of a block step (median), at batch 1 and 8 of `prompts`."""
    ids = dllm.engine.text.encode_prompts(tok, prompts, True)
    forward, out = Runner.forward, {}
    for batch_size in (1, 8):
        times = {True: [], False: []}

        def timed(runner, *args, **kwargs):
            full, began = runner.stats.full_forwards, time.thread_time()
            logits = forward(runner, *args, **kwargs)
            times[runner.stats.full_forwards > full].append(time.thread_time() - began)
            return logits

        Runner.forward = timed
        for _ in range(3):  # one token per step: many block steps
            sampler = dllm.samplers.SAMPLERS.create("low_confidence")
            batch = Batch(model, sampler, dllm.cache.CACHES.create("dual"), 32, 32)
            for row in ids[:batch_size]:
                batch.add(row, 64)
            while batch.running:
                batch.run_block()
        Runner.forward = forward
        out[batch_size] = tuple(statistics.median(times[kind]) * 1000 for kind in (True, False))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="passes measured (after one warm-up)")
    ap.add_argument("--trivial", type=int, default=100, help="trivial requests sent one after another")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = dllm.load("tiny-llada")
    engine = Engine(model, tok, "tiny-llada", DEFAULTS, max_batch=8)
    bodies = [{"messages": [{"role": "user", "content": ex.prompt}], **({"threshold": 0.5} if i % 2 else {})}
              for i, ex in enumerate(make_split("test", -(-args.requests // 5)))][:args.requests]
    prompts = [body["messages"][0]["content"] for body in bodies]
    jobs = [engine.job(body, chat=True) for body in bodies]
    options = [dict(sampler=job.sampler, cache=job.cache, **job.lengths, seed=job.seed, chat=True) for job in jobs]
    counted, n = Counted(), args.requests * args.repeats
    for prompt, option in zip(prompts, options):  # warm-up
        dllm.generate(model, tok, prompt, **option)
    counted.take()
    began = time.process_time()  # the server's threads have not started
    for _ in range(args.repeats):
        for prompt, option in zip(prompts, options):
            dllm.generate(model, tok, prompt, **option)
    sequential, (_, sequential_positions) = time.process_time() - began, counted.take()
    clients: set[int] = set()

    def send(url, body):
        clients.add(threading.get_native_id())
        return post(url, body)[0]

    with LocalServer(engine) as local, ThreadPoolExecutor(args.clients) as pool:
        url = local.url + "/v1/chat/completions"
        assert list(pool.map(lambda b: send(url, b), bodies)) == [200] * len(bodies)  # warm-up
        counted.take()
        before, began = thread_cpu(), time.perf_counter()
        for _ in range(args.repeats):
            assert list(pool.map(lambda b: send(url, b), bodies)) == [200] * len(bodies)
        wall, after, (decoding, positions) = time.perf_counter() - began, thread_cpu(), counted.take()
        served, alone = [], []  # interleaved, so that both see the same load on a shared machine
        trivial = dict(sampler="threshold", cache="dual", gen_length=4, block_length=4, chat=False)
        for _ in range(args.trivial):
            began = time.perf_counter()
            status, answer = post(local.url + "/v1/completions", TRIVIAL)
            served.append(time.perf_counter() - began)
            assert status == 200, answer
            began = time.perf_counter()
            dllm.generate(model, tok, TRIVIAL["prompt"], **trivial)
            alone.append(time.perf_counter() - began)
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    engine_cpu = used.get(engine.thread.native_id, 0.0)
    client_cpu = sum(used.get(tid, 0.0) for tid in clients)
    http_cpu = sum(used.values()) - engine_cpu - client_cpu
    ms = lambda seconds: f"{seconds / n * 1000:.2f}"  # noqa: E731
    print(f"1. CPU ms per request: sequential dllm.generate {ms(sequential)}; served "
          f"({args.clients} clients, {wall / n * 1000:.1f} ms wall each): engine thread decoding {ms(decoding)}, "
          f"engine thread outside run_block {ms(engine_cpu - decoding)}, HTTP side {ms(http_cpu)}, "
          f"clients {ms(client_cpu)}")
    print(f"2. canvas positions computed per request: sequential {sequential_positions / n:.1f}, "
          f"served {positions / n:.1f}")
    costs = forward_costs(model, tok, prompts)
    print("3. CPU ms per forward (per row): " + "; ".join(
        f"batch {b}: block start {full:.2f} ({full / b:.2f}), block step {step:.2f} ({step / b:.2f})"
        for b, (full, step) in costs.items()))
    served_ms, alone_ms = statistics.median(served) * 1000, statistics.median(alone) * 1000
    print(f"4. trivial request, median of {args.trivial}: served {served_ms:.2f} ms, dllm.generate {alone_ms:.2f} ms, "
          f"server overhead {served_ms - alone_ms:.2f} ms")


if __name__ == "__main__":
    main()
