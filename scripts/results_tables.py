"""The result tables of RESULTS.md: every sampler at its paper defaults (cache none) and every cache under
threshold decoding, on the synthetic held-out set of a model. Each configuration is a resumable `dllm eval`
run in its own folder under `--output`.

    python scripts/results_tables.py --model tiny-llada --output runs/tables
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import dllm
from dllm.core.errors import DllmError
from dllm.engine.checks import check_policies
from dllm.engine.options import decoding_lengths, split_params
from dllm.eval.harness import evaluate
from dllm.eval.synthetic import FAMILIES
from dllm.samplers.research import DELIMITER_THRESHOLD
from dllm.samplers.speculative import DRAFT_STEPS


def sampler_points(family: str) -> list[tuple[str, str, dict]]:
    """Every sampler at its paper defaults; Prophet reads the answer after the synthetic tasks' "#### " anchor."""
    return [("low_confidence", "low_confidence", {}), ("random", "random", {}),
            ("threshold 0.9", "threshold", {"threshold": 0.9}), ("factor 1.0", "factor", {}),
            ("origin", "origin", {}), ("maskgit_plus", "maskgit_plus", {}), ("topk_margin", "topk_margin", {}),
            ("entropy", "entropy", {}), ("prophet answer_start=5", "prophet", {"answer_start": 5}),
            ("credit", "credit", {}), ("localleap", "localleap", {}),
            (f"adablock tau_D={DELIMITER_THRESHOLD[family]}", "adablock", {}),
            (f"speculative K={DRAFT_STEPS[family]}", "speculative", {})]


CACHE_POINTS = [("none", "threshold", "none"), ("prefix", "threshold", "prefix"), ("dual", "threshold", "dual"),
                ("dkv", "threshold", "dkv"), ("dkv_greedy (random sampler)", "random", "dkv_greedy"),
                ("elastic", "threshold", "elastic"), ("block", "threshold", "block")]  # block: block-causal models


def run(model, tok, name, out: Path, sampler, cache, sampler_args, args) -> dict | str:
    """The summary of one configuration, or why the model refuses it (a row that says so)."""
    sampler, cache = split_params(sampler, cache, {}, sampler_args)
    try:
        check_policies(model, sampler, cache)
    except DllmError as e:
        return str(e)
    return evaluate(model, tok, "synthetic", sampler, cache, gen_length=args.gen_length,
                    block_length=args.block_length, limit=args.limit, batch_size=args.batch_size,
                    output=out / name.replace(" ", "_"), model_name=args.model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--output", default="runs/tables")
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--block-length", type=int, default=None, help="(default: the model's, else 32)")
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--only", choices=("samplers", "caches"), default=None)
    args = ap.parse_args()
    try:
        print(tables(args))
    except DllmError as e:
        sys.exit(f"error: {e}")


def tables(args) -> str:
    model, tok = dllm.load(args.model)
    args.block_length = decoding_lengths(model, args.gen_length, args.block_length)["block_length"]
    out = Path(args.output) / args.model
    lines = []
    if args.only != "caches":
        lines += [f"Samplers on {args.model} (cache none, gen {args.gen_length}, block {args.block_length}):", "",
                  "| sampler | accuracy % | " + " | ".join(FAMILIES) + " | forwards | tokens/forward | tokens/s |",
                  "|---" * (5 + len(FAMILIES)) + "|"]
        for name, sampler, sampler_args in sampler_points("dream" if model.config.logit_shift else "llada"):
            s = run(model, tok, name, out / "samplers", sampler, "none", sampler_args, args)
            if isinstance(s, str):
                lines.append(f"| {name} | refused: {s} |")
                continue
            fam = " | ".join(f"{100 * s['per_group_accuracy'][f]:.1f}" for f in FAMILIES)
            lines.append(f"| {name} | {100 * s['accuracy']:.1f} | {fam} | {s['nfe_mean']:.1f} | {s['tpf']:.2f} | "
                         f"{s['tokens_per_second']:.0f} |")
        lines.append("")
    if args.only != "samplers":
        lines += [f"Caches on {args.model} (threshold 0.9, gen {args.gen_length}, block {args.block_length}):", "",
                  "| cache | accuracy % | forwards | tokens/forward | rows computed vs none | tokens/s |",
                  "|---|---|---|---|---|---|"]
        base = None
        for name, sampler, cache in CACHE_POINTS:
            s = run(model, tok, name, out / "caches", sampler, cache, {"threshold": 0.9} if sampler == "threshold"
                    else {}, args)
            if isinstance(s, str):
                lines.append(f"| {name} | refused: {s} |")
                continue
            base = base or s["rows_per_layer_mean"]
            lines.append(f"| {name} | {100 * s['accuracy']:.1f} | {s['nfe_mean']:.1f} | {s['tpf']:.2f} | "
                         f"{s['rows_per_layer_mean'] / base:.3f} | {s['tokens_per_second']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
