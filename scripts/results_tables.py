"""The result tables of RESULTS.md: every registered sampler at its paper defaults (`--cache`, default dual, where
the sampler takes it, else none; `--plot`: accuracy against tokens per forward, a point per sampler), every cache
under threshold decoding, and every weight quantization against full precision (`--only quantized`), on the
synthetic held-out set of a model. Each configuration is a resumable `dllm eval` run in its own folder under
`--output`.

    python scripts/results_tables.py --model tiny-llada --output runs/tables --plot docs/samplers-tiny-llada.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import dllm
from dllm.core.errors import DllmError
from dllm.engine.bench import random_prompts
from dllm.engine.canvas import Canvas
from dllm.engine.checks import check_policies
from dllm.engine.options import decoding_lengths, split_params
from dllm.eval.harness import evaluate
from dllm.models.quantize import weight_bytes
from dllm.eval.synthetic import FAMILIES
from dllm.eval.sweep import aup
from dllm.samplers import SAMPLERS


SYNTHETIC_ARGS = {"prophet": {"answer_start": 5}}  # its answer region: after the synthetic tasks' "#### " anchor


def sampler_points() -> list[tuple[str, dict]]:
    """Every registered sampler at its defaults (its paper's), in registration order."""
    return [(cls.name, SYNTHETIC_ARGS.get(cls.name, {})) for cls in SAMPLERS]


CACHE_POINTS = [("none", "threshold", "none"), ("prefix", "threshold", "prefix"), ("dual", "threshold", "dual"),
                ("dkv", "threshold", "dkv"), ("dkv_greedy (random sampler)", "random", "dkv_greedy"),
                ("elastic", "threshold", "elastic"), ("d2cache", "threshold", "d2cache"),
                ("dllm_cache", "threshold", "dllm_cache"), ("block", "threshold", "block")]  # block: block-causal models

# (name, dllm.load's dtype, quantize): int4 runs in bfloat16, so bfloat16 alone is its baseline
QUANTIZED_POINTS = [("float32", "float32", None), ("int8", "float32", "int8"),
                    ("int8-dynamic", "float32", "int8-dynamic"), ("bfloat16", "bfloat16", None),
                    ("int4", "bfloat16", "int4")]


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
    ap.add_argument("--cache", default="dual", help="the samplers' cache where they take it (else none)")
    ap.add_argument("--plot", default=None, help="the samplers' accuracy against tokens per forward (matplotlib)")
    ap.add_argument("--only", choices=("samplers", "caches", "quantized", "agreement"), default=None,
                    help="one table (default: samplers and caches; quantized: accuracy under each weight "
                         "quantization; agreement: their logits against float32's, e.g. on random:llada-small)")
    args = ap.parse_args()
    try:
        print(tables(args))
    except DllmError as e:
        sys.exit(f"error: {e}")


def tables(args) -> str:
    if args.only in ("quantized", "agreement"):
        return "\n".join((quantized_table if args.only == "quantized" else agreement_table)(args))
    model, tok = dllm.load(args.model)
    args.block_length = decoding_lengths(model, args.gen_length, args.block_length)["block_length"]
    out = Path(args.output) / args.model
    lines = []
    if args.only != "caches":
        lines += samplers_table(model, tok, out, args)
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


def samplers_table(model, tok, out: Path, args) -> list[str]:
    """Every registered sampler with `args.cache` (none where it refuses that cache; a row with the reason where it
    refuses the model); AUP of its one point is tokens per forward x accuracy (`eval.sweep.aup`)."""
    lines = [f"Samplers on {args.model} (gen {args.gen_length}, block {args.block_length}):", "",
             "| sampler | cache | accuracy % | " + " | ".join(FAMILIES) + " | forwards | tokens/forward | AUP | "
             "tokens/s |", "|---" * (7 + len(FAMILIES)) + "|"]
    points = []
    for name, sampler_args in sampler_points():
        s, cache = run(model, tok, name, out / "samplers" / args.cache, name, args.cache, sampler_args, args), args.cache
        if isinstance(s, str) and cache != "none":
            alone = run(model, tok, name, out / "samplers" / "none", name, "none", sampler_args, args)
            s, cache = (s, cache) if isinstance(alone, str) else (alone, "none")
        if isinstance(s, str):
            lines.append(f"| {name} | refused: {s} |")
            continue
        accuracy = 100 * s["accuracy"]
        points.append((name, s["tpf"], accuracy))
        groups = s["per_group_accuracy"]  # a --limit may leave a family out
        fam = " | ".join(f"{100 * groups[f]:.1f}" if f in groups else "-" for f in FAMILIES)
        lines.append(f"| {name} | {cache} | {accuracy:.1f} | {fam} | {s['nfe_mean']:.1f} | {s['tpf']:.2f} | "
                     f"{aup([(s['tpf'], accuracy)]):.0f} | {s['tokens_per_second']:.0f} |")
    title = f"{args.model}: every sampler at its defaults ({args.limit or 'all'} items, cache {args.cache})"
    if args.plot and not plot_samplers(points, title, args.plot):
        lines.append("(plot not drawn: matplotlib is missing; pip install 'dllm-fast[plot]')")
    return lines + [""]


def plot_samplers(points: list[tuple[str, float, float]], title: str, path: str) -> bool:
    """Accuracy against tokens per forward, a labelled point per sampler; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter([p[1] for p in points], [p[2] for p in points], color="tab:blue")
    spots: dict[tuple[float, float], list[str]] = {}  # samplers on one spot share a label
    for name, tpf, accuracy in points:
        spots.setdefault((round(tpf, 2), round(accuracy, 1)), []).append(name)
    for i, ((tpf, accuracy), names) in enumerate(sorted(spots.items())):
        ax.annotate(",\n".join(names), (tpf, accuracy), fontsize=6, xytext=(4, 4 if i % 2 == 0 else -12),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.margins(x=0.1, y=0.1)
    ax.set_xlabel("tokens per forward (log)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def quantized_table(args) -> list[str]:
    """Threshold 0.9 with the model's fast cache (dual; block-causal: block) under each weight quantization, and
    how many answers equal float32's word for word."""
    lines, reference = [], None
    for name, dtype, quantize in QUANTIZED_POINTS:
        model, tok = dllm.load(args.model, dtype=dtype, quantize=quantize)
        cache = "block" if model.config.block_size else "dual"
        if not lines:
            args.block_length = decoding_lengths(model, args.gen_length, args.block_length)["block_length"]
            lines = [f"Quantized weights on {args.model} (threshold 0.9, cache {cache}, gen "
                     f"{args.gen_length}, block {args.block_length}, batch {args.batch_size}):", "",
                     "| weights | accuracy % | " + " | ".join(FAMILIES) + " | answers equal to float32's % | "
                     "weight MB | tokens/s |", "|---" * (5 + len(FAMILIES)) + "|"]
        out = Path(args.output) / args.model / "quantized"
        s = run(model, tok, name, out, "threshold", cache, {"threshold": 0.9}, args)
        with open(out / name / "results.jsonl") as f:
            answers = {r["id"]: r["output"] for r in map(json.loads, f)}
        reference = reference or answers
        same = sum(answers[i] == reference[i] for i in reference) / len(reference)
        groups = s["per_group_accuracy"]  # a --limit may leave a family out
        fam = " | ".join(f"{100 * groups[f]:.1f}" if f in groups else "-" for f in FAMILIES)
        lines.append(f"| {name} | {100 * s['accuracy']:.1f} | {fam} | {100 * same:.1f} | "
                     f"{weight_bytes(model) / 2**20:.2f} | {s['tokens_per_second']:.0f} |")
    return lines


@torch.no_grad()
def agreement_table(args) -> list[str]:
    """The logits of each weight quantization against float32's on one canvas (`--batch-size` rows of a random
    64-token prompt and a masked answer of `--gen-length`, as `dllm bench` builds it): how often the top-1 token is
    float32's, where float32's top-1 token ranks (median, 1 = first), and the relative L2 error of a position's
    logits (median). bfloat16 alone is the yardstick for int4."""
    canvas = want = None
    rows = []
    for name, dtype, quantize in QUANTIZED_POINTS:
        model, _ = dllm.load(args.model, dtype=dtype, quantize=quantize)
        if canvas is None:
            prompts = random_prompts(model, args.batch_size, 64, seed=0)
            canvas = Canvas.build(model, prompts, args.gen_length).tokens
        logits = model(canvas).float()
        want = logits if want is None else want
        top = want.argmax(-1, keepdim=True)
        agree = (logits.argmax(-1) == top[..., 0]).float().mean().item()
        rank = 1 + (logits > logits.gather(-1, top)).sum(-1).float().median().item()
        error = ((logits - want).norm(dim=-1) / want.norm(dim=-1)).median().item()
        rows.append(f"| {name} | {100 * agree:.1f} | {rank:.0f} | {error:.4f} |")
    margin = want.topk(2).values.diff(dim=-1).abs().median().item()
    return [f"Logits against float32 on {args.model} ({args.batch_size} x (64 prompt + {args.gen_length} masked) "
            f"positions, one full forward; float32's top-1 is {top.unique().numel()} distinct token(s), leading the "
            f"second by {margin:.3f} (median)):", "",
            "| weights | top-1 agreement % | rank of float32's top-1 (median) | median relative L2 error |",
            "|---|---|---|---|", *rows]


if __name__ == "__main__":
    main()
