"""Batch evaluation: one JSON line per example, `summary.json`, resumable (finished examples are skipped)."""
from __future__ import annotations

import json
import platform
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

import cache as caches
import samplers as samplers_mod
from dllm.decode import decode, encode_prompts
from dllm.errors import DllmError

from . import synthetic


@dataclass(frozen=True)
class Item:
    id: str
    prompt: str
    reference: str
    group: str  # per-group accuracy (e.g. synthetic family)


@dataclass(frozen=True)
class Task:
    name: str
    load: Callable[[], list[Item]]
    extract: Callable[[str], str | None]
    is_correct: Callable[[Item, str], bool]


def _synthetic_items() -> list[Item]:
    """The held-out split, families interleaved so that `--limit` keeps every family."""
    per_family = {f: synthetic.make_split("test", families=[f]) for f in synthetic.FAMILIES}
    n = min(map(len, per_family.values()))
    return [Item(f"{f}-{i}", per_family[f][i].prompt, per_family[f][i].answer, f)
            for i in range(n) for f in synthetic.FAMILIES]


TASKS: dict[str, Task] = {
    "synthetic": Task("synthetic", _synthetic_items, synthetic.extract_answer,
                      lambda item, text: synthetic.extract_answer(text) == synthetic.extract_answer(item.reference)),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise DllmError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]


def evaluate(model, tokenizer, task: str, sampler: str | Any = "low_confidence", cache: str | Any = "none",
             gen_length: int = 64, block_length: int = 32, steps: int | None = None, limit: int | None = None,
             batch_size: int = 16, output: str | Path | None = None, seed: int = 0, chat: bool | None = None,
             sampler_args: dict | None = None, cache_args: dict | None = None,
             model_name: str = "") -> dict[str, Any]:
    """Decode every item of `task`, score it and write `output/results.jsonl` and `output/summary.json`."""
    spec = get_task(task)
    sampler = samplers_mod.SAMPLERS.create(sampler, **(sampler_args or {}))
    cache = caches.CACHES.create(cache, **(cache_args or {}))
    if batch_size < 1:
        raise DllmError(f"batch_size ({batch_size}) must be at least 1")
    sampler.prepare(tokenizer)
    items = spec.load()[:limit] if limit else spec.load()
    out_dir = Path(output) if output else None
    records: dict[str, dict] = {}
    results_file = None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        results_file = out_dir / "results.jsonl"
        if results_file.exists():  # resume: keep every complete line
            for line in results_file.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    records[rec["id"]] = rec
                except (json.JSONDecodeError, KeyError):
                    continue
            results_file.write_text("".join(json.dumps(r) + "\n" for r in records.values()))
    todo = [it for it in items if it.id not in records]
    cfg = model.config
    with tqdm(total=len(items), initial=len(items) - len(todo), desc=f"eval {task}") as bar:
        for start in range(0, len(todo), batch_size):
            batch = todo[start:start + batch_size]
            ids = encode_prompts(tokenizer, [it.prompt for it in batch], chat)
            canvas, stats, _ = decode(model, ids, sampler, cache, gen_length, block_length, steps, seed)
            for row, it in enumerate(batch):
                gen = canvas.tokens[row, canvas.prompt_length:].tolist()
                gen = gen[:next((i for i, t in enumerate(gen) if t in cfg.stop_ids), len(gen))]
                text = tokenizer.decode(gen, skip_special_tokens=True)
                rec = {"id": it.id, "group": it.group, "prompt": it.prompt, "output": text,
                       "extracted": spec.extract(text), "reference": it.reference,
                       "correct": bool(spec.is_correct(it, text)), "forwards": stats.nfe,
                       "gen_tokens": len(gen), "committed_tokens": stats.gen_tokens / len(batch),
                       "seconds": stats.seconds / len(batch), "batch_size": len(batch)}
                records[it.id] = rec
                if results_file:
                    with results_file.open("a") as f:
                        f.write(json.dumps(rec) + "\n")
            bar.update(len(batch))
    done = [records[it.id] for it in items]
    summary = summarize(done, task)
    summary["config"] = {"model": model_name, "sampler": sampler.config(), "cache": cache.config(),
                         "gen_length": gen_length, "block_length": block_length, "steps": steps,
                         "batch_size": batch_size, "seed": seed, "limit": limit, "dtype": str(model.dtype)}
    summary["environment"] = {"torch": torch.__version__, "python": platform.python_version(),
                              "device": str(model.device), "machine": platform.machine(),
                              "cpu_threads": torch.get_num_threads(),
                              "gpu": torch.cuda.get_device_name(0) if model.device.type == "cuda" else None}
    if out_dir:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def summarize(records: list[dict], task: str) -> dict[str, Any]:
    """Accuracy, forwards and throughput of a finished run. tpf = committed tokens per forward per sequence."""
    n = len(records)
    groups: dict[str, list[bool]] = defaultdict(list)
    for r in records:
        groups[r["group"]].append(r["correct"])
    forwards = sum(r["forwards"] for r in records)
    committed = sum(r["committed_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    return {"task": task, "n": n, "accuracy": sum(r["correct"] for r in records) / max(n, 1),
            "nfe_mean": forwards / max(n, 1), "tpf": committed / max(forwards, 1),
            "gen_tokens_mean": sum(r["gen_tokens"] for r in records) / max(n, 1),
            "tokens_per_second": committed / seconds if seconds else 0.0, "seconds": seconds,
            "per_group_accuracy": {g: sum(v) / len(v) for g, v in sorted(groups.items())},
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
