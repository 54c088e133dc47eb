"""`speculative`'s two ways to verify drafts (issue #45): tree attention (the drafts as extra rows of one forward)
against batch expansion (a copy of each row per draft on a forked store), alternating in one process so both see
the same load: per decode the process CPU time and the wall time (medians of --rounds, after one warm-up each), the
forwards and rows computed (equal by construction: checked) and the verifying forwards' median milliseconds.

    python scripts/verify_bench.py --model random:llada-small --cache dual --batch-size 4 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.engine import decode
from dllm.engine.bench import random_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llada")
    parser.add_argument("--cache", default="dual")
    parser.add_argument("--gen-length", type=int, default=64)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    model, _ = dllm.load(args.model, threads=1)
    prompts = random_prompts(model, args.batch_size, args.prompt_length, 0)
    runs: dict[str, list] = {"batch": [], "tree": []}
    for r in range(args.rounds + 1):
        for verify in ("batch", "tree") if r % 2 else ("tree", "batch"):
            cpu, wall = time.process_time(), time.perf_counter()
            canvas, stats, _ = decode(model, prompts, samplers.SAMPLERS.create("speculative", verify=verify),
                                      caches.CACHES.create(args.cache), args.gen_length, args.block_length,
                                      stop_early=False, profile=True)
            if r:  # round 0 warms up
                runs[verify].append((time.process_time() - cpu, time.perf_counter() - wall, stats, canvas.tokens))
    (*_, batch_stats, batch_tokens), (*_, tree_stats, tree_tokens) = runs["batch"][0], runs["tree"][0]
    assert torch.equal(batch_tokens, tree_tokens)
    assert (batch_stats.nfe, batch_stats.rows_per_layer) == (tree_stats.nfe, tree_stats.rows_per_layer)
    for verify, measured in runs.items():
        cpu, wall = (statistics.median(m[i] for m in measured) for i in (0, 1))
        verifying = statistics.median(t for m in measured for t in m[2].forward_seconds["verify"]) * 1e3
        print(f"{args.model} {args.cache} batch {args.batch_size} verify={verify}: {cpu:.3f} s CPU, {wall:.3f} s "
              f"wall, {measured[0][2].nfe} forwards, {sum(measured[0][2].rows_per_layer)} rows, verifying forward "
              f"{verifying:.1f} ms")


if __name__ == "__main__":
    main()
