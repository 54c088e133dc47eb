"""Batch evaluation: one JSON line per example, `summary.json`, resumable, data-parallel under `accelerate launch`.

Items are cut into batches of `batch_size` in a fixed order and process r of n decodes batches r, r+n, ...,
so a batch holds the same prompts whatever the number of processes, and a resumed run repeats whole batches
that were not finished (writing only their missing records): every run of one configuration gives the same
records. All processes append to one `results.jsonl` (a record is one append); the main process rewrites it
in item order at the end and writes `summary.json`.
"""
from __future__ import annotations

import json
import os
import platform
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dllm.core.checks import check_int, check_output_dir, check_seed
from dllm.core.errors import DllmError
from dllm.engine import generate
from dllm.engine.checks import check_policies
from dllm.engine.options import settle
from dllm.engine.text import check_plain_text, encode_prompts, encode_text
from dllm.engine.trace import trace_lines
from dllm.samplers import Daedal

from .tasks import SUITES, Item, get_task

VERSIONED_PACKAGES = ("dllm-fast", "torch", "transformers", "tokenizers", "accelerate", "torchao")


def evaluate(model, tokenizer, task: str, sampler: str | Any = None, cache: str | Any = None,
             gen_length: int | str | Any = None, block_length: int | None = None, steps: int | None = None,
             limit: int | None = None, batch_size: int = 16, output: str | Path | None = None, seed: int = 0,
             chat: bool | None = None,
             sampler_args: dict | None = None, cache_args: dict | None = None, model_name: str = "",
             data: str | Path | None = None, num_fewshot: int | None = None, gold: bool = False,
             compile: bool = False, unsafe_exec: bool = False, cfg_scale: float = 0.0, logits_eos_inf: bool = False,
             confidence_eos_eot_inf: bool = False, recipe: str | None = None,
             length_args: dict | None = None, trace: str | Path | None = None) -> dict[str, Any]:
    """Decode every item of `task` (or, with `gold`, take its reference solutions), score it and write
    `output/results.jsonl` and `output/summary.json`. Returns the summary. Code tasks run each program in an
    isolated sandbox (`sandbox`), or with `unsafe_exec` in a plain guarded process. The sampler, cache and
    lengths default to the model's (`settle`); `cfg_scale`, `logits_eos_inf`, `confidence_eos_eot_inf` are
    LLaDA's generation options; `recipe` names the recipe the run follows (kept in the configuration).
    gen_length "auto" (`length_args`, or a `samplers.Daedal`): each answer chooses its length (DAEDAL); every run
    records each answer's canvas and its effective tokens (not EOS), summed into `effective_token_ratio`. `trace`: a
    file each batch this run decodes is appended to as a trace (`dllm.engine.trace`), its rows named by the items'
    ids. A suite (`tasks.SUITES`) evaluates each of its tasks into `output/<task>/` (`evaluate_suite`)."""
    from accelerate import PartialState

    if task in SUITES:
        return evaluate_suite(model, tokenizer, task, sampler, cache, gen_length, block_length, steps, output=output,
                              limit=limit, batch_size=batch_size, seed=seed, chat=chat, sampler_args=sampler_args,
                              cache_args=cache_args, model_name=model_name, data=data, num_fewshot=num_fewshot,
                              gold=gold, compile=compile, unsafe_exec=unsafe_exec, cfg_scale=cfg_scale,
                              logits_eos_inf=logits_eos_inf, confidence_eos_eot_inf=confidence_eos_eot_inf,
                              recipe=recipe, length_args=length_args, trace=trace)
    spec = get_task(task)
    score_text = spec.scorer(unsafe_exec)  # fails before any work when code cannot run isolated
    check_int("batch_size", batch_size, 1)
    if limit is not None:
        check_int("limit", limit, 1)
    shots = spec.default_fewshot if num_fewshot is None else check_int("num_fewshot", num_fewshot, 0)
    if output:
        check_output_dir(output)
    items, source = spec.load(None if data is None else str(data), shots)
    items = items[:limit] if limit else items
    config: dict[str, Any] = {"task": task, "num_fewshot": shots, "data": source, "limit": limit,
                              "batch_size": batch_size, "gold": gold}
    guidance = None
    if spec.gen_length is not None and (gen_length is None or isinstance(gen_length, int)) and length_args is None:
        # the task's lengths unless the caller sets them (a sampler with a window has no blocks and no steps)
        gen_length = spec.gen_length if gen_length is None else gen_length
        if not gold and not settle(model, sampler, cache, {}, sampler_args, cache_args, gen_length).sampler.slides:
            block_length = gen_length if block_length is None else block_length
            steps = gen_length if steps is None else steps
    if not gold:
        settings = settle(model, sampler, cache, {}, sampler_args, cache_args, gen_length, block_length, steps,
                          cfg_scale, logits_eos_inf, confidence_eos_eot_inf, length_args)
        sampler, cache, guidance = settings.sampler, settings.cache, settings.guidance.config()
        check_policies(model, sampler, cache, compile)
        check_seed(seed)
        chat = getattr(tokenizer, "chat_template", None) is not None if chat is None else chat
        gen_length, block_length, steps = settings.lengths.values()
        auto = isinstance(gen_length, Daedal)
        if not auto:
            sampler.check_gen_length(gen_length)
        _check_context(model, tokenizer, items, chat, gen_length.initial_gen_length if auto else gen_length, shots)
        config.update(model=model_name, sampler=sampler.config(), cache=cache.config(),
                      gen_length="auto" if auto else gen_length, **({"length": gen_length.config()} if auto else {}),
                      block_length=block_length, steps=steps, seed=seed, chat=chat, dtype=str(model.dtype),
                      compile=compile, quantization=model.quantization, stop_early=spec.stop_early, **guidance,
                      **({"recipe": recipe} if recipe else {}))

    state = PartialState(cpu=model is None or model.device.type != "cuda")
    rank, world = state.process_index, state.num_processes
    if world > 1 and output is None:
        raise DllmError("a data-parallel evaluation needs --output DIR to collect the records of every process")
    out_dir = Path(output) if output else None
    records: dict[str, dict] = {}
    if out_dir:
        _check_config(out_dir, config)
        state.wait_for_everyone()  # every process has read the old configuration before it is replaced
        if state.is_main_process:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            _write_records(out_dir / "results.jsonl", list(_read_records(out_dir / "results.jsonl").values()))
        state.wait_for_everyone()
        records = _read_records(out_dir / "results.jsonl")

    batches = [items[i:i + batch_size] for i in range(0, len(items), batch_size)]
    mine = batches[rank::world]

    def stale(it: Item, batch: list[Item]) -> bool:  # never decoded, or decoded as a shorter last batch
        return it.id not in records or records[it.id].get("batch_size", len(batch)) != len(batch)

    todo = [b for b in mine if any(stale(it, b) for it in b)]
    total = sum(map(len, mine))
    with ThreadPoolExecutor(os.cpu_count()) as scorer, \
            tqdm(total=total, initial=total - sum(map(len, todo)), desc=f"eval {task}",
                 disable=None if state.is_main_process else True) as bar:  # None: off when not a terminal
        for batch in todo:
            if gold:
                texts, lengths, stats = [it.gold for it in batch], [(0, 0, 0)] * len(batch), None
            else:
                texts, lengths, stats = _decode_batch(model, tokenizer, batch, sampler, cache, gen_length,
                                                      block_length, steps, seed, chat, compile, guidance,
                                                      spec.stop_early, trace)
            missing = [(i, it) for i, it in enumerate(batch) if stale(it, batch)]
            scores = scorer.map(lambda pair: score_text(pair[1], texts[pair[0]]), missing)
            for (i, it), score in zip(missing, scores):
                rec = _record(it, texts[i], score, lengths[i], stats, len(batch))
                records[it.id] = rec
                if out_dir:
                    _append(out_dir / "results.jsonl", rec)
            bar.update(len(batch))

    if out_dir:
        state.wait_for_everyone()
        records = _read_records(out_dir / "results.jsonl")
    done = [records[it.id] for it in items]
    summary = summarize(done, task)
    summary["config"] = config
    summary["environment"] = _environment(model, world)
    if out_dir and state.is_main_process:
        ids = {it.id for it in items}  # records beyond a lowered --limit stay for a later run
        _write_records(out_dir / "results.jsonl", done + [r for i, r in records.items() if i not in ids])
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def evaluate_suite(model, tokenizer, suite: str, *args: Any, output: str | Path | None = None,
                   **kwargs: Any) -> dict[str, Any]:
    """Each task of `suite` evaluated into `output/<task>/` (each with its own answer length), then the suite's
    `summary.json`: `task_scores`, `suite_score` (their unweighted mean, the paper's average), `suite_tps` (the mean
    of the tasks' tokens per step) and the same means as `accuracy`, `tps_canvas`, `tpf`, `nfe_mean`."""
    from accelerate import PartialState

    names = SUITES[suite]
    summaries = {t: evaluate(model, tokenizer, t, *args, output=Path(output) / t.partition("/")[2] if output else None,
                             **kwargs) for t in names}

    def mean(key: str) -> float:
        return sum(s[key] for s in summaries.values()) / len(summaries)

    seconds = sum(s["seconds"] for s in summaries.values())
    scores = {t: s["accuracy"] for t, s in summaries.items()}
    first = summaries[names[0]]["config"]
    summary = {"task": suite, "n": sum(s["n"] for s in summaries.values()), "accuracy": mean("accuracy"),
               "suite_score": mean("accuracy"), "task_scores": scores, "suite_tps": mean("tps_canvas"),
               "tps_canvas": mean("tps_canvas"), "tpf": mean("tpf"), "nfe_mean": mean("nfe_mean"),
               "tokens_per_second": sum(s["tokens_per_second"] * s["seconds"] for s in summaries.values()) / seconds
               if seconds else 0.0, "seconds": seconds, "accuracy_by_metric": {}, "per_group_accuracy": scores,
               "metrics_unavailable": sorted({m for s in summaries.values() for m in s["metrics_unavailable"]}),
               "config": {**{k: v for k, v in first.items() if k not in ("data", "num_fewshot", "gen_length",
                                                                          "block_length", "steps")},
                          "task": suite, "tasks": {t: {k: s["config"].get(k) for k in ("data", "num_fewshot",
                                                                                          "gen_length",
                                                                                          "block_length", "steps")}
                                                   for t, s in summaries.items()}},
               "environment": summaries[names[0]]["environment"], "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if output and PartialState().is_main_process:
        (Path(output) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def count_records(output: str | Path, sweep: bool = False) -> int:
    """Records in `output` (a suite's in its tasks' folders), or with `sweep` in its points' folders."""
    root = Path(output)
    files = root.glob("*/**/results.jsonl") if sweep else [root / "results.jsonl", *root.glob("*/*/results.jsonl")]
    return sum(len(_read_records(f)) for f in files)


def _check_context(model, tokenizer, items: list[Item], chat: bool, gen_length: int, shots: int) -> None:
    """Every prompt plus the answer must fit the model's context; say what to lower before decoding anything."""
    if not items:
        return
    try:
        longest = max(len(ids) for ids in encode_prompts(tokenizer, prompts(tokenizer, items, chat), chat))
    except DllmError as e:
        raise DllmError(f"this model's tokenizer cannot read the task's prompts ({e}); use a model whose "
                        f"vocabulary covers the task (the shipped tiny models know only the synthetic task)") from None
    context = model.config.max_length
    if longest + gen_length > context:
        raise DllmError(f"the longest prompt has {longest} tokens, which with gen_length {gen_length} exceeds the "
                        f"model's context of {context}; lower --num-fewshot (now {shots}) or --gen-length, or use "
                        f"a model with a longer context")


def prompts(tokenizer, items: list[Item], chat: bool) -> list[str | list[int]]:
    """What `generate` takes for each item: its prompt, or a conversation's token ids (through the chat template;
    with chat off, the turns' texts joined by blank lines, which differs from what the model was tuned on)."""
    out: list[str | list[int]] = []
    for it in items:
        if not it.messages:
            out.append(it.prompt)
            continue
        for _, content in it.messages:
            check_plain_text(tokenizer, content, f"prompt {it.id}")
        text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in it.messages], tokenize=False,
                                             add_generation_prompt=True) if chat else \
            "\n\n".join(c for _, c in it.messages)
        out.append(encode_text(tokenizer, text, f"prompt {it.id}"))
    return out


def _decode_batch(model, tokenizer, batch: list[Item], sampler, cache, gen_length, block_length, steps, seed,
                  chat, compile, guidance: dict, stop_early: bool, trace: str | Path | None
                  ) -> tuple[list[str], list[int], Any]:
    """Generated texts, their token counts (up to the first stop token; then the answer canvas's tokens and those
    of them that are not EOS, the effective tokens of DAEDAL's metrics) and the batch statistics; the batch's trace
    appended to `trace`."""
    out = generate(model, tokenizer, prompts(tokenizer, batch, chat), sampler, cache, gen_length, block_length, steps,
                   seed, chat, stop_early=stop_early, compile=compile, trace=trace is not None, **guidance)
    if trace is not None:
        _append_text(Path(trace), trace_lines(out, model.config.mask_id, [it.id for it in batch]))
    eos = model.config.filler_id
    counts = [(len(ids), len(canvas), sum(t != eos for t in canvas)) for ids, canvas in zip(out.token_ids,
                                                                                          out.canvas_ids)]
    return out.texts, counts, out.stats


def _record(item: Item, text: str, scores: dict, counts: tuple[int, int, int], stats, batch: int) -> dict[str, Any]:
    (extracted, correct), *_ = scores.values()
    gen_tokens, canvas_tokens, effective_tokens = counts
    return {"id": item.id, "group": item.group, "prompt": item.prompt, "output": text, "extracted": extracted,
            "reference": item.reference, "correct": _value(correct),
            "metrics": {name: _value(ok) for name, (_, ok) in scores.items()},
            "forwards": stats.nfe if stats else 0, "gen_tokens": gen_tokens, "canvas_tokens": canvas_tokens,
            "effective_tokens": effective_tokens,
            "committed_tokens": stats.gen_tokens / batch if stats else 0,
            "seconds": stats.seconds / batch if stats else 0.0, "batch_size": batch,
            "rows_per_layer": sum(stats.rows_per_layer) / len(stats.rows_per_layer) / batch if stats else 0.0}


def _value(v: bool | float | None) -> bool | float | None:
    """A metric's value as recorded: a bool, a graded float (ROUGE-L), or None when its tool is missing."""
    return v if v is None or isinstance(v, float) else bool(v)


def _read_records(path: Path) -> dict[str, dict]:
    """Every complete record of `path` by id; a line cut short by a killed run is skipped."""
    records: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                records[rec["id"]] = rec
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return records


def _append(path: Path, record: dict) -> None:
    """Append one line with a single write, so that processes sharing the file never interleave lines."""
    _append_text(path, json.dumps(record) + "\n")


def _append_text(path: Path, text: str) -> None:
    """Append `text` with a single write (lines of processes sharing the file never interleave)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _write_records(path: Path, records: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)


def _check_config(out_dir: Path, config: dict) -> None:
    """Resuming is only allowed with the configuration that wrote the records (the limit may change; steps
    left to their default equal steps = gen_length); a directory without records takes any configuration."""
    path = out_dir / "config.json"
    if not path.exists() or not _read_records(out_dir / "results.jsonl"):
        return
    old = json.loads(path.read_text())

    def value(cfg: dict, key: str):
        return cfg.get("gen_length") if key == "steps" and cfg.get(key) is None else cfg.get(key)

    changed = sorted(k for k in set(old) | set(config) if k != "limit" and value(old, k) != value(config, k))
    if changed:
        raise DllmError(f"{out_dir} holds results of another configuration ({', '.join(changed)} "
                        f"{'differs' if len(changed) == 1 else 'differ'}); use a new --output directory")


def _environment(model, processes: int) -> dict[str, Any]:
    versions = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    cuda = model is not None and model.device.type == "cuda"
    return {"python": platform.python_version(), "packages": versions, "machine": platform.machine(),
            "processor": platform.processor(), "cpu_count": os.cpu_count(), "cpu_threads": torch.get_num_threads(),
            "cpu_threads_chosen_by": getattr(model, "threads", {}).get("chosen_by"),
            "device": str(model.device) if model is not None else None,
            "gpu": torch.cuda.get_device_name(model.device) if cuda else None, "processes": processes}


def summarize(records: list[dict], task: str) -> dict[str, Any]:
    """Accuracy, forwards and throughput of a finished run. tpf = committed tokens per forward per sequence."""
    n = len(records)
    groups: dict[str, list[bool]] = defaultdict(list)
    metrics: dict[str, list[bool | float]] = defaultdict(list)
    for r in records:
        groups[r["group"]].append(r["correct"])
        for name, ok in r["metrics"].items():
            metrics.setdefault(name, [])
            if ok is not None:  # None: the metric's tool is not installed
                metrics[name].append(ok)
    forwards = sum(r["forwards"] for r in records)
    committed = sum(r["committed_tokens"] for r in records)
    canvas = sum(r.get("canvas_tokens", 0) for r in records)
    seconds = sum(r["seconds"] for r in records)
    return {"task": task, "n": n, "accuracy": sum(r["correct"] for r in records) / max(n, 1),
            "accuracy_by_metric": {m: sum(v) / len(v) if v else None for m, v in metrics.items()},
            "metrics_unavailable": [m for m, v in metrics.items() if not v and n],
            "nfe_mean": forwards / max(n, 1), "tpf": committed / max(forwards, 1),
            # answer canvas tokens per forward: ParallelBench's tokens per step (TPS) when every block is decoded
            "tps_canvas": canvas / forwards if forwards else 0.0,
            "gen_tokens_mean": sum(r["gen_tokens"] for r in records) / max(n, 1),
            "canvas_tokens_mean": canvas / max(n, 1),  # the answer canvas: gen_length, or as gen_length auto grew it
            # DAEDAL's effective token ratio (its metrics scripts): answer canvas tokens that are not EOS, of all
            "effective_token_ratio": sum(r.get("effective_tokens", 0) for r in records) / canvas if canvas else 0.0,
            "tokens_per_second": committed / seconds if seconds else 0.0, "seconds": seconds,
            "rows_per_layer_mean": sum(r.get("rows_per_layer", 0.0) for r in records) / max(n, 1),  # cache cost
            "per_group_accuracy": {g: sum(v) / len(v) for g, v in sorted(groups.items())},
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
