"""The decode loop's own cost: CPU time per step, inside the model's forward and around it (the loop, the sampler,
the cache), on `random:llada-tiny` (threshold, gen 128, block 32, prompt 64, batch 1, one thread), where the
forward is small enough that the loop shows. Process CPU time, not wall time, so a shared machine moves it less.

    python scripts/loop_cost.py --python .venv-old/bin/python --python python --rounds 7

runs each interpreter's installed dllm in turn, round by round (e.g. an older commit installed in another
virtualenv against this checkout), and prints the medians per cache: ms per step, ms in the forward, ms around it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MEASURE = """
import json, sys, time
import torch
torch.set_num_threads(1)
import dllm
try:
    from dllm.engine import decode
    from dllm.engine.options import split_params
except ImportError:  # the layout before the engine package (commit 292aca0 and older)
    from dllm.decode import decode, split_params
cache, runs = sys.argv[1], int(sys.argv[2])
model, tok = dllm.load("random:llada-tiny")
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(10, 100, (64,), generator=g).tolist()]
inside = [0.0]
forward = model.run
def timed(*a, **k):
    t = time.process_time()
    out = forward(*a, **k)
    inside[0] += time.process_time() - t
    return out
model.run = timed
def once():
    sampler, cache_ = split_params("threshold", cache, {})
    return decode(model, prompts, sampler, cache_, 128, 32, stop_early=False)[1].nfe
once()  # warm-up
inside[0] = 0.0
t = time.process_time()
steps = sum(once() for _ in range(runs))
total = time.process_time() - t
print(json.dumps({"step": 1000 * total / steps, "forward": 1000 * inside[0] / steps,
                  "loop": 1000 * (total - inside[0]) / steps}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", action="append", required=True, help="an interpreter with dllm installed (repeat)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=10, help="decodes timed per measurement")
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for cache in ("none", "dual"):
        results: dict[str, list[dict]] = {py: [] for py in args.python}
        for _ in range(args.rounds):
            for py in args.python:
                out = subprocess.run([py, "-c", MEASURE, cache, str(args.runs)], capture_output=True, text=True,
                                     env=env, cwd="/")
                if out.returncode:
                    sys.exit(f"{py}: {out.stderr.strip().splitlines()[-1]}")
                results[py].append(json.loads(out.stdout))
        for py, rows in results.items():
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print(f"{cache:5s} {py}: ms per step {med['step']:.3f}, in the forward {med['forward']:.3f}, "
                  f"around it {med['loop']:.3f}")


if __name__ == "__main__":
    main()
