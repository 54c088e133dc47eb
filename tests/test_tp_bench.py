"""`dllm bench --tensor-parallel` and the meta shards of scripts/tp_memory.py: counted bytes equal their closed forms
from the layer plan (`models/sharding.py`); no timing assertions."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dllm.cli import main
from dllm.core.errors import DllmError
from dllm.engine.bench import shard_memory
from dllm.models import PRESETS
from dllm.models.loading import load, meta_model


def test_a_meta_shard_holds_the_layer_plans_share_of_every_tensor():
    """llada-tiny over 2 ranks: half the vocabulary rows of the embedding and head, half the heads of q, k, v (and
    o_proj's columns), half the feed-forward width; norms and the model's buffers (RoPE) on every rank."""
    cfg = PRESETS["llada-tiny"]
    d, f, V, head = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.n_heads // 2 * head, cfg.n_kv_heads // 2 * head
    layer = d + (q + 2 * kv) * d + d * q + d + 2 * (f // 2) * d + d * (f // 2)  # norm, qkv, o, norm, gate_up, down
    params = 2 * (V // 2) * d + d + cfg.n_layers * layer  # embedding, head, final norm, layers
    buffers = sum(b.numel() * b.element_size() for b in meta_model(cfg, torch.bfloat16).buffers())
    kv_per_token = 2 * cfg.n_layers * kv * 2
    assert shard_memory(cfg, 2) == [{"weight_bytes": 2 * params + buffers, "kv_bytes_per_token": kv_per_token}] * 2
    whole = shard_memory(cfg, 1)[0]
    assert whole["kv_bytes_per_token"] == 2 * kv_per_token and whole["weight_bytes"] > 2 * params + buffers


def test_fewer_key_value_heads_than_ranks_are_held_whole_and_a_split_that_does_not_divide_is_refused():
    """dream-tiny's 2 key/value heads over 4 ranks: each rank keeps the one its query heads read, so its K/V bytes
    per token are those of 2 ranks; llada-tiny's 4 attention heads refuse 8 ranks, with the reason."""
    cfg = PRESETS["dream-tiny"]
    assert cfg.n_kv_heads == 2
    assert {s["kv_bytes_per_token"] for s in shard_memory(cfg, 4)} == {shard_memory(cfg, 2)[0]["kv_bytes_per_token"]}
    with pytest.raises(DllmError, match="its 4 attention heads do not split evenly over 8 ranks"):
        shard_memory(PRESETS["llada-tiny"], 8)


@pytest.mark.distributed
def test_bench_counts_each_steps_collectives_and_bytes_from_the_layer_plan(capsys, tmp_path):
    """tiny-llada, no cache, over 2 ranks: per step one embedding all-reduce and two per layer (o_proj, down), each of
    the whole canvas's hidden states; the same forwards and rows as one rank, half its K/V bytes per token, and rank
    0's weights those of its meta shard. (A process of its own: this one may hold other ranks.) Its JSON line is a
    row of scripts/gpu_bench.sh's tensor-parallel table."""
    flags = ["bench", "--model", "tiny-llada", "--cache", "none", "--gen-length", "16", "--block-length", "8",
             "--prompt-length", "8", "--repeats", "1", "--batch-size", "2", "--threads", "1", "--json"]
    assert main(flags) == 0
    one = json.loads(capsys.readouterr().out)
    run = subprocess.run([sys.executable, "-m", "dllm.cli", *flags, "--tensor-parallel", "2"], capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert run.returncode == 0, run.stderr
    two = json.loads(run.stdout)
    cfg = load("tiny-llada", weights=False)[0].config
    canvas = 2 * (8 + 16) * cfg.hidden_size * 4  # batch 2, prompt + answer rows, float32
    traffic = two["traffic_per_step"]
    assert traffic["layer"] == {"collectives": 2 * cfg.n_layers, "bytes": 2 * cfg.n_layers * canvas}
    assert traffic["embedding"] == {"collectives": 1, "bytes": canvas}
    assert traffic["sampler"]["collectives"] > 0 and one["traffic_per_step"] == {}
    assert (two["nfe"], two["rows_per_token"]) == (one["nfe"], one["rows_per_token"])
    assert two["config"]["tensor_parallel"] == 2
    assert 2 * two["model"]["kv_bytes_per_token"] == one["model"]["kv_bytes_per_token"]
    assert two["model"]["weight_bytes"] == shard_memory(cfg, 2, torch.float32)[0]["weight_bytes"]

    (tmp_path / "tp").mkdir()
    (tmp_path / "tp" / "tiny.jsonl").write_text(json.dumps(two) + "\n")
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_bench.sh"
    env = {**os.environ, "MODEL": "", "SDAR_MODEL": "", "LLADA2_MODEL": "", "WEDLM_MODEL": "", "SERVE_MODEL": "",
           "TP_MODELS": "", "OUT": str(tmp_path)}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True).stdout
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ")]
    row = dict(zip(rows[0], rows[1]))
    assert (row["model"], row["cache"], row["N"], row["batch"]) == ("llada", "none", "2", "2")
    assert float(row["collectives per step"]) == pytest.approx(sum(t["collectives"] for t in traffic.values()), abs=0.05)
    assert row["of which layer MB"] == f"{2 * cfg.n_layers * canvas / 2**20:.2f}"
