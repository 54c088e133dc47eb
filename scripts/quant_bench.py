"""Tokens/s of quantized weights against float32 in one process (BENCHMARKS.md, "Quantized weights on this CPU").

Every variant is loaded once; then, round after round, `dllm bench`'s measurement (`engine.bench`: a warm-up run, a
timed run, a run timing each forward) runs each variant at each batch size in turn, so a shared machine's changing
load falls on all of them alike, and each variant reports its best round.

    OMP_NUM_THREADS=1 python scripts/quant_bench.py --model random:llada-small --cache dual --batch-size 1,8
"""
from __future__ import annotations

import argparse
import json

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.engine.bench import bench

# (name, dtype, quantize, quantize_head); int4 runs in bfloat16, so bfloat16 alone is its yardstick
VARIANTS = [("float32", "float32", None, False), ("int8", "float32", "int8", False),
            ("int8-dynamic", "float32", "int8-dynamic", False), ("int8-dynamic + head", "float32", "int8-dynamic", True),
            ("bfloat16", "bfloat16", None, False), ("int4", "bfloat16", "int4", False)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llada-small")
    ap.add_argument("--cache", default="dual")
    ap.add_argument("--gen-length", type=int, default=32)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--batch-size", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=None, help="comma-separated variant names (default: all of VARIANTS)")
    ap.add_argument("--json", default=None, help="write every round's results to this JSON Lines file")
    args = ap.parse_args()
    chosen = [v for v in VARIANTS if args.only is None or v[0] in args.only.split(",")]
    models = {name: dllm.load(args.model, dtype=dtype, quantize=quantize, quantize_head=head)[0]
              for name, dtype, quantize, head in chosen}
    batches = [int(b) for b in args.batch_size.split(",")]
    best: dict[tuple[str, int], dict] = {}
    log = open(args.json, "w") if args.json else None
    for round_ in range(args.rounds):
        for batch in batches:
            for name, model in models.items():
                r = bench(model, samplers.SAMPLERS.create("low_confidence"), caches.CACHES.create(args.cache),
                          args.gen_length, args.block_length, batch_size=batch, repeats=1)
                r["variant"], r["round"] = name, round_
                if log:
                    log.write(json.dumps(r) + "\n")
                    log.flush()
                if (name, batch) not in best or r["seconds"] < best[name, batch]["seconds"]:
                    best[name, batch] = r
    print(f"{args.model}, {args.cache} cache, low_confidence, gen {args.gen_length}, block {args.block_length}, "
          f"prompt 64; best of {args.rounds} alternating rounds; {next(iter(best.values()))['device']}\n")
    print("| weights | batch | tokens/s | vs float32 | ms per full forward | ms per cached forward | weight MB |")
    print("|---|---|---|---|---|---|---|")
    for batch in batches:
        base = best.get(("float32", batch))
        for name in models:
            r = best[name, batch]
            ratio = f"{r['tokens_per_second'] / base['tokens_per_second']:.2f}x" if base else "-"
            ms = r["ms_per_forward"]
            print(f"| {name} | {batch} | {r['tokens_per_second']:.1f} | {ratio} | {ms.get('full', 0):.1f} | "
                  f"{ms.get('cached', 0):.1f} | {r['weight_mb']:.1f} |")


if __name__ == "__main__":
    main()
