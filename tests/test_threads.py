"""The CPU thread count: one thread for a small model, the physical cores for a large one, and the caller's
`threads=`/`--threads`, DLLM_THREADS or OMP_NUM_THREADS over both; said in --json and summary.json."""
import json

import pytest
import torch

import dllm
from dllm.cli import main
from dllm.core.errors import DllmError
from dllm.eval.harness import evaluate
from dllm.models import PRESETS, DiffusionLM
from dllm.models import threads as threads_mod
from dllm.models.threads import physical_cores, requested_threads, set_threads


@pytest.fixture(autouse=True)
def _threads_restored(monkeypatch):
    """No thread variable from the caller's shell; torch's count as it was afterwards."""
    monkeypatch.delenv("DLLM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_tiny_model_runs_on_one_thread():
    torch.set_num_threads(2)
    model, _ = dllm.load("tiny-llada")
    assert torch.get_num_threads() == 1
    assert model.threads == {"threads": 1, "chosen_by": "1.29M parameters: one thread"}
    assert dllm.load("random:dream-tiny")[0].threads["threads"] == 1


def test_a_large_model_runs_on_the_physical_cores(monkeypatch):
    monkeypatch.setattr(threads_mod, "physical_cores", lambda: 3)
    with torch.device("meta"):  # the 8B shape without its memory
        model = DiffusionLM(PRESETS["llada-8b"])
    assert set_threads(model, None) == {"threads": 3, "chosen_by": "8016M parameters: the physical cores"}
    assert torch.get_num_threads() == 3


def test_physical_cores_count_hyperthreads_once(tmp_path, monkeypatch):
    """Four logical CPUs, two per core (as sysfs lists the siblings of each), are two cores."""
    for cpu, siblings in enumerate(["0-1", "0-1", "2-3", "2-3"]):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(siblings + "\n")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert physical_cores(tmp_path) == 2
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {2})  # pinned to one CPU (taskset)
    assert physical_cores(tmp_path) == 1


def test_the_callers_number_wins_over_the_variables_and_the_default(monkeypatch):
    assert requested_threads() is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert requested_threads() == (3, "OMP_NUM_THREADS")
    monkeypatch.setenv("DLLM_THREADS", "2")
    assert requested_threads() == (2, "DLLM_THREADS")
    model, _ = dllm.load("tiny-llada", threads=4)
    assert model.threads == {"threads": 4, "chosen_by": "threads= (--threads)"} and torch.get_num_threads() == 4


@pytest.mark.parametrize("env,threads,message", [
    ({"DLLM_THREADS": "two"}, None, "DLLM_THREADS must be a positive integer, got 'two'; set it to a thread count"),
    ({"OMP_NUM_THREADS": "0"}, None, "OMP_NUM_THREADS must be a positive integer, got '0'"),
    ({}, 0, "threads must be at least 1, got 0"),
    ({}, 1.5, "threads must be an integer, got 1.5"),
])
def test_bad_thread_counts_are_one_line_errors(monkeypatch, env, threads, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(DllmError, match=message):
        dllm.load("tiny-llada", threads=threads)


def test_the_choice_is_in_json_and_summary(capsys, tmp_path, monkeypatch):
    assert main(["generate", "copy: abcd", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["threads"] == {"threads": 1, "chosen_by": "1.29M parameters: one thread"}
    monkeypatch.setenv("DLLM_THREADS", "2")
    assert main(["generate", "copy: abcd", "--json", "--threads", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["threads"] == {"threads": 1, "chosen_by": "threads= (--threads)"}
    monkeypatch.delenv("DLLM_THREADS")
    evaluate(*dllm.load("random:llada-tiny"), "synthetic", gen_length=8, block_length=8, limit=2, output=tmp_path)
    environment = json.loads((tmp_path / "summary.json").read_text())["environment"]
    assert environment["cpu_threads"] == 1 and environment["cpu_threads_chosen_by"].endswith("one thread")
    assert main(["generate", "copy: abcd", "--threads", "0"]) == 2
    assert capsys.readouterr().err == "error: threads must be at least 1, got 0\n"
