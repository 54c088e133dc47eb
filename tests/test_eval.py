"""`dllm eval`: records, summary and resuming without repeating examples."""
import json

import dllm
from dllm.cli import main
from dllm.eval.harness import evaluate
from dllm.eval.synthetic import FAMILIES


def test_eval_writes_records_and_resumes(tmp_path, capsys):
    model, tok = dllm.load("random:llada-tiny")
    args = dict(gen_length=16, block_length=16, batch_size=4, output=tmp_path)
    full = evaluate(model, tok, "synthetic", limit=10, **args)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 10 and full["n"] == 10
    assert set(full["per_group_accuracy"]) == set(FAMILIES)  # --limit keeps every family
    assert full["nfe_mean"] == 16 and abs(full["tpf"] - 1.0) < 1e-9
    # a run killed after 6 examples (plus half a line) resumes with the other 4 and loses nothing
    (tmp_path / "results.jsonl").write_text("\n".join(lines[:6]) + "\n" + lines[6][:20])
    resumed = evaluate(model, tok, "synthetic", limit=10, **args)
    records = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == [json.loads(x)["id"] for x in lines]
    assert [r["output"] for r in records] == [json.loads(x)["output"] for x in lines]
    assert resumed["accuracy"] == full["accuracy"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["sampler"]["name"] == "low_confidence" and summary["n"] == 10
    assert main(["eval", "--task", "gsm9k", "--model", "random:llada-tiny"]) == 2
    assert "unknown task 'gsm9k'" in capsys.readouterr().err


def test_a_higher_limit_redoes_the_short_last_batch(tmp_path):
    """limit 10 at batch 4 ends in a batch of 2; limit 12 decodes items 8-11 as one batch of 4, so its records equal
    those of a fresh run at limit 12 (tokens per forward depends on the batch a row shared)."""
    model, tok = dllm.load("tiny-llada")
    args = dict(sampler="threshold", sampler_args={"threshold": 0.5}, batch_size=4)
    evaluate(model, tok, "synthetic", limit=10, output=tmp_path / "resumed", **args)
    resumed = evaluate(model, tok, "synthetic", limit=12, output=tmp_path / "resumed", **args)
    fresh = evaluate(model, tok, "synthetic", limit=12, output=tmp_path / "fresh", **args)
    assert resumed["tpf"] == fresh["tpf"] and resumed["nfe_mean"] == fresh["nfe_mean"]
    read = lambda d: [{k: v for k, v in json.loads(x).items() if k != "seconds"}  # noqa: E731
                      for x in (tmp_path / d / "results.jsonl").read_text().splitlines()]
    assert read("resumed") == read("fresh")
