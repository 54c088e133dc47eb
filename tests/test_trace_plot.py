"""The decoding order read from trace files (`dllm.engine.trace`) and `dllm trace plot`, on real decodes."""
from __future__ import annotations

import json

import pytest

import dllm
from dllm.cli import main
from dllm.engine.trace import read_trace, trace_lines

PROMPTS = ["reverse: abc12", "sort: 42,07,19,03", "add: 0457+0168", "copy: k3x9a"]


def traced(tmp_path, model, tok, name: str, **params):
    out = dllm.generate(model, tok, PROMPTS, trace=True, **params)
    path = tmp_path / f"{name}.jsonl"
    path.write_text(trace_lines(out, model.config.mask_id))
    return out, read_trace(path)


def test_low_confidence_commits_one_position_per_step(tmp_path, tiny_llada):
    """steps = gen_length: every answer position is committed exactly once, one a step, in the answer's span."""
    out, rows = traced(tmp_path, *tiny_llada, "lc", sampler="low_confidence", gen_length=32, block_length=16,
                       steps=32, stop_early=False)
    assert len(rows) == len(PROMPTS)
    for row in rows:
        assert row.length == 32 and row.sampler == "low_confidence" and row.cache == "none"
        assert sorted(row.committed) == list(range(32))
        assert sorted(row.committed.values()) == list(range(1, 33))
        assert max(p for p, s in row.committed.items() if s <= 16) < 16  # the first block before the second
        assert not row.taken_back and not row.rewritten
        assert row.forwards == out.stats.nfe == 32


def test_a_streamed_answer_traces_as_generate_does(tmp_path, tiny_llada):
    """`stream`'s generation names its answer's span as `generate`'s does, so its trace reads back the same."""
    model, tok = tiny_llada
    s = dllm.stream(model, tok, PROMPTS[0], sampler="threshold", gen_length=32, block_length=16, trace=True)
    "".join(s)
    out = dllm.generate(model, tok, PROMPTS[:1], sampler="threshold", gen_length=32, block_length=16, trace=True)
    assert s.generation.answer_spans == out.answer_spans and s.generation.canvas_ids == out.canvas_ids
    assert trace_lines(s.generation, model.config.mask_id) == trace_lines(out, model.config.mask_id)


def test_threshold_commits_several_per_step_and_the_title_counts(tmp_path, tiny_llada):
    out, rows = traced(tmp_path, *tiny_llada, "th", sampler="threshold", threshold=0.5, gen_length=32,
                       block_length=16, stop_early=False)
    for row in rows:
        assert sorted(row.committed) == list(range(32))
        assert max(row.committed.values()) < 32  # fewer steps than positions
    assert rows[0].title == f"threshold · cache none · {out.stats.nfe} forwards · {out.stats.tpf:.2f} tokens/forward"


def test_wino_trace_shows_take_backs(tmp_path, tiny_llada):
    """WINO re-masks: a taken-back position is committed again at a later step, and every position ends committed."""
    out, rows = traced(tmp_path, *tiny_llada, "wino", sampler="wino", threshold=0.2, remask_threshold=0.9999,
                       gen_length=32, block_length=16, stop_early=False)
    taken = [(row, at, step) for row in rows for at, step in row.taken_back]
    assert taken
    for row, at, step in taken:
        assert row.committed[at] > step
    for row in rows:
        assert sorted(row.committed) == list(range(32))


def test_eval_trace_names_examples_and_plot_writes_a_png(tmp_path, monkeypatch, capsys):
    """`dllm eval --trace` keeps each example's row under its id; `dllm trace plot a b` draws both side by side."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name, sampler in (("a", "low_confidence"), ("b", "threshold")):
        assert main(["eval", "--task", "synthetic", "--limit", "3", "--batch-size", "2", "--sampler", sampler,
                     "--gen-length", "32", "--block-length", "16", "--trace", str(tmp_path / f"{name}.jsonl")]) == 0
    capsys.readouterr()
    lines = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    decodes = [line["decode"] for line in lines if "decode" in line]
    assert [len(d["rows"]) for d in decodes] == [2, 1]  # a decode per batch
    a, b = read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "b.jsonl")
    assert [r.id for r in a] == [r.id for r in b] and len({r.id for r in a}) == 3  # the same examples
    pytest.importorskip("matplotlib")
    assert main(["trace", "plot", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "-o",
                 str(tmp_path / "order.png")]) == 0
    assert (tmp_path / "order.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["trace", "plot", str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "order.xyz")]) == 2
    assert "Format 'xyz' is not supported" in capsys.readouterr().err


def test_plot_refuses_a_file_without_a_decode_line(tmp_path, capsys):
    (tmp_path / "old.jsonl").write_text(json.dumps({"block": 0, "step": 0, "commits": [[]]}) + "\n")
    assert main(["trace", "plot", str(tmp_path / "old.jsonl"), "-o", str(tmp_path / "o.png")]) == 2
    assert "starts without a decode line" in capsys.readouterr().err
    assert main(["trace", "plot", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.png")]) == 2
    assert "cannot read trace" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, capsys, monkeypatch, tiny_llada):
    traced(tmp_path, *tiny_llada, "lc", sampler="low_confidence", gen_length=32, block_length=16)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["trace", "plot", str(tmp_path / "lc.jsonl"), "-o", str(tmp_path / "o.png")]) == 2
    assert capsys.readouterr().err == "error: dllm trace plot draws with matplotlib; pip install 'dllm-fast[plot]'\n"
    assert not (tmp_path / "o.png").exists()
