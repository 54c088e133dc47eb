"""What the references' confidence rule costs per step on this machine (issue #34): `token_probability` as it is
(softmax in fp32, then gather: ML-GSAI/LLaDA generate.py, Fast-dLLM) against the rule it replaced
(exp(logit - logsumexp) in fp32), alternating in one process so both see the same load:

1. `dllm bench` on a model (default tiny-llada, low_confidence, no cache): ms per step, the median of --rounds;
2. the function alone on one block's logits at a real vocabulary (LLaDA-8B's 126464 tokens): ms per call.

    OMP_NUM_THREADS=1 python scripts/token_probability_cost.py --rounds 7
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time

import torch

import dllm.samplers as samplers
from dllm.cli import main as dllm_main
from dllm.samplers import base

CURRENT = base.token_probability


def logsumexp_rule(logits: torch.Tensor, tokens: torch.Tensor, unscored: None = None) -> torch.Tensor:
    """The rule before #34 (without `unscored`)."""
    logits = logits.float()
    return (logits.gather(-1, tokens[..., None])[..., 0] - logits.logsumexp(-1)).exp()


RULES = {"softmax_gather": CURRENT, "logsumexp": logsumexp_rule}


@contextlib.contextmanager
def rule(fn):
    """Every sampler module's `token_probability` set to `fn` for the block."""
    modules = [m for m in list(sys.modules.values()) if m is not None and m.__name__.startswith(samplers.__name__)
               and getattr(m, "token_probability", None) is CURRENT]
    for m in modules:
        m.token_probability = fn
    try:
        yield
    finally:
        for m in modules:
            m.token_probability = CURRENT


def bench_ms_per_step(model: str, repeats: int) -> float:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        dllm_main(["bench", "--model", model, "--json", "--repeats", str(repeats)])
    return json.loads(out.getvalue())["ms_per_step"]


def call_ms(fn, logits, tokens, calls: int) -> float:
    began = time.perf_counter()
    for _ in range(calls):
        fn(logits, tokens)
    return (time.perf_counter() - began) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3, help="dllm bench --repeats per round")
    ap.add_argument("--vocab", type=int, default=126464)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    logits = torch.randn(1, args.block, args.vocab, generator=torch.Generator().manual_seed(0))
    tokens = logits.argmax(-1)
    step, alone = {name: [] for name in RULES}, {name: [] for name in RULES}
    for _ in range(args.rounds):
        for name, fn in RULES.items():
            with rule(fn):
                step[name].append(bench_ms_per_step(args.model, args.repeats))
            alone[name].append(call_ms(fn, logits, tokens, args.calls))
    for name in RULES:
        print(f"{name:15s} dllm bench {args.model}: {statistics.median(step[name]):.2f} ms/step "
              f"(min {min(step[name]):.2f}) | alone [1, {args.block}, {args.vocab}]: "
              f"{statistics.median(alone[name]):.2f} ms/call (min {min(alone[name]):.2f})")


if __name__ == "__main__":
    main()
