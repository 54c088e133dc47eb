"""Sweeps: several sampler/cache configurations on one task -> accuracy vs tokens per forward, AUP, Pareto plot.

A point is written `sampler=threshold,threshold=0.9` (keys `sampler`, `cache`, `steps`, `block_length`, or a
parameter of either policy); it replaces the base sampler or cache it names, overrides their parameters and the
lengths it sets. On ParallelBench the parallelism axis is tokens per step (`tps_canvas`: answer tokens over forwards,
every block decoded, the paper's TPS) and the sweep adds PB-x: the most tokens per step at which the score is still
at least x (ParallelBench's leaderboard, no interpolation).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from dllm.core.errors import DllmError
from dllm.engine import generate
from dllm.engine.checks import check_policies
from dllm.engine.options import decoding_lengths, default_cache, model_sampler, split_params

from .harness import evaluate
from .tasks import SUITES, get_task

LENGTH_KEYS = ("steps", "block_length")  # the lengths a point may set
PB_LEVELS = (90, 80, 70, 60)
AUP_ALPHA = 3.0  # weight exponent of d3LLM's AUP
AUP_MAX_DROP = 5.0  # points losing more accuracy (in %) than this against the first point are left out


def aup(points: list[tuple[float, float]], y_max: float | None = None) -> float:
    """Accuracy Under Parallelism (d3LLM) of (tokens per forward, accuracy in %) points.

    Points sorted by tokens per forward rho; only those with accuracy y >= y1 - 5 count; with the weight
    W(y) = min(exp(-3 (1 - y / y_max)), 1),
    AUP = rho1 y1 + sum_i (rho_i - rho_{i-1}) (y_i W(y_i) + y_{i-1} W(y_{i-1})) / 2.
    `y_max` defaults to the best accuracy among the points."""
    if not points:
        raise DllmError("AUP needs at least one (tokens per forward, accuracy) point")
    points = sorted(points)
    y_max = max(y for _, y in points) if y_max is None else y_max
    kept = [(rho, y) for rho, y in points if y >= points[0][1] - AUP_MAX_DROP]

    def weighted(y: float) -> float:
        return y * min(math.exp(-AUP_ALPHA * (1 - y / y_max)), 1.0) if y_max > 0 else 0.0

    total = kept[0][0] * kept[0][1]
    for (rho0, y0), (rho1, y1) in zip(kept, kept[1:]):
        total += 0.5 * (rho1 - rho0) * (weighted(y1) + weighted(y0))
    return total


def parse_point(spec: str) -> dict[str, str]:
    """`sampler=threshold,threshold=0.9` -> {"sampler": "threshold", "threshold": "0.9"}."""
    out = {}
    for pair in spec.split(","):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise DllmError(f"--sweep expects KEY=VALUE[,KEY=VALUE...], got {spec!r}")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def _slug(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=_-]+", "_", spec).replace("=", "-") or "base"


def pareto_front(rows: list[dict], axis: str = "tpf") -> list[dict]:
    """Points that no other point beats on both parallelism (`axis`: tokens per forward) and accuracy."""
    return [r for r in rows if not any(o[axis] >= r[axis] and o["accuracy"] >= r["accuracy"]
                                       and (o[axis], o["accuracy"]) != (r[axis], r["accuracy"]) for o in rows)]


def parallelism_axis(task: str) -> str:
    """`tps_canvas` (tokens per step, every block decoded) for tasks that decode without stopping early
    (ParallelBench), else `tpf` (tokens per forward)."""
    return "tps_canvas" if task in SUITES or not get_task(task).stop_early else "tpf"


def pb_scores(points: list[tuple[float, float]], levels: tuple[int, ...] = PB_LEVELS) -> dict[str, float | None]:
    """PB-x of (tokens per step, score in %) points: the most tokens per step among points scoring at least x
    (None when none does)."""
    return {f"PB{x}": max((tps for tps, y in points if y >= x), default=None) for x in levels}


def run_sweep(model, tokenizer, task: str, points: list[str], output: str | Path, sampler: str = "low_confidence",
              cache: str | None = None, sampler_args: dict | None = None, cache_args: dict | None = None,
              **eval_args: Any) -> dict[str, Any]:
    """Evaluate every point into `output/<point>/`, then write `sweep.json`, `sweep.md` and `pareto.png`."""
    from accelerate import PartialState

    output = Path(output)
    cache = default_cache(model) if cache is None else cache
    policies = []
    for spec in points:  # every point checked before the first is evaluated
        point = parse_point(spec)
        lengths = {key: _length(spec, key, point.pop(key)) for key in LENGTH_KEYS if key in point}
        point_sampler = point.pop("sampler", sampler)
        point_cache = point.pop("cache", cache)
        point_sampler, point_args = model_sampler(model, point_sampler,
                                                  sampler_args if point_sampler == sampler else None)
        s, c = split_params(point_sampler, point_cache, point, point_args, cache_args if point_cache == cache else None)
        check_policies(model, s, c, eval_args.get("compile", False))
        policies.append((spec, s, c, lengths))
    # a warm-up decode, so that the first point's tokens/s does not pay for it
    block = decoding_lengths(model, eval_args.get("gen_length"), eval_args.get("block_length"))["block_length"]
    generate(model, tokenizer, [[model.config.filler_id]], policies[0][1], policies[0][2], gen_length=block,
             block_length=block, chat=False, compile=eval_args.get("compile", False))
    axis = parallelism_axis(task)
    rows = []
    for spec, s, c, lengths in policies:
        summary = evaluate(model, tokenizer, task, s, c, output=output / _slug(spec), **{**eval_args, **lengths})
        rows.append({"point": spec, "accuracy": 100 * summary["accuracy"], "tpf": summary["tpf"],
                     "tps_canvas": summary["tps_canvas"], "nfe_mean": summary["nfe_mean"],
                     "tokens_per_second": summary["tokens_per_second"],
                     "sampler": summary["config"]["sampler"], "cache": summary["config"]["cache"]})
    result = {"task": task, "axis": axis, "aup": aup([(r[axis], r["accuracy"]) for r in rows]), "points": rows,
              "pareto": [r["point"] for r in pareto_front(rows, axis)]}
    if axis == "tps_canvas":
        result["pb"] = pb_scores([(r["tps_canvas"], r["accuracy"]) for r in rows])
    if PartialState().is_main_process:
        (output / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")
        (output / "sweep.md").write_text(table(result))
        result["plot"] = plot(result, output / "pareto.png")
    return result


def _length(spec: str, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise DllmError(f"--sweep point {spec!r}: {key} takes a whole number, got {value!r}") from None


def table(result: dict) -> str:
    """A Markdown table of the points, sorted by the parallelism axis, the AUP over it and PB-x (ParallelBench)."""
    axis = result.get("axis", "tpf")
    steps = axis == "tps_canvas"
    lines = ["| point | accuracy % |" + (" tokens/step |" if steps else "") + " tokens/forward | forwards | tokens/s |"
             " Pareto |", "|---|---|" + ("---|" if steps else "") + "---|---|---|---|"]
    for r in sorted(result["points"], key=lambda r: r[axis]):
        lines.append(f"| {r['point']} | {r['accuracy']:.2f} |" + (f" {r['tps_canvas']:.2f} |" if steps else "") +
                     f" {r['tpf']:.2f} | {r['nfe_mean']:.1f} | {r['tokens_per_second']:.1f} | "
                     f"{'*' if r['point'] in result['pareto'] else ''} |")
    over = " over tokens per step" if steps else ""
    text = "\n".join(lines) + f"\n\nAUP ({result['task']}{over}): {result['aup']:.2f}\n"
    if "pb" in result:
        text += "PB-x (most tokens per step scoring at least x): " + ", ".join(
            f"{k} {'-' if v is None else f'{v:.2f}'}" for k, v in result["pb"].items()) + "\n"
    return text


def plot(result: dict, path: Path) -> str | None:
    """Accuracy against tokens per forward with the Pareto front; None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    points, axis = result["points"], result.get("axis", "tpf")
    ax.scatter([r[axis] for r in points], [r["accuracy"] for r in points], color="tab:gray")
    if axis == "tps_canvas":  # one curve per sampler: score against tokens per step
        for name in dict.fromkeys(r["sampler"]["name"] for r in points):
            curve = sorted((r for r in points if r["sampler"]["name"] == name), key=lambda r: r[axis])
            ax.plot([r[axis] for r in curve], [r["accuracy"] for r in curve], ".--", label=name)
    front = sorted((r for r in points if r["point"] in result["pareto"]), key=lambda r: r[axis])
    ax.plot([r[axis] for r in front], [r["accuracy"] for r in front], "o-", color="tab:blue", label="Pareto front")
    for i, r in enumerate(sorted(points, key=lambda r: r[axis])):  # neighbours' labels alternate above and below
        ax.annotate(r["point"], (r[axis], r["accuracy"]), fontsize=7, xytext=(3, 4 if i % 2 == 0 else -11),
                    textcoords="offset points")
    ax.margins(x=0.1, y=0.15)
    ax.set_xlabel("tokens per step (answer tokens / forwards)" if axis == "tps_canvas" else "tokens per forward")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"{result['task']}: AUP {result['aup']:.1f}")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
