"""ParallelBench's question on a tiny model: how much does decoding k tokens per step cost? Every registered sampler
on the list families of `dllm eval --task synthetic_lists` (the waiting-line operations on 3-8 letters), several
points of parallelism each, the score against tokens per step (answer tokens / forwards, every block decoded: the
paper's TPS), beside what a perfect model scores (`eval.parallel_limits`, spec `parallelbench.md` section 5).

    python scripts/lists_curve.py --model tiny-llada-lists --output runs/lists-curve --plot docs/lists-curve.png

Each point is a resumable `dllm eval` run in its own folder under `--output`; the Markdown table goes to stdout.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import dllm
from dllm.core.errors import DllmError
from dllm.engine.checks import check_policies
from dllm.engine.options import split_params
from dllm.eval.harness import evaluate
from dllm.eval.parallel_limits import replace_random_accuracy, shuffle_accuracy, top_k_schedule
from dllm.eval.synthetic import LIST_FAMILIES
from dllm.samplers import SAMPLERS

GEN = 32  # the longest answer ("#### " and 8 letters with commas, end of text) is 21 tokens: one block of 32
SIZES = range(3, 9)  # list lengths, drawn uniformly
STEPS = (32, 8, 4, 2, 1)  # samplers that follow a schedule: tokens per step 1 ... 32


def _sweep(param: str, values) -> list[dict]:
    return [{param: v} for v in values]


THRESHOLDS = (0.99, 0.9, 0.7, 0.5, 0.3)
#: The knob that sets how much a sampler commits per step, where it is not the schedule's steps.
KNOBS: dict[str, list[dict]] = {
    "threshold": _sweep("threshold", THRESHOLDS),
    "factor": _sweep("factor", (0.25, 1.0, 4.0, 16.0)),
    "credit": _sweep("threshold", THRESHOLDS),
    "localleap": [{"threshold": t, "relaxed_threshold": round(t - 0.15, 2)} for t in (0.99, 0.9, 0.7, 0.5)],
    "adablock": _sweep("threshold", (0.9, 0.5)),
    "hierarchy": [{"threshold": t, "low_threshold": round(t - 0.3, 2)} for t in (0.99, 0.92, 0.7, 0.5)],
    "low_confidence_dynamic": _sweep("threshold", THRESHOLDS),
    "entropy_bounded": _sweep("bound", (0.1, 0.35, 1.0, 3.0, 10.0)),
    "sub_block": _sweep("threshold", (0.9, 0.5)),
    "joint_threshold": _sweep("threshold", (0.95, 0.7, 0.5)),
    "joint_threshold_indel": _sweep("threshold", (0.9, 0.5)),
    "eb_sampler": _sweep("gamma", (0.01, 0.1, 1.0, 10.0)),
    "klass": _sweep("threshold", (0.9, 0.7, 0.5)),
    "wino": _sweep("threshold", (0.9, 0.7, 0.5)),
    "certainty_prior": _sweep("threshold", (0.9, 0.5, 0.1)),
    "speculative": _sweep("draft_steps", (2, 4, 8)),
    "dus": _sweep("base", (2, 4)),
}
#: Sampled tokens (temperature 1): the setting the closed forms assume.
SAMPLED = ("low_confidence", "random")


def points(only: set[str] | None = None) -> list[tuple[str, dict, int | None]]:
    """(sampler, parameters, steps) of every point (of the samplers in `only`): a knob's values, else the
    schedule's steps."""
    out = []
    for cls in SAMPLERS:
        if only and cls.name not in only:
            continue
        if cls.name in KNOBS:
            out += [(cls.name, p, None) for p in KNOBS[cls.name]]
        else:
            out += [(cls.name, {}, s) for s in STEPS]
        if cls.name in SAMPLED:
            out += [(cls.name, {"temperature": 1.0}, s) for s in STEPS]
    return out


def label(sampler: str, params: dict, steps: int | None) -> str:
    return ",".join([sampler] + [f"{k}={v}" for k, v in params.items()] + ([f"steps={steps}"] if steps else []))


def perfect(family: str, forwards: int) -> float:
    """A perfect model's score in `forwards` forwards, its list items spread evenly over them (the most a decoder
    can do; the commas, answer mark and padding are certain and share the first step): shuffle, any sampler;
    replace any, random order with sampled tokens (greedy with one item last scores 1 from two forwards)."""
    accuracy = {"shuffle": shuffle_accuracy, "replace_random": replace_random_accuracy}[family]
    return sum(float(accuracy(top_k_schedule(n, min(forwards, n)))) for n in SIZES) / len(SIZES)


def run_all(args) -> list[dict]:
    unknown = sorted((args.only or set()) - {cls.name for cls in SAMPLERS})
    if unknown:
        raise DllmError(f"--only names no registered sampler: {', '.join(unknown)} (see dllm list samplers)")
    model, tok = dllm.load(args.model)
    rows = []
    for sampler, params, steps in points(args.only):
        name = label(sampler, params, steps)
        try:
            s, c = split_params(sampler, "none", params)
            check_policies(model, s, c)
            summary = evaluate(model, tok, "synthetic_lists", s, c, gen_length=GEN, block_length=GEN, steps=steps,
                               limit=args.limit, batch_size=args.batch_size, model_name=args.model,
                               output=Path(args.output) / name.replace("=", "-").replace(",", "_"))
        except DllmError as e:
            rows.append({"sampler": sampler, "point": name, "refused": str(e)})
            continue
        rows.append({"sampler": sampler, "point": name, "score": 100 * summary["accuracy"],
                     "tps": summary["tps_canvas"], "tpf": summary["tpf"],
                     "families": {f: 100 * v for f, v in summary["per_group_accuracy"].items()}})
    return rows


def table(rows: list[dict]) -> str:
    head = "| point | tokens/step | score % | " + " | ".join(LIST_FAMILIES) + " |"
    lines = [head, "|---" * (3 + len(LIST_FAMILIES)) + "|"]
    refused = {}
    for r in rows:
        if "refused" in r:
            refused.setdefault(r["sampler"], r["refused"])
            continue
        fam = " | ".join(f"{r['families'].get(f, float('nan')):.0f}" for f in LIST_FAMILIES)
        lines.append(f"| {r['point']} | {r['tps']:.2f} | {r['score']:.1f} | {fam} |")
    lines += [""] + [f"- {name} refused: {why}" for name, why in refused.items()]
    bound = ", ".join(f"{GEN // f} tokens/step {100 * perfect('shuffle', f):.0f}%" for f in (32, 16, 8, 4, 2, 1))
    return "\n".join(lines + ["", f"A perfect model on shuffle: {bound}"]) + "\n"


def plot(rows: list[dict], path: str, title: str) -> bool:
    """Score against tokens per step, one curve per sampler, in four panels (all families, shuffle with a perfect
    model's most, replace any with a perfect model's random-order curve, the three deterministic families);
    False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = [r for r in rows if "refused" not in r]
    panels = [("all 8 families", None), ("shuffle", "shuffle"), ("replace any", "replace_random"),
              ("copy, reverse, sort", ("copy_list", "reverse_list", "sort_list"))]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9), sharex=True, sharey=True)
    colors = plt.colormaps["tab20"].colors
    curves: dict[str, list[dict]] = {}
    for r in runs:  # a curve per sampler and temperature
        curves.setdefault(r["sampler"] + (" T=1" if "temperature=1.0" in r["point"] else ""), []).append(r)
    for ax, (name, families) in zip(axes.flat, panels):
        for i, (curve, members) in enumerate(curves.items()):
            members = sorted(members, key=lambda r: r["tps"])
            if families is None:
                ys = [r["score"] for r in members]
            else:
                fams = (families,) if isinstance(families, str) else families
                ys = [sum(r["families"][f] for f in fams) / len(fams) for r in members]
            ax.plot([r["tps"] for r in members], ys, ".", ls=("-", "--", ":")[i // 10 % 3], color=colors[i % 10 * 2],
                    lw=1, ms=4, label=curve)
        if families in ("shuffle", "replace_random"):
            forwards = range(GEN, 0, -1)
            ax.plot([GEN / f for f in forwards], [100 * perfect(families, f) for f in forwards], "k-", lw=2.5,
                    label="perfect model" + (" (any sampler)" if families == "shuffle" else " (random order, T=1)"))
        if isinstance(families, tuple):  # certain answers: a perfect model is right at any tokens per step
            ax.axhline(100, color="k", lw=2.5)
            forwards = range(GEN, 0, -1)
            ax.plot([GEN / f for f in forwards], [100 * perfect("shuffle", f) for f in forwards], color="0.6", lw=2,
                    ls="--", label="shuffle's perfect-model curve")
        ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("tokens per step (answer tokens / forwards, log)")
    for ax in axes[:, 0]:
        ax.set_ylabel("score (%)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    extra = [(h, l) for ax in axes.flat[1:] for h, l in zip(*ax.get_legend_handles_labels()) if "perfect" in l]
    fig.legend(handles + [h for h, _ in extra], labels + [l for _, l in extra], loc="center right", fontsize=7)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.82, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llada-lists")
    ap.add_argument("--output", default="runs/lists-curve")
    ap.add_argument("--limit", type=int, default=400, help="items, interleaved by family (400: 50 each)")
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--plot", default=None, help="the figure (matplotlib)")
    ap.add_argument("--only", default=None, help="comma-separated samplers (default: every registered one)")
    args = ap.parse_args()
    args.only = set(args.only.split(",")) if args.only else None
    try:
        rows = run_all(args)
    except DllmError as e:
        sys.exit(f"error: {e}")
    print(table(rows))
    title = f"{Path(args.model).name}: synthetic_lists, {args.limit} items, gen {GEN}"
    if args.plot and not plot(rows, args.plot, title):
        print("(plot not drawn: matplotlib is missing; pip install 'dllm-fast[plot]')")


if __name__ == "__main__":
    main()
