"""`dllm bench`: counted costs equal their closed forms (no timing assertions)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import random_model

from dllm import cache as caches
from dllm import samplers
from dllm.cli import main
from dllm.engine.bench import bench


@pytest.mark.parametrize("cache,full", [("none", 16), ("prefix", 2), ("dual", 2)])
def test_forward_kinds_and_rows_follow_the_cache(cache, full):
    model = random_model("llada-tiny")
    P, G, B = 8, 16, 8
    r = bench(model, samplers.SAMPLERS.create("low_confidence"), caches.CACHES.create(cache), G, B,
              batch_size=2, prompt_length=P, repeats=1)
    assert r["nfe"] == G and r["forwards_by_kind"]["full"] == full
    assert r["forwards_by_kind"].get("cached", 0) == G - full
    L, blocks = P + G, G // B
    rows = {"none": G * L,
            "prefix": sum(L + (B - 1) * (L - P - k * B) for k in range(blocks)),  # block start to canvas end
            "dual": blocks * (L + (B - 1) * B)}[cache]
    assert r["rows_per_token"] == pytest.approx(2 * rows / (2 * G))
    assert r["rows_vs_no_cache"] == pytest.approx(rows / (G * L))


def test_no_cache_computes_every_row_whatever_the_prompt_length():
    """On a block-causal model the canvas aligns the answer to its blocks; rows_vs_no_cache counts that canvas."""
    r = bench(random_model("sdar-tiny"), samplers.SAMPLERS.create("low_confidence"), caches.CACHES.create("none"),
              16, 4, prompt_length=7, repeats=1)
    assert r["rows_vs_no_cache"] == pytest.approx(1.0)


def test_cli_bench_prepares_the_sampler_and_checks_the_seed(capsys):
    assert main(["bench", "--model", "tiny-llada", "--sampler", "adablock", "--gen-length", "16", "--block-length",
                 "8", "--prompt-length", "8", "--repeats", "1", "--json"]) == 0  # delimiter ids from the tokenizer
    assert json.loads(capsys.readouterr().out)["nfe"] > 0
    assert main(["bench", "--model", "random:llada-tiny", "--seed", str(2**64)]) == 2
    assert "seed must be at most" in capsys.readouterr().err


def test_cli_bench_json(capsys):
    main(["bench", "--model", "random:llada-tiny", "--cache", "dual", "--gen-length", "16", "--block-length", "8",
          "--prompt-length", "8", "--repeats", "1", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert r["config"]["cache"]["name"] == "dual" and r["nfe"] == 16 and r["tpf"] == 1.0
    assert set(r["ms_per_forward"]) == {"full", "cached"} and r["cache_mb"] > 0


def test_cli_bench_times_each_batch_size_on_one_model(capsys):
    """`--batch-size 1,3`: a JSON line per batch size, in order, each decoding its own batch."""
    main(["bench", "--model", "random:llada-tiny", "--cache", "dual", "--gen-length", "16", "--block-length", "8",
          "--prompt-length", "8", "--repeats", "1", "--batch-size", "1,3", "--json"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["config"]["batch_size"] for r in lines] == [1, 3]
    per_row = 2 * (24 + 7 * 8)  # dual, 2 blocks: a full forward (24 rows), then 7 steps of the 8 block rows
    assert [r["rows_per_token"] * 16 * r["config"]["batch_size"] for r in lines] == pytest.approx([per_row, 3 * per_row])


def test_timed_runs_never_wait_for_the_device_around_a_forward(monkeypatch):
    """Seconds and tokens/s come from runs without per-forward timing (on a GPU that timing synchronizes around
    every forward); the per-forward times come from one run of their own, after them."""
    import dllm.engine.bench as bench_module

    profiled, real_decode = [], bench_module.decode

    def decode(*args, **kwargs):
        profiled.append(kwargs.get("profile", False))
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(bench_module, "decode", decode)
    r = bench(random_model("llada-tiny"), samplers.SAMPLERS.create("low_confidence"), caches.CACHES.create("dual"),
              16, 8, prompt_length=8, repeats=3)
    assert profiled == [False, False, False, False, True]  # warm-up, 3 timed runs, the per-forward run
    assert sum(r["forwards_by_kind"].values()) == r["nfe"]


def test_the_warm_up_run_is_reported_apart_from_the_timed_runs(monkeypatch):
    """`warm_up_seconds` is the first run's time (with --compile, the compilation), never part of `seconds`."""
    import dllm.engine.bench as bench_module

    real_decode, calls = bench_module.decode, []

    def decode(*args, **kwargs):
        canvas, stats, trace = real_decode(*args, **kwargs)
        calls.append(stats)
        if len(calls) == 1:
            stats.seconds = 100.0  # a slow first run
        return canvas, stats, trace

    monkeypatch.setattr(bench_module, "decode", decode)
    r = bench(random_model("llada-tiny"), samplers.SAMPLERS.create("low_confidence"), caches.CACHES.create("dual"),
              16, 8, prompt_length=8, repeats=1)
    assert r["warm_up_seconds"] == 100.0 and r["seconds"] == calls[1].seconds < 100.0


@pytest.mark.parametrize("tty,json_flag,bar", [(True, False, True), (True, True, False), (False, False, False)])
def test_progress_bar_only_on_a_terminal_without_json(tty, json_flag, bar, capsys, monkeypatch):
    """The bar's total is every token committed (warm-up run, timed runs, the run that times each forward); off
    with --json or when piped."""
    monkeypatch.setattr("sys.stderr.isatty", lambda: tty, raising=False)
    main(["bench", "--model", "random:llada-tiny", "--gen-length", "16", "--block-length", "8", "--prompt-length",
          "8", "--repeats", "2", "--batch-size", "2"] + ["--json"] * json_flag)
    err = capsys.readouterr().err
    assert ("bench:" in err and "/128 [" in err) == bar  # 2 rows x (16 warm-up + 2 x 16 + 16) tokens


def test_the_gpu_script_writes_its_whole_table_on_the_tiny_presets(tmp_path):
    """scripts/gpu_bench.sh, as the next lent GPU will run it, on the CPU with the tiny presets (eager): a row per
    model, weights, cache and batch size, each with its timings; the floors need a known card, so a CPU's are '-'."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_bench.sh"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "MODEL": "random:llada-tiny", "SDAR_MODEL": "random:sdar-tiny", "LLADA2_MODEL": "random:llada2-tiny",
           "WEDLM_MODEL": "random:wedlm-tiny",
           "DEVICE": "cpu", "DTYPE": "float32", "GEN": "32", "MODES": "eager", "QUANT": "int8", "OUT": str(tmp_path),
           "SERVE_MODEL": ""}  # (the serving row is `dllm bench-serve`, tests/test_serve.py)
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    header, rows = [cell.strip() for cell in rows[0]], [[cell.strip() for cell in row] for row in rows[1:]]
    assert [tuple(r[:5]) for r in rows] == [
        ("llada", "int8", "dual", "eager", "1"), ("llada", "int8", "dual", "eager", "8"),
        ("llada", "float32", "dual", "eager", "1"), ("llada", "float32", "dual", "eager", "8"),
        ("llada", "float32", "none", "eager", "1"), ("llada", "float32", "none", "eager", "8"),
        ("llada2", "float32", "block", "eager", "1"), ("llada2", "float32", "block", "eager", "8"),
        ("sdar", "float32", "block", "eager", "1"), ("sdar", "float32", "block", "eager", "8"),
        ("wedlm", "float32", "frontier", "eager", "1"), ("wedlm", "float32", "frontier", "eager", "8")]
    weight = header.index("weight MB")
    assert float(rows[0][weight]) < float(rows[2][weight]) / 2  # int8 layers
    for row in rows:
        forward = "ms per full forward" if row[2] == "none" else "ms per cached forward"
        assert all(float(row[header.index(name)]) > 0 for name in (forward, "ms per step", "tokens/s")), row
        assert float(row[header.index("first run s (compiled: compiles)")]) >= 0
        assert row[header.index("weight-read floor ms")] == "-"


def test_the_gpu_scripts_floors_read_the_bytes_stored(tmp_path):
    """The weight-read floor of a quantized row is its own bytes (`weight_bytes`) at the card's bandwidth, and int8
    and fp8 GEMMs have a matmul floor at twice the bf16 peak: a made-up H100 line through the script's table."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_bench.sh"
    config = {"cache": {"name": "dual"}, "batch_size": 8, "block_length": 32, "prompt_length": 64, "gen_length": 128}
    line = {"model": {"arch": "llada", "parameters": 8e9, "dtype": "bfloat16", "weight_bytes": 3.35e9,
                      "quantization": {"scheme": "fp8", "head": False}}, "config": config,
            "ms_per_forward": {"full": 9.0, "cached": 2.0}, "device": "NVIDIA H100 80GB HBM3", "ms_per_step": 2.5,
            "tokens_per_second": 100.0, "weight_mb": 3.35e9 / 2**20, "peak_mb": 4000.0, "warm_up_seconds": 1.0}
    (tmp_path / "x.jsonl").write_text(json.dumps(line) + "\n")
    env = {**os.environ, "MODEL": "", "SDAR_MODEL": "", "LLADA2_MODEL": "", "WEDLM_MODEL": "", "SERVE_MODEL": "",
           "OUT": str(tmp_path)}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True).stdout
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ")]
    row = dict(zip(rows[0], rows[1]))
    assert row["weights"] == "fp8" and row["weight-read floor ms"] == "1.00"  # 3.35 GB at 3.35 TB/s
    assert row["matmul floor ms"] == f"{1000 * 2 * 8e9 * 32 * 8 / (2 * 989e12):.2f}"
    assert row["cached (or full) / the larger floor"] == f"{2.0 / (1000 * 2 * 8e9 * 32 * 8 / (2 * 989e12)):.2f}x"
