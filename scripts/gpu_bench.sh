#!/usr/bin/env bash
# The GPU table of BENCHMARKS.md in one command: `dllm bench` on random:llada-8b in bf16, caches none and dual,
# batch 1 and 8, eager and --compile (MODEL= empty skips them); ms per full and per cached (32-row) forward against
# two floors: the bf16 weights read once per forward at the HBM bandwidth of the card, and a dense model's matmuls
# (2 FLOPs per parameter per row) at the card's dense bf16 peak. MODES=eager skips the compiled runs,
# MODES=compile runs only them (the table reads every JSON Lines file in OUT, so two calls can fill one table).
# Then the block-diffusion models with their exact block cache, batch 1 and 8, eager and compiled: random:sdar-8b
# (block 4; SDAR_MODEL= empty skips it) and the MoE random:llada2-mini (block 32; LLADA2_MODEL= empty skips it),
# whose floor counts only the experts its forwards read (`dllm bench` measures the fraction). Then WeDLM's streaming
# window on random:wedlm-8b (Qwen3-8B's shape; WEDLM_MODEL= empty skips it), sampler wedlm with its exact frontier
# cache (W + p rows a forward; random weights fill one slot a step, so it measures the forward, not the speed-up).
# Then llada-8b with quantized weights (QUANT, default int8 int4 fp8; QUANT= empty skips them; torchao:
# pip install '.[quant]'), dual cache, batch 1 and 8, each against the weight-read floor of its own bytes as
# `dllm bench` counts them (quantized layers, their scales, the bf16 embedding and head); the matmul floor of int8
# and fp8 GEMMs (fp8: dynamic activations) at twice the bf16 peak, weight-only int8 and int4 at the bf16 peak.
# Last the serving row of BENCHMARKS.md ("The engine in its own process"): `dllm bench-serve` of SERVE_MODEL
# (default tiny-llada; empty skips it), threshold/dual, 32 requests from 8 clients, every other at threshold 0.5,
# 3 rounds, on DEVICE: served against sequential tokens/s and the engine's busy share (runs/gpu-bench/serve.json).
# Tensor parallel (issue #48), only where `nvidia-smi -L` lists 2 GPUs or more: each of TP_MODELS (default
# random:llada-8b with the dual cache, random:llada2-mini with its block cache; TP_MODELS= empty skips them) at
# `--tensor-parallel` 1 and 2 (rank r on GPU r), batch 1 and 8, eager, into runs/gpu-bench/tp/, and a table of its
# own: tokens/s, ms per step, weights and K/V bytes per token per rank, collectives and bytes sent per rank per step.
#
#   scripts/gpu_bench.sh                         # writes runs/gpu-bench/*.jsonl and prints the Markdown table
#   MODEL=random:llada-tiny SDAR_MODEL=random:sdar-tiny LLADA2_MODEL=random:llada2-tiny \
#       WEDLM_MODEL=random:wedlm-tiny DEVICE=cpu DTYPE=float32 \
#       GEN=64 MODES=eager scripts/gpu_bench.sh
set -euo pipefail
MODEL=${MODEL-random:llada-8b}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
GEN=${GEN:-128}
OUT=${OUT:-runs/gpu-bench}
MODES=${MODES:-eager compile}
SDAR_MODEL=${SDAR_MODEL-random:sdar-8b}
LLADA2_MODEL=${LLADA2_MODEL-random:llada2-mini}
WEDLM_MODEL=${WEDLM_MODEL-random:wedlm-8b}
QUANT=${QUANT-int8 int4 fp8}
SERVE_MODEL=${SERVE_MODEL-tiny-llada}
SERVE_REQUESTS=${SERVE_REQUESTS:-32}
TP_MODELS=${TP_MODELS-random:llada-8b random:llada2-mini}
mkdir -p "$OUT"
for mode in $MODES; do  # one process per model, cache and mode: one load and one compilation for both batches;
  # per batch size a warm-up run, one timed run and one run that times each forward (dllm bench)
  flag=""
  [ "$mode" = compile ] && flag="--compile"
  if [ -n "$MODEL" ]; then
    for cache in none dual; do
      dllm bench --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" --sampler low_confidence --cache "$cache" \
        --gen-length "$GEN" --block-length 32 --batch-size 1,8 --repeats 1 $flag --json > "$OUT/llada-$mode-$cache.jsonl"
    done
    for scheme in $QUANT; do
      dllm bench --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" --quantize "$scheme" --sampler low_confidence \
        --cache dual --gen-length "$GEN" --block-length 32 --batch-size 1,8 --repeats 1 $flag --json \
        > "$OUT/llada-$mode-dual-$scheme.jsonl"
    done
  fi
  if [ -n "$SDAR_MODEL" ]; then  # the block-diffusion models (MoE layers compile in bf16)
    dllm bench --model "$SDAR_MODEL" --device "$DEVICE" --dtype "$DTYPE" --sampler low_confidence --cache block \
      --gen-length "$GEN" --block-length 4 --batch-size 1,8 --repeats 1 $flag --json > "$OUT/sdar-$mode-block.jsonl"
  fi
  if [ -n "$LLADA2_MODEL" ]; then
    dllm bench --model "$LLADA2_MODEL" --device "$DEVICE" --dtype "$DTYPE" --sampler low_confidence --cache block \
      --gen-length "$GEN" --batch-size 1,8 --repeats 1 $flag --json > "$OUT/llada2-$mode-block.jsonl"
  fi
  if [ -n "$WEDLM_MODEL" ]; then
    dllm bench --model "$WEDLM_MODEL" --device "$DEVICE" --dtype "$DTYPE" --sampler wedlm --cache frontier \
      --gen-length "$GEN" --batch-size 1,8 --repeats 1 $flag --json > "$OUT/wedlm-$mode-frontier.jsonl"
  fi
done
if [ -n "$SERVE_MODEL" ]; then  # one engine process beside the HTTP process, each with one CPU thread
  OMP_NUM_THREADS=1 dllm bench-serve --model "$SERVE_MODEL" --device "$DEVICE" --dtype "$DTYPE" --sampler threshold \
    --cache dual --max-batch 8 --requests "$SERVE_REQUESTS" --concurrency 8 --repeats 3 --mix threshold=0.5 --json \
    > "$OUT/serve.json"
  python -c "import json, sys; from dllm.serve.bench import format_bench; print(format_bench(json.load(sys.stdin)))" \
    < "$OUT/serve.json"
fi
if [ -n "$TP_MODELS" ] && [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)" -ge 2 ]; then
  mkdir -p "$OUT/tp"
  for model in $TP_MODELS; do
    cache=dual
    case "$model" in *llada2*|*sdar*) cache=block ;; esac  # block-causal: the exact block cache
    for n in 1 2; do
      dllm bench --model "$model" --device "$DEVICE" --dtype "$DTYPE" --sampler low_confidence --cache "$cache" \
        --gen-length "$GEN" --batch-size 1,8 --repeats 1 --tensor-parallel "$n" --json \
        > "$OUT/tp/$(basename "$model")-$cache-tp$n.jsonl"
    done
  done
fi
if compgen -G "$OUT/tp/*.jsonl" > /dev/null; then
  python - "$OUT/tp" <<'EOF'
import json
import sys
from pathlib import Path

results = [json.loads(line) for path in sorted(Path(sys.argv[1]).glob("*.jsonl"))
           for line in path.read_text().splitlines()]
print(f"\ntensor parallel, {results[0]['model']['dtype']} on {results[0]['device']}, gen {results[0]['config']['gen_length']}\n")
print("| model | cache | N | batch | tokens/s | ms per step | weights per rank MB | K/V per token per rank KB "
      "| collectives per step | sent per rank per step MB | of which layer MB | peak MB |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in results:
    c, traffic = r["config"], r["traffic_per_step"]
    print(f"| {r['model']['arch']} | {c['cache']['name']} | {c['tensor_parallel']} | {c['batch_size']} "
          f"| {r['tokens_per_second']:.1f} | {r['ms_per_step']:.2f} | {r['weight_mb']:.1f} "
          f"| {r['model']['kv_bytes_per_token'] / 1024:.1f} | {sum(t['collectives'] for t in traffic.values()):.1f} "
          f"| {sum(t['bytes'] for t in traffic.values()) / 2**20:.2f} "
          f"| {traffic.get('layer', {'bytes': 0})['bytes'] / 2**20:.2f} | {r['peak_mb']:.0f} |")
EOF
fi
python - "$OUT" <<'EOF'
import json
import sys
from pathlib import Path

BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}  # bytes/s of HBM (SXM parts)
PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s (SXM parts)
GEMM_SPEEDUP = {"int8-dynamic": 2, "fp8": 2}  # int8 / fp8 tensor cores: twice the bf16 rate (A100: no fp8)
rows = []
results = [json.loads(line) for path in sorted(Path(sys.argv[1]).glob("*.jsonl"))
           for line in path.read_text().splitlines()]
if not results:
    sys.exit(0)
for r in results:
    model, config, ms = r["model"], r["config"], r["ms_per_forward"]
    kind = "cached" if "cached" in ms else "full"
    card = next((name for name in BANDWIDTH if name in r["device"]), None)
    weights, flops = "-", "-"
    scheme = (model["quantization"] or {}).get("scheme")
    if card:
        read = model.get("parameters_read", model["parameters"]) / model["parameters"]  # MoE: the experts read
        weights = 1000 * model["weight_bytes"] * read / BANDWIDTH[card]  # as stored: quantized bytes and scales
        if "experts_read" not in model:  # a dense model's matmuls: 2 FLOPs per parameter per row
            per_row = config["block_length"] if kind == "cached" else config["prompt_length"] + config["gen_length"]
            peak = PEAK[card] * GEMM_SPEEDUP.get(scheme, 1)
            flops = 1000 * 2 * model["parameters"] * per_row * config["batch_size"] / peak
    floor = max(x for x in (weights, flops) if x != "-") if card else None
    cell = lambda x: f"{x:.2f}" if isinstance(x, float) else "-"
    rows.append(f"| {model['arch']} | {scheme or model['dtype']} | {config['cache']['name']} | "
                f"{'compile' if config.get('compile') else 'eager'} | "
                f"{config['batch_size']} | {cell(ms.get('full'))} | {cell(ms.get('cached'))} | {cell(weights)} | "
                f"{cell(flops)} | " + (f"{ms[kind] / floor:.2f}x" if floor else "-")
                + f" | {r['ms_per_step']:.2f} | {r['tokens_per_second']:.0f} | {r['weight_mb']:.1f} | {r['peak_mb']:.0f} "
                f"| {r['warm_up_seconds']:.1f} |")
print(f"{r['model']['dtype']} on {r['device']}, gen {r['config']['gen_length']}, prompt {r['config']['prompt_length']}, "
      "block 32 (sdar: 4, llada2: the preset's block)\n")
print("| model | weights | cache | mode | batch | ms per full forward | ms per cached forward | weight-read floor ms "
      "| matmul floor ms | cached (or full) / the larger floor | ms per step | tokens/s | weight MB | peak MB "
      "| first run s (compiled: compiles) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
print("\n".join(rows))
EOF
