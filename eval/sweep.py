"""Sweeps: several sampler/cache configurations on one task -> accuracy vs tokens per forward, AUP, Pareto plot.

A point is written `sampler=threshold,threshold=0.9` (keys `sampler`, `cache`, or a parameter of either);
it replaces the base sampler or cache it names and overrides their parameters.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from dllm.core.errors import DllmError
from dllm.engine import decode
from dllm.engine.checks import check_policies
from dllm.engine.options import decoding_lengths, default_cache, model_sampler, split_params

from .harness import evaluate

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


def pareto_front(rows: list[dict]) -> list[dict]:
    """Points that no other point beats on both tokens per forward and accuracy."""
    return [r for r in rows if not any(o["tpf"] >= r["tpf"] and o["accuracy"] >= r["accuracy"]
                                       and (o["tpf"], o["accuracy"]) != (r["tpf"], r["accuracy"]) for o in rows)]


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
        point_sampler = point.pop("sampler", sampler)
        point_cache = point.pop("cache", cache)
        point_sampler, point_args = model_sampler(model, point_sampler,
                                                  sampler_args if point_sampler == sampler else None)
        s, c = split_params(point_sampler, point_cache, point, point_args, cache_args if point_cache == cache else None)
        check_policies(model, s, c, eval_args.get("compile", False))
        policies.append((spec, s, c))
    # a warm-up decode, so that the first point's tokens/s does not pay for it: the loop's own, since its one-token
    # prompt is no user's (`generate` would note that it is outside the prompts the model was trained on)
    block = decoding_lengths(model, eval_args.get("gen_length"), eval_args.get("block_length"))["block_length"]
    policies[0][1].prepare(tokenizer)
    decode(model, [[model.config.filler_id]], policies[0][1], policies[0][2], block, block,
           compile=eval_args.get("compile", False))
    rows = []
    for spec, s, c in policies:
        summary = evaluate(model, tokenizer, task, s, c, output=output / _slug(spec), **eval_args)
        rows.append({"point": spec, "accuracy": 100 * summary["accuracy"], "tpf": summary["tpf"],
                     "nfe_mean": summary["nfe_mean"], "tokens_per_second": summary["tokens_per_second"],
                     "sampler": summary["config"]["sampler"], "cache": summary["config"]["cache"]})
    result = {"task": task, "aup": aup([(r["tpf"], r["accuracy"]) for r in rows]), "points": rows,
              "pareto": [r["point"] for r in pareto_front(rows)]}
    if PartialState().is_main_process:
        (output / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")
        (output / "sweep.md").write_text(table(result))
        result["plot"] = plot(result, output / "pareto.png")
    return result


def table(result: dict) -> str:
    """A Markdown table of the points, sorted by tokens per forward, and the AUP."""
    lines = ["| point | accuracy % | tokens/forward | forwards | tokens/s | Pareto |", "|---|---|---|---|---|---|"]
    for r in sorted(result["points"], key=lambda r: r["tpf"]):
        lines.append(f"| {r['point']} | {r['accuracy']:.2f} | {r['tpf']:.2f} | {r['nfe_mean']:.1f} | "
                     f"{r['tokens_per_second']:.1f} | {'*' if r['point'] in result['pareto'] else ''} |")
    return "\n".join(lines) + f"\n\nAUP ({result['task']}): {result['aup']:.2f}\n"


def plot(result: dict, path: Path) -> str | None:
    """Accuracy against tokens per forward with the Pareto front; None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    points = result["points"]
    ax.scatter([r["tpf"] for r in points], [r["accuracy"] for r in points], color="tab:gray")
    front = sorted((r for r in points if r["point"] in result["pareto"]), key=lambda r: r["tpf"])
    ax.plot([r["tpf"] for r in front], [r["accuracy"] for r in front], "o-", color="tab:blue", label="Pareto front")
    for i, r in enumerate(sorted(points, key=lambda r: r["tpf"])):  # neighbours' labels alternate above and below
        ax.annotate(r["point"], (r["tpf"], r["accuracy"]), fontsize=7, xytext=(3, 4 if i % 2 == 0 else -11),
                    textcoords="offset points")
    ax.margins(x=0.1, y=0.15)
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"{result['task']}: AUP {result['aup']:.1f}")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
