"""`dllm bench-serve`: the server's throughput and latency against sequential `dllm.generate`, every served answer
compared with its sequential one, and the share of the time its engine spent decoding; a table and a plot."""
from __future__ import annotations

import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from ..engine.text import encode_text
from .client import load, post
from .engine_client import EngineClient
from .engine_process import EngineSpec
from .http import LocalServer
from .requests import RequestReader


def bench_serve(model, tokenizer, spec: EngineSpec, defaults: dict[str, Any], requests: int = 64,
                concurrency: tuple[int, ...] = (1, 4, 16), seed: int = 0, system_prompt_tokens: int = 0,
                mix: dict[str, Any] | None = None, repeats: int = 1) -> dict:
    """Throughput and latency of `requests` chat requests (synthetic tasks; with `system_prompt_tokens`, all after
    one shared system message of that length) at each client concurrency against a loopback server (its engine a
    process of its own, as `spec` says), and of the same prompts decoded one after another with `dllm.generate`
    on `model` in this process; every served answer is compared with its sequential one. `rows` counts the token
    rows the network computed per layer (what a prefix cache saves); `busy` is the share of the served wall time
    the engine spent inside its decode loop, `busy_while_held` its share of the time the engine held a request
    (the decode loop's own efficiency: the rest of the time no request had reached it). `mix`: body fields every other request sends (e.g. {"threshold":
    0.5}: half the requests at another threshold, interleaved). `repeats`: rounds per concurrency, each a
    sequential pass then a served one, so that a shared machine's changing load hits both alike; a level's speedup
    and busy share are the medians of its rounds', its tokens/s the median round's. The client threads run in a
    process of their own, as real clients do."""
    from ..engine import generate
    from ..eval.synthetic import FAMILIES, make_split

    prompts = [ex.prompt for ex in make_split("test", -(-requests // len(FAMILIES)), seed=seed)][:requests]
    name, compile = spec.model, spec.compile
    engine = EngineClient(RequestReader(model, tokenizer, name, defaults, compile), spec)
    system = [{"role": "system", "content": system_prompt(tokenizer, system_prompt_tokens)}] if system_prompt_tokens \
        else []
    bodies = [{"messages": [*system, {"role": "user", "content": p}], **((mix or {}) if i % 2 else {})}
              for i, p in enumerate(prompts)]
    jobs = [engine.job(body, chat=True) for body in bodies]  # the decoding each request gets
    options = [dict(sampler=job.sampler, cache=job.cache, **job.lengths, seed=job.seed, compile=compile)
               for job in jobs]
    generate(model, tokenizer, [jobs[0].ids], **options[0])  # warm-up
    sequential = [generate(model, tokenizer, [job.ids], **o) for job, o in zip(jobs, options)]
    want = [g.texts[0] for g in sequential]
    tokens = sum(len(g.token_ids[0]) for g in sequential)
    layers = model.config.n_layers

    def sequential_seconds() -> float:
        began = time.perf_counter()
        for job, o in zip(jobs, options):
            generate(model, tokenizer, [job.ids], **o)
        return time.perf_counter() - began

    alone, rows = [], []
    clients = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    clients.submit(time.sleep, 0).result()  # the clients' process started before any timing
    with clients, LocalServer(engine) as local:
        post(local.url + "/v1/chat/completions", bodies[0])  # warm-up
        for level in concurrency:
            rounds, computed = [], rows_computed(engine)
            for _ in range(repeats):
                alone.append(sequential_seconds())
                busy, held = busy_seconds(engine), held_seconds(engine)
                served = clients.submit(load, local.url + "/v1/chat/completions", bodies, level).result()
                served["busy"] = (busy_seconds(engine) - busy) / served["seconds"]
                served["busy_while_held"] = (busy_seconds(engine) - busy) / (held_seconds(engine) - held)
                rounds.append((alone[-1], served))
            rows.append({**_served_row(level, rounds, want, tokens),
                         "rows": (rows_computed(engine) - computed) // layers // repeats})
    seconds = statistics.median(alone)
    rows.insert(0, {"concurrency": "sequential", "seconds": seconds, "requests_per_s": len(prompts) / seconds,
                    "tokens_per_s": tokens / seconds, "p50_s": None, "p99_s": None, "speedup": 1.0, "busy": None,
                    "busy_while_held": None,
                    "errors": 0, "mismatches": 0,
                    "rows": sum(sum(g.stats.rows_per_layer) for g in sequential) // layers})
    config = {"model": name, "sampler": jobs[0].sampler.name, "cache": jobs[0].cache.name, **jobs[0].lengths,
              "mix": mix or {}, "max_batch": spec.max_batch, "requests": len(prompts), "repeats": repeats,
              "device": str(model.device), "threads": torch.get_num_threads(),
              "threads_chosen_by": model.threads.get("chosen_by"), "prefix_cache_mb": spec.prefix_cache_mb,
              "prompt_tokens": sum(len(job.ids) for job in jobs) / len(jobs), "system_prompt_tokens": system_prompt_tokens}
    if spec.prefix_cache_mb:
        config["prefix_cache_hit_tokens"] = engine.metrics.last.prefix.hits
    return {"config": config, "rows": rows}


def _served_row(level: int, rounds: list[tuple[float, dict]], want: list[str], tokens: int) -> dict:
    """One concurrency's row from its rounds (sequential seconds, served run): the median round's throughput, the
    medians of the rounds' speedups and busy shares, latencies over all rounds, errors and differing answers
    summed."""
    ratios, throughputs, latencies, errors, mismatches = [], [], [], 0, 0
    for seconds, run in rounds:
        ok = [(answer, latency) for status, answer, latency in run["results"] if status == 200]
        texts = [answer["choices"][0]["message"]["content"] if status == 200 else None
                 for status, answer, _ in run["results"]]
        served = sum(answer["usage"]["completion_tokens"] for answer, _ in ok)
        throughputs.append((served / run["seconds"], len(ok) / run["seconds"], run["seconds"]))
        ratios.append(served / run["seconds"] / (tokens / seconds))
        latencies += [latency for _, latency in ok]
        errors += len(run["results"]) - len(ok)
        mismatches += sum(t is not None and t != w for t, w in zip(texts, want))
    tokens_per_s, requests_per_s, seconds = sorted(throughputs)[len(throughputs) // 2]
    latencies = sorted(latencies) or [float("nan")]
    return {"concurrency": level, "seconds": seconds, "requests_per_s": requests_per_s, "tokens_per_s": tokens_per_s,
            "p50_s": latencies[len(latencies) // 2],
            "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "speedup": statistics.median(ratios), "busy": statistics.median(run["busy"] for _, run in rounds),
            "busy_while_held": statistics.median(run["busy_while_held"] for _, run in rounds),
            "errors": errors, "mismatches": mismatches}


def rows_computed(engine: EngineClient) -> int:
    return int(engine.metrics.registry.get_sample_value("dllm_rows_computed_total"))


def busy_seconds(engine: EngineClient) -> float:
    """Seconds the engine has spent inside its decode loop (as its last outputs said)."""
    return engine.metrics.registry.get_sample_value("dllm_engine_busy_seconds_total")


def held_seconds(engine: EngineClient) -> float:
    """Seconds the engine has held at least one request."""
    return engine.metrics.registry.get_sample_value("dllm_engine_held_seconds_total")


SYSTEM_TEXT = "you are a careful assistant. read the task, then answer with the result alone, exactly as asked. "


def system_prompt(tokenizer, tokens: int) -> str:
    """A system message of `tokens` tokens (at most; exactly for the tiny models' character tokenizers)."""
    text = SYSTEM_TEXT * (tokens // len(encode_text(tokenizer, SYSTEM_TEXT, "the system prompt")) + 1)
    while len(encode_text(tokenizer, text, "the system prompt")) > tokens:
        text = text[:-1]
    return text


def format_bench(result: dict) -> str:
    c = result["config"]
    prefix = f" | prefix cache {c['prefix_cache_mb']:g} MiB" if c.get("prefix_cache_mb") else ""
    mix = f" | every other request with {json.dumps(c['mix'])}" if c.get("mix") else ""
    lines = [f"{c['model']} {c['sampler']}/{c['cache']} gen {c['gen_length']} block {c['block_length']}{mix} | "
             f"max batch {c['max_batch']} | {c['requests']} requests x {c.get('repeats', 1)} rounds, prompts of "
             f"{c['prompt_tokens']:.0f} tokens{prefix} | {c['device']}, {c['threads']} threads",
             f"{'clients':>10} {'req/s':>7} {'tok/s':>8} {'busy':>5} {'held':>5} {'p50 s':>7} {'p99 s':>7} "
             f"{'speedup':>8} {'errors':>6} {'differ':>6} {'rows':>8}"]
    for r in result["rows"]:
        p50 = "-" if r["p50_s"] is None else f"{r['p50_s']:.3f}"
        p99 = "-" if r["p99_s"] is None else f"{r['p99_s']:.3f}"
        busy, held = ("-" if r.get(k) is None else f"{r[k]:.0%}" for k in ("busy", "busy_while_held"))
        lines.append(f"{r['concurrency']:>10} {r['requests_per_s']:7.2f} {r['tokens_per_s']:8.1f} {busy:>5} {held:>5} "
                     f"{p50:>7} {p99:>7} {r['speedup']:7.2f}x {r['errors']:6d} {r['mismatches']:6d} {r['rows']:8d}")
    lines.append("busy: the engine's share of the served wall time inside its decode loop; held: of the time it held a "
                 "request")
    return "\n".join(lines) + "\n"


def plot_bench(result: dict, path: str) -> bool:
    """Served tokens/s against client concurrency, sequential decoding as a line; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    served = [r for r in result["rows"] if r["concurrency"] != "sequential"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r["concurrency"] for r in served], [r["tokens_per_s"] for r in served], "o-", label="dllm serve")
    ax.axhline(result["rows"][0]["tokens_per_s"], color="grey", ls="--", label="sequential dllm.generate")
    c = result["config"]
    ax.set(xscale="log", xlabel="concurrent clients", ylabel="answer tokens / s",
           title=f"{c['model']} {c['sampler']}/{c['cache']}, max batch {c['max_batch']}")
    ax.set_xticks([r["concurrency"] for r in served], [str(r["concurrency"]) for r in served])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
