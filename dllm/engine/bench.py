"""`dllm bench`: the cost of one decoding configuration, measured (never estimated) on fixed random prompts.

Runs with `stop_early=False`, so every run does the same work whatever the weights (random models never stop).
Reports the median of `repeats` timed runs after a warm-up run (its time too: with `--compile`, the compilation), and
each forward's time from one more run that times them one by one. On a tensor-parallel model (`load(...,
tensor_parallel=N)`) the weights and K/V bytes are rank 0's shard (the largest: it holds the vocabulary's rounded-up
share), and the timed runs' collectives and the bytes each rank sent in them are counted per step, by kind."""
from __future__ import annotations

import platform
import resource
import statistics
from dataclasses import dataclass

import torch

from .guidance import Guidance
from ..models.loading import check_parallel, meta_model
from ..models.quantize import weight_bytes
from .decoding import decode


def kv_bytes_per_token(model) -> int:
    """The bytes a K/V store holds per token on this rank: keys and values of its heads (`kv_shapes`) at every
    layer, in the model's dtype."""
    return 2 * sum(heads * size for heads, size in model.kv_shapes()) * model.dtype.itemsize


@dataclass(frozen=True)
class Place:
    """Rank `rank` of `size` without a process group: what `meta_model` needs to build that rank's shard on the meta
    device (in place of `parallel.Ranks`)."""

    rank: int
    size: int


def shard_memory(cfg, size: int, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Each rank's `weight_bytes` and `kv_bytes_per_token` with `cfg` split over `size` ranks, counted on its shard
    built on the meta device (shapes only: no process, no memory); a split the model refuses raises its DllmError."""
    check_parallel(cfg, size)
    shards = (meta_model(cfg, dtype, Place(rank, size) if size > 1 else None) for rank in range(size))
    return [{"weight_bytes": weight_bytes(m), "kv_bytes_per_token": kv_bytes_per_token(m)} for m in shards]


def traffic_per_step(before: dict, after: dict, steps: int) -> dict:
    """`{kind: {"collectives": n, "bytes": b}}` per step between two `Traffic.snapshot`s (b: what each rank sent)."""
    return {kind: {"collectives": (calls - before.get(kind, (0, 0))[0]) / steps,
                   "bytes": (sent - before.get(kind, (0, 0))[1]) / steps}
            for kind, (calls, sent) in after.items() if calls > before.get(kind, (0, 0))[0]}


def random_prompts(model, batch_size: int, prompt_length: int, seed: int) -> list[list[int]]:
    """The same `prompt_length` random ordinary token ids in every row."""
    cfg = model.config
    special = {cfg.mask_id, cfg.pad_id, cfg.filler_id, *cfg.stop_ids} - {None}
    pool = torch.tensor([t for t in range(cfg.vocab_size) if t not in special])
    pick = torch.randint(len(pool), (prompt_length,), generator=torch.Generator().manual_seed(seed))
    return [pool[pick].tolist()] * batch_size


def expert_fraction(model, prompts, sampler, cache, block_length: int, steps: int | None, seed: int) -> float:
    """The mean fraction of an MoE layer's routed experts that one forward reads (the distinct experts its
    tokens chose), counted over one block of one more run; a forward hook routes each layer's input again (its
    `router_input`, where the layer routes on another tensor than the experts' input: DiffusionGemma)."""
    counts: list[float] = []

    def count(moe, args, kwargs):
        routed = kwargs.get("router_input")
        routed = args[0] if routed is None else routed
        chosen, _ = moe.route(routed.reshape(-1, routed.shape[-1]))
        counts.append(chosen.unique().numel() / moe.cfg.n_experts)

    hooks = [layer.moe.register_forward_pre_hook(count, with_kwargs=True) for layer in model.layers
             if hasattr(layer, "moe")]
    try:
        decode(model, prompts, sampler, cache, block_length, block_length, steps, seed, stop_early=False)
    finally:
        for hook in hooks:
            hook.remove()
    return statistics.mean(counts)


def bench(model, sampler, cache, gen_length: int, block_length: int, steps: int | None = None,
          batch_size: int = 1, prompt_length: int = 64, repeats: int = 3, seed: int = 0, callback=None,
          compile: bool = False, guidance: Guidance = Guidance()) -> dict:
    """`callback` is passed to every `decode` (progress); `compile` runs the model compiled (the warm-up run
    compiles it); `guidance`: LLaDA's generation options (cfg_scale doubles the rows of every forward)."""
    prompts = random_prompts(model, batch_size, prompt_length, seed)
    device = model.device
    canvas, warm_up, _ = decode(model, prompts, sampler, cache, gen_length, block_length, steps, seed,
                                stop_early=False, callback=callback, compile=compile, guidance=guidance)  # compiles
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    traffic = model.tp.ranks.traffic if model.tp is not None else None
    before = traffic.snapshot() if traffic is not None else {}
    runs = [decode(model, prompts, sampler, cache, gen_length, block_length, steps, seed, stop_early=False,
                   callback=callback, compile=compile, guidance=guidance)[1] for _ in range(repeats)]
    after = traffic.snapshot() if traffic is not None else {}
    stats = sorted(runs, key=lambda s: s.seconds)[len(runs) // 2]
    # forwards timed one by one in a run of their own: on a GPU that waits for the device around every forward,
    # which would keep the host from queueing the loop's work behind it in the timed runs
    profiled = decode(model, prompts, sampler, cache, gen_length, block_length, steps, seed, stop_early=False,
                      profile=True, callback=callback, compile=compile, guidance=guidance)[1]
    length = canvas.tokens.shape[1]  # a block-causal model's canvas aligns the answer to its blocks
    rows = sum(stats.rows_per_layer) / len(stats.rows_per_layer)
    cfg = model.config
    described = {"arch": cfg.arch, "parameters": cfg.num_parameters(), "dtype": str(model.dtype).removeprefix("torch."),
                 "quantization": model.quantization, "weight_bytes": weight_bytes(model),  # as stored, scales included
                 "kv_bytes_per_token": kv_bytes_per_token(model)}  # both: rank 0's shard on a tensor-parallel model
    if cfg.moe is not None:  # the weights one forward reads: all but the routed experts its tokens did not choose
        routed = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers)) * cfg.moe.routed_parameters(cfg.hidden_size)
        described["experts_read"] = expert_fraction(model, prompts, sampler, cache, block_length, steps, seed)
        described["parameters_read"] = round(cfg.num_parameters() - routed * (1 - described["experts_read"]))
    return {
        "model": described,
        "config": {"sampler": sampler.config(), "cache": cache.config(), "gen_length": gen_length,
                   "block_length": block_length, "steps": steps, "batch_size": batch_size,
                   "prompt_length": prompt_length, "repeats": repeats, "compile": compile,
                   "threads": model.threads, "tensor_parallel": 1 if model.tp is None else model.tp.size},
        "seconds": stats.seconds,
        "warm_up_seconds": warm_up.seconds,  # the first run: with --compile, compiling this batch size's shapes
        "nfe": stats.nfe,
        "tpf": stats.tpf,
        "tokens_per_second": stats.tokens_per_second,
        "ms_per_step": 1000 * stats.seconds / stats.nfe,  # a forward and the loop's own work (sampler, bookkeeping)
        "ms_per_forward": {kind: 1000 * statistics.median(times) for kind, times in profiled.forward_seconds.items()},
        "forwards_by_kind": {kind: len(times) for kind, times in profiled.forward_seconds.items()},
        "rows_per_token": rows / stats.gen_tokens,  # canvas rows computed per layer per generated token
        "rows_vs_no_cache": rows / (stats.nfe * batch_size * length),  # ... relative to recomputing every row
        "rows_per_layer": stats.rows_per_layer,  # rows computed at each layer, batch summed (dLLM-Cache: unequal)
        "traffic_per_step": traffic_per_step(before, after, sum(run.nfe for run in runs)),  # tensor parallel
        "cache_mb": stats.cache_bytes / 2**20,
        "weight_mb": described["weight_bytes"] / 2**20,
        "peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # CPU: the process's peak RSS
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
    }


def format_result(r: dict) -> str:
    per_kind = ", ".join(f"{k} {v:.2f} ms x{r['forwards_by_kind'][k]}" for k, v in r["ms_per_forward"].items())
    c = r["config"]
    moe = f" (MoE: {r['model']['experts_read']:.0%} of experts read per forward)" if "experts_read" in r["model"] else ""
    quantized = r["model"]["quantization"]
    quantized = f" {quantized['scheme']}{' (head too)' if quantized['head'] else ''}" if quantized else ""
    per_rank = " per rank" if c["tensor_parallel"] > 1 else ""
    return (f"{r['model']['arch']} {r['model']['parameters'] / 1e6:.3g}M{moe} {r['model']['dtype']}{quantized} | "
            f"{c['sampler']['name']} + {c['cache']['name']} | gen {c['gen_length']} block {c['block_length']} "
            f"batch {c['batch_size']} prompt {c['prompt_length']} | {r['device']}\n"
            f"  {r['seconds']:.3f} s, {r['nfe']} forwards, {r['tpf']:.2f} tokens/forward, "
            f"{r['tokens_per_second']:.1f} tokens/s; warm-up run {r['warm_up_seconds']:.3f} s"
            f"{' (compiles)' if c['compile'] else ''}\n"
            f"  per step {r['ms_per_step']:.2f} ms; per forward: {per_kind}\n"
            f"  rows per layer per token {r['rows_per_token']:.1f} ({r['rows_vs_no_cache']:.3f} of no cache), "
            f"weights {r['weight_mb']:.1f} MB{per_rank}, K/V {r['model']['kv_bytes_per_token'] / 1024:.2f} KB per token"
            f"{per_rank}, cache {r['cache_mb']:.1f} MB, peak {r['peak_mb']:.0f} MB\n" + format_traffic(r))


def format_traffic(r: dict) -> str:
    """A tensor-parallel run's line: collectives and the bytes each rank sent per step, in all and by kind."""
    size, traffic = r["config"]["tensor_parallel"], r["traffic_per_step"]
    if size == 1:
        return ""
    kinds = ", ".join(f"{kind} {t['collectives']:.2f} x {_bytes(t['bytes'] / t['collectives'])}"
                      for kind, t in traffic.items())
    return (f"  tensor parallel over {size} ranks, per step: {sum(t['collectives'] for t in traffic.values()):.2f} "
            f"collectives, {_bytes(sum(t['bytes'] for t in traffic.values()))} sent per rank ({kinds})\n")


def _bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    return f"{n / 1024:.1f} KB" if n < 2**20 else f"{n / 2**20:.1f} MB"
