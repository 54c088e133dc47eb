"""The packaged lm-eval tasks (eval/lm_eval_tasks: the synthetic suite as generate_until and as multiple_choice) run
offline through lm-eval's own command line, and a task whose dataset cannot be fetched is one error line."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT

import dllm
from dllm.eval.harness import evaluate
from dllm.eval.lm_eval_model import TASKS
from dllm.eval.synthetic import make_split

OFFLINE = {**os.environ, "DLLM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
LM_EVAL = [sys.executable, "-m", "dllm.eval.lm_eval_model", "--model", "dllm", "--device", "cpu"]


def test_the_documents_are_the_held_out_split():
    spec = importlib.util.spec_from_file_location("docs", TASKS / "docs.py")
    docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(docs)
    held_out = {ex.prompt: ex for ex in make_split("test")}
    generation = docs.generation()["test"]
    assert len(generation) == len(held_out) and [d["family"] for d in generation.select(range(5))] == \
        ["copy", "reverse", "sort", "count", "add"]  # interleaved: --limit keeps every family
    assert all(held_out[d["prompt"]].final_answer == d["target"] for d in generation)
    choice = docs.multiple_choice()["test"]
    assert all(held_out[d["prompt"]].answer == d["choices"][d["gold"]] and len(set(d["choices"])) == 4
               for d in choice)
    assert [d["gold"] for d in choice.select(range(0, 40, 5))] == [0, 1, 2, 3, 0, 1, 2, 3]  # no position wins alone


def scores(stdout: str) -> dict[str, float]:
    """task -> value of lm-eval's results table."""
    rows = [[c.strip() for c in line.split("|")] for line in stdout.splitlines() if line.startswith("|dllm_")]
    return {row[1]: float(row[7]) for row in rows}


def test_the_packaged_tasks_run_offline_on_the_tiny_model():
    """Offline, in seconds, named as lm-eval's HF models are (`pretrained=`, README's line); the generation task
    scores what `dllm eval --task synthetic` scores on those items."""
    pytest.importorskip("lm_eval")
    run = subprocess.run(LM_EVAL + ["--model_args", "pretrained=tiny-llada,sampler=threshold,cache=dual,mc_num=8,"
                                    "greedy_check=false", "--tasks", "dllm_synthetic,dllm_synthetic_mc",
                                    "--include_path", str(TASKS), "--apply_chat_template", "--limit", "5"],
                         cwd=ROOT, env=OFFLINE, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    ours = evaluate(*dllm.load("tiny-llada"), "synthetic", "threshold", "dual", limit=5, batch_size=1)
    assert scores(run.stdout) == {"dllm_synthetic": ours["accuracy"], "dllm_synthetic_mc": 1.0}, run.stdout
    assert "note:" not in run.stderr  # the chat template makes every prompt one the model was trained on


def test_a_dataset_that_cannot_be_fetched_is_one_error_line():
    pytest.importorskip("lm_eval")
    run = subprocess.run(LM_EVAL + ["--model_args", "model=tiny-llada", "--tasks", "gsm8k", "--limit", "1"],
                         cwd=ROOT, env=OFFLINE, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert re.match(r"error: lm-eval could not load a task's dataset \(Couldn't reach 'openai/gsm8k' on the Hub .*"
                    r"--include_path \S+lm_eval_tasks --tasks dllm_synthetic,dllm_synthetic_mc", last), last
