"""Per-rank weight bytes and K/V bytes per token of tensor-parallel shards (BENCHMARKS.md, "Tensor parallel").

Each rank's shard is built on the meta device (`engine.bench.shard_memory`: the shapes `load(...,
tensor_parallel=N)` gives that rank, no process and no memory), so the 8B-26B presets are counted in a second. Per
model and N: the largest rank's weight bytes and K/V bytes per token, and their ratios to N=1; a split the model
refuses is named with its reason. A key/value head that several ranks hold (fewer key/value heads than ranks) is
counted on each, so K/V bytes stop halving there.

    python scripts/tp_memory.py                                   # the three presets of issue #48, N = 1, 2, 4, 8
    python scripts/tp_memory.py --models llada-tiny --sizes 1,2 --dtype float32
"""
from __future__ import annotations

import argparse

import torch

from dllm.core.errors import DllmError
from dllm.engine.bench import shard_memory
from dllm.models import PRESETS
from dllm.models.loading import parse_dtype


def kv_heads(cfg) -> list[int]:
    """The model's key/value head counts (DiffusionGemma: sliding and full-attention layers)."""
    return [cfg.n_kv_heads, *([cfg.full_kv_heads] if hasattr(cfg, "full_kv_heads") else [])]


def size_text(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.3f} MiB"


def rows(name: str, sizes: list[int], dtype: torch.dtype) -> list[str]:
    cfg, out, base = PRESETS[name], [], None
    for size in sizes:
        try:
            shards = shard_memory(cfg, size, dtype)
        except DllmError as error:
            out.append(f"| random:{name} | {size} | refused: {str(error).split(': ', 1)[1].split(';')[0]} "
                       f"| | | | |")
            continue
        weights = max(s["weight_bytes"] for s in shards)
        kv = max(s["kv_bytes_per_token"] for s in shards)
        base = base or (weights, kv)
        replicated = [f"{count} key/value heads on {size} ranks" for count in kv_heads(cfg) if count < size]
        out.append(f"| random:{name} | {size} | {size_text(weights)} | {weights / base[0]:.3f} | {kv / 1024:.2f} | "
                   f"{kv / base[1]:.3f} | {'; '.join(replicated) + ': replicated' if replicated else ''} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llada-8b,llada2-mini,diffusion-gemma-26b-a4b",
                    help="presets of `random:` (comma-separated)")
    ap.add_argument("--sizes", default="1,2,4,8", help="ranks N (comma-separated; the first is the ratios' base)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    sizes, dtype = [int(n) for n in args.sizes.split(",")], parse_dtype(args.dtype)
    print(f"{args.dtype}; the largest rank's shard (rank 0: the vocabulary's rounded-up share)\n")
    print(f"| model | N | weights per rank | / N={sizes[0]} | K/V per token per rank KiB | / N={sizes[0]} "
          f"| note |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        print("\n".join(rows(name, sizes, dtype)))


if __name__ == "__main__":
    main()
