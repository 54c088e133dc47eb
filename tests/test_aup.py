"""AUP (d3LLM) values, the Pareto front and the sweep command."""
import json

import pytest

from dllm.cli import main
from dllm.core.errors import DllmError
from dllm.eval.sweep import aup, pareto_front, parse_point


def test_aup_reference_value():
    assert aup([(1.0, 74.02), (9.11, 73.09)], y_max=74.98) == pytest.approx(637.7, abs=0.5)
    assert aup([(9.11, 73.09), (1.0, 74.02)], y_max=74.98) == pytest.approx(637.7, abs=0.5)  # order-free


def test_aup_single_point_and_dropped_points():
    assert aup([(1.0, 61.5)]) == pytest.approx(61.5)
    # a point more than 5 accuracy points below the first one adds nothing
    assert aup([(1.0, 70.0), (4.0, 64.0)]) == pytest.approx(70.0)
    # y_max defaults to the best accuracy; a higher y_max weighs every point down
    points = [(1.0, 70.0), (3.0, 68.0)]
    assert aup(points) == pytest.approx(aup(points, y_max=70.0))
    assert aup(points, y_max=80.0) < aup(points)
    with pytest.raises(DllmError):
        aup([])


def test_pareto_front_and_point_syntax():
    rows = [{"point": "a", "tpf": 1.0, "accuracy": 70.0}, {"point": "b", "tpf": 2.0, "accuracy": 69.0},
            {"point": "c", "tpf": 1.5, "accuracy": 60.0}]
    assert [r["point"] for r in pareto_front(rows)] == ["a", "b"]
    assert parse_point("sampler=threshold, threshold=0.9") == {"sampler": "threshold", "threshold": "0.9"}
    with pytest.raises(DllmError, match="KEY=VALUE"):
        parse_point("threshold")


def test_sweep_command_writes_table_aup_and_plot(tmp_path, capsys):
    args = ["eval", "--task", "synthetic", "--model", "random:llada-tiny", "--gen-length", "8", "--block-length",
            "8", "--limit", "5", "--batch-size", "5", "--output", str(tmp_path)]
    assert main(args + ["--sweep", "sampler=low_confidence", "--sweep", "sampler=threshold,threshold=0.01"]) == 0
    result = json.loads((tmp_path / "sweep.json").read_text())
    by_point = {r["point"]: r for r in result["points"]}
    assert by_point["sampler=low_confidence"]["tpf"] == pytest.approx(1.0)
    assert by_point["sampler=threshold,threshold=0.01"]["tpf"] == pytest.approx(8.0)  # commits all 8 at once
    assert result["aup"] == pytest.approx(aup([(r["tpf"], r["accuracy"]) for r in result["points"]]))
    assert "AUP (synthetic)" in capsys.readouterr().out
    assert (tmp_path / "sampler-low_confidence" / "results.jsonl").exists()
    assert main(args[:-2] + ["--sweep", "sampler=low_confidence"]) == 2
    assert "--sweep needs --output" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    assert (tmp_path / "pareto.png").stat().st_size > 0


def test_a_bad_sweep_point_stops_before_the_first_is_evaluated(tmp_path, capsys):
    args = ["eval", "--task", "synthetic", "--model", "random:llada-tiny", "--gen-length", "8", "--block-length",
            "8", "--limit", "2", "--output", str(tmp_path)]
    for bad, message in [("sampler=nope", "unknown sampler 'nope'"),
                         ("sampler=low_confidence,cache=dkv_greedy", "needs a sampler whose next commits")]:
        assert main(args + ["--sweep", "sampler=threshold", "--sweep", bad]) == 2
        assert message in capsys.readouterr().err
        assert not list(tmp_path.iterdir())  # nothing evaluated


def test_sweep_without_matplotlib_says_how_to_get_the_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import matplotlib raises ImportError
    args = ["eval", "--task", "synthetic", "--model", "random:llada-tiny", "--gen-length", "8", "--block-length",
            "8", "--limit", "2", "--batch-size", "2", "--output", str(tmp_path), "--sweep", "sampler=low_confidence"]
    assert main(args) == 0
    assert "pareto.png not drawn: matplotlib is missing; pip install 'dllm-fast[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "pareto.png").exists()


def test_an_interrupted_sweep_counts_the_records_of_its_points(tmp_path):
    from dllm.eval.harness import count_records
    for point, n in (("sampler-threshold", 3), ("sampler-low_confidence", 2)):
        (tmp_path / point).mkdir()
        (tmp_path / point / "results.jsonl").write_text("".join(json.dumps({"id": str(i)}) + "\n" for i in range(n)))
    assert (count_records(tmp_path), count_records(tmp_path, sweep=True)) == (0, 5)


def test_a_sweep_notes_no_prompt_of_its_own(tmp_path):
    """The sweep's warm-up decode is no user's prompt: a sweep of prompts in tiny-llada's formats notes nothing
    (it said "'<|endoftext|>' ... is outside the prompts this model was trained on")."""
    import warnings

    from dllm.core.errors import DllmNotice
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert main(["eval", "--task", "synthetic", "--model", "tiny-llada", "--gen-length", "8", "--block-length", "8",
                     "--limit", "2", "--batch-size", "2", "--output", str(tmp_path),
                     "--sweep", "sampler=low_confidence"]) == 0
    assert [str(w.message) for w in said if issubclass(w.category, DllmNotice)] == []
