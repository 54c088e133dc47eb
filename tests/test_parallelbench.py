"""ParallelBench in `dllm eval`: the metrics on hand-made answers (expected values as the authors' metrics give
them, spec parallelbench.md section 8), the loader on our own fixture checkout in the upstream schema
(tests/data/parallelbench: hand-written records and templates, none of the benchmark's), and the 17 tasks and the
suites run end to end on a random tiny model."""
import json
from pathlib import Path

import pytest

from dllm.cli import main
from dllm.core.errors import DllmError
from dllm.eval import parallelbench as pb
from dllm.eval.harness import count_records, evaluate
from dllm.eval.sweep import aup, pb_scores
from dllm.eval.tasks import SUITES, TASKS

FIXTURE = Path(__file__).parent / "data" / "parallelbench"
MODEL = ["--model", "random:llada-tiny"]  # tiny-llada's character set has no quotes or brackets


def headline(metric: str, text: str, answer) -> float:
    return next(iter(pb.score(metric, text, answer).values()))[1]


def strict(metric: str, text: str, answer) -> float:
    return pb.score(metric, text, answer)["score_strict"][1]


def test_list_parsing_and_the_list_metrics():
    ref = '["A B", "C D"]'
    assert headline("list_match_score", 'Sure! ["A B", "C D"]', ref) == 1.0
    assert headline("list_match_score", "A B,C D", ref) == 1.0  # no brackets, no spaces: still the list
    assert strict("list_match_score", '["A B","C D"]', ref) == 0.0  # strict wants '", "' between quoted items
    assert strict("list_match_score", '["A B", "C D"]', ref) == 1.0
    assert pb.parse_list('["A", ""]') == ["A", ""] and pb.parse_list('x ["A", "B"]. ["C"]') == ["C"]  # the last list
    assert pb.parse_list('["A", "B"', strict=True) is None and pb.parse_list('["A", "B\"C"]', strict=True) is None
    given = {"input": ["A", "B", "C"]}
    assert headline("list_shuffle_score", '["B", "C", "A"]', given) == 1.0
    assert headline("list_shuffle_score", '["A", "B", "C"]', given) == 0.0  # the identity is no shuffle
    assert headline("list_shuffle_score", '["A", "A", "C"]', given) == 0.0  # a duplicate
    word = {"input": ["A", "B", "C"], "word": "F"}
    assert headline("list_random_replace_score", '["A", "F", "C"]', word) == 1.0
    assert headline("list_random_replace_score", '["A", "B", "C"]', word) == 0.0  # unchanged
    assert headline("list_random_replace_score", '["F", "F", "C"]', word) == 0.0  # two F's
    assert headline("list_random_insert_score", '["A", "F", "B", "C"]', word) == 1.0
    assert headline("list_random_insert_score", '["B", "F", "A", "C"]', word) == 0.0  # the others reordered
    assert headline("list_random_remove_score", '["A", "C"]', given) == 1.0
    assert headline("list_random_remove_score", '["C", "A"]', given) == 0.0  # right length, reordered


def test_puzzle_metrics():
    ab = {"symbols": ["A", "B"]}
    assert headline("latin_square_score", "A,B\nB,A", ab) == 1.0
    assert headline("latin_square_score", "Here it is:\nA,B\nB,A", ab) == 1.0  # a junk line is skipped
    assert headline("latin_square_score", "A,B\nA,B", ab) == 0.0
    assert headline("latin_square_score", "A,B,A\nB,A,B", ab) == 1.0  # the authors' laxness, kept
    solution = "1342\n2431\n4123\n3214"
    assert headline("sudoku_score", "1 3 4 2\n2,4,3,1\n4123\n3214", solution) == 1.0
    assert strict("sudoku_score", "1 3 4 2\n2,4,3,1\n4123\n3214", solution) == 0.0
    assert headline("sudoku_score", "Output:\n" + solution, solution) == 1.0
    assert headline("sudoku_score", solution.replace("1342", "1324"), solution) == 0.0


def test_text_metrics_offline():
    words = {"words": ["dog", "throw"]}
    assert pb.score("sentence_to_words_score", "I throwing the dog.", words)["inclusion"][1] == 1.0
    assert pb.score("sentence_to_words_score", "I throw the Dog.", words)["inclusion"][1] == 0.0  # case-sensitive
    assert pb.bleu("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    assert pb.bleu("the cat sat down", "a cat sat on a mat") == 0.0  # no shared 4-gram, no smoothing
    # 13a splits punctuation off but not an apostrophe, a decimal point or a thousands comma
    assert pb.tokenize_13a("It's 3.5, ok... 1,000") == ["It's", "3.5", ",", "ok", ".", ".", ".", "1,000"]
    # 7 tokens each: 1- to 4-gram precisions 6/7, 5/6, 4/5, 3/4, no brevity penalty
    assert pb.bleu("the cat sat on the mat .", "the cat sat on the mat !") == pytest.approx(
        (6 / 7 * 5 / 6 * 4 / 5 * 3 / 4) ** 0.25)
    sacrebleu = pytest.importorskip("sacrebleu")  # the reference implementation, where installed
    for candidate, reference in [("Can you identify this sweater, please?", "Any idea of what sweater this is?"),
                                 ("a b c d e", "a b c d e f g h"), ('He said: "x-y" & 10-4.', 'He said "x-y" 10-4')]:
        expected = sacrebleu.corpus_bleu([candidate], [[reference]], smooth_method="none").score / 100
        assert pb.bleu(candidate, reference) == pytest.approx(expected)


def test_rouge():
    pytest.importorskip("rouge_score")
    # LCS of "the cat was found under the bed" and "the cat was under the bed" is 6 tokens: P = 6/7, R = 1
    rouge = pb.rouge("the cat was found under the bed", "the cat was under the bed")
    assert rouge["rougeL"] == pytest.approx(2 * (6 / 7) / (6 / 7 + 1))


def test_missing_tools_are_unavailable_never_zero(monkeypatch):
    monkeypatch.delenv(pb.LANGUAGETOOL_ENV, raising=False)
    monkeypatch.delenv(pb.BERTSCORE_ENV, raising=False)
    pb._language_tool.cache_clear(), pb._bert_scorer.cache_clear()
    scores = pb.score("paraphrase_score", "A dog ran far away.", {"text": "The dog ran away."})
    assert list(scores)[0] == "inv_bleu" and scores["inv_bleu"][1] == 1.0
    assert scores["grammar"][1] is None and scores["bertscore"][1] is None and scores["score"][1] is None
    # with a grammar checker the headline is the grammar score, as the paper's figures plot it
    monkeypatch.setattr(pb, "_language_tool", lambda: type("Tool", (), {"check": lambda self, t: ["x"] * ("  " in t)})())
    scores = pb.score("summary_score", "Ann meets Bo.", {"summary": "Ann and Bo meet."})
    assert list(scores)[0] == "grammar" and scores["grammar"][1] == 1.0
    assert pb.score("summary_score", "Ann  meets Bo.", {"summary": "Ann and Bo meet."})["grammar"][1] == 0.0


def test_the_loader_renders_the_authors_turns():
    config, rows, _ = pb.load_task("waiting_line/insert_index", FIXTURE)
    items, source = TASKS["parallelbench/waiting_line/insert_index"].load(str(FIXTURE), 1)
    first = next(it for it in items if it.id.endswith("-0"))
    example = rows[0]["input"]["icl_examples"][0]
    assert [role for role, _ in first.messages] == ["user", "assistant", "user"]
    assert first.messages[0][1] == config["prompt"].format(**example["input"])
    assert first.messages[1][1] == example["answer"]
    assert first.messages[2][1] == first.prompt == config["prompt"].format(**rows[0]["input"])
    # a dict answer's one-shot turn is its `example`; a literal backslash-n of a template becomes a newline
    items, _ = TASKS["parallelbench/puzzle/sudoku_n4_12"].load(str(FIXTURE), 1)
    assert "\\n" in pb.load_task("puzzle/sudoku_n4_12", FIXTURE)[0]["prompt"]
    assert "\\n" not in items[0].prompt and "\nGrid:\n0042\n2031\n4023\n3214\n" in items[0].prompt
    items, _ = TASKS["parallelbench/waiting_line/shuffle"].load(str(FIXTURE), 0)
    assert len(items[0].messages) == 1  # --num-fewshot 0
    # rows interleaved over list lengths, ids keep the line numbers, so that --limit covers every length
    items, _ = TASKS["parallelbench/waiting_line/copy"].load(str(FIXTURE), 1)
    assert [(it.id, it.group) for it in items] == [("waiting_line/copy-0", "n=3"), ("waiting_line/copy-2", "n=4"),
                                                   ("waiting_line/copy-1", "n=3"), ("waiting_line/copy-3", "n=4")]


def test_where_the_data_comes_from(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(pb.DATA_ENV, raising=False)
    assert main(["eval", "--task", "parallelbench/waiting_line/copy", "--gold"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and "github.com/furiosa-ai/ParallelBench" in err
    assert "--data" in err and pb.DATA_ENV in err
    assert main(["eval", "--task", "parallelbench/waiting_line/copy", "--gold", "--data", str(tmp_path)]) == 2
    assert "holds no <group>/task_config.yaml" in capsys.readouterr().err
    clone = tmp_path / "clone"
    (clone / pb.CLONE_SUBDIR).parent.mkdir(parents=True)
    (clone / pb.CLONE_SUBDIR).symlink_to(FIXTURE)
    monkeypatch.setenv(pb.DATA_ENV, str(clone))
    assert main(["eval", "--task", "parallelbench/puzzle/sudoku_n4_12", "--gold"]) == 0
    with pytest.raises(DllmError, match="--num-fewshot 0 or 1"):
        TASKS["parallelbench/puzzle/sudoku_n4_12"].load(str(FIXTURE), 2)
    assert main(["eval", "--task", "parallelbench/nope", "--gold"]) == 2
    assert "unknown task" in capsys.readouterr().err


def test_gold_scores_every_deterministic_reference(tmp_path):
    for suite in ("parallelbench/waiting_line", "parallelbench/puzzles"):
        summary = evaluate(None, None, suite, gold=True, data=FIXTURE, output=tmp_path / suite)
        assert summary["suite_score"] == 1.0 and set(summary["task_scores"]) == set(SUITES[suite])
        for task in SUITES[suite]:
            one = json.loads((tmp_path / suite / task.partition("/")[2] / "summary.json").read_text())
            assert one["accuracy_by_metric"]["score_strict"] == 1.0
    copy = json.loads((tmp_path / "parallelbench/waiting_line/waiting_line/copy/summary.json").read_text())
    assert copy["per_group_accuracy"] == {"n=3": 1.0, "n=4": 1.0}


def test_all_17_tasks_run_and_the_suite_summary(tmp_path, capsys):
    out = tmp_path / "all"
    assert main(["eval", "--task", "parallelbench", *MODEL, "--data", str(FIXTURE), "--limit", "1",
                 "--batch-size", "1", "--steps", "16", "--output", str(out)]) == 0
    assert "not computed (their tools are not set up): bertscore, grammar, score" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["task_scores"]) == [f"parallelbench/{t}" for t in pb.TASK_IDS] and len(pb.TASK_IDS) == 17
    tasks = {t: json.loads((out / t.partition("/")[2] / "summary.json").read_text()) for t in summary["task_scores"]}
    assert summary["suite_score"] == pytest.approx(sum(s["accuracy"] for s in tasks.values()) / 17)
    for task, s in tasks.items():
        gen = s["config"]["gen_length"]
        assert gen == (32 if "waiting_line" in task else 64) and s["config"]["block_length"] == gen
        assert s["config"]["stop_early"] is False and s["nfe_mean"] == 16  # every step decoded: k = gen / 16
        assert s["tps_canvas"] == pytest.approx(gen / s["nfe_mean"])
        assert s["tps_canvas"] >= s["tpf"] - 1e-9  # filler after a finished answer is not counted by tpf
        assert s["accuracy_by_metric"].get("grammar") is None  # never a 0 for a tool that did not run
    assert summary["suite_tps"] == pytest.approx(sum(s["tps_canvas"] for s in tasks.values()) / 17)
    assert tasks["parallelbench/paraphrase_summarize/samsum"]["metrics_unavailable"] == ["grammar", "score"]
    assert count_records(out) == 17  # what an interrupted suite says it kept


def test_pb_scores_take_the_most_tokens_per_step_without_interpolation():
    points = [(1.0, 95.0), (2.0, 85.0), (4.0, 79.9), (8.0, 81.0), (16.0, 20.0)]
    assert pb_scores(points) == {"PB90": 1.0, "PB80": 8.0, "PB70": 8.0, "PB60": 8.0}
    assert pb_scores([(1.0, 50.0)]) == {"PB90": None, "PB80": None, "PB70": None, "PB60": None}


def test_a_sweep_over_steps_and_block_length_draws_score_against_tokens_per_step(tmp_path, capsys):
    # a random model's paraphrases share no 4-gram with the source: 1 - BLEU = 1 at every point, so PB-x is the
    # most tokens per step of the sweep
    points = ["sampler=random,steps=64", "sampler=random,steps=16", "sampler=low_confidence,steps=16,block_length=8",
              "sampler=threshold,threshold=0.001"]
    args = ["eval", "--task", "parallelbench/paraphrase_summarize/chatgpt-paraphrases", *MODEL, "--data",
            str(FIXTURE), "--limit", "2", "--batch-size", "2", "--output", str(tmp_path)]
    assert main(args + [arg for p in points for arg in ("--sweep", p)]) == 0
    result = json.loads((tmp_path / "sweep.json").read_text())
    rows = {r["point"]: r for r in result["points"]}
    assert [rows[p]["tps_canvas"] for p in points[:3]] == [1.0, 4.0, 4.0]  # gen 64 over the forwards, k = 64/steps
    assert rows[points[2]]["nfe_mean"] == 16  # 8 blocks of 2 steps
    assert rows[points[3]]["tps_canvas"] == 64.0  # everything at the first step
    assert all(r["accuracy"] == 100.0 for r in rows.values())
    assert result["axis"] == "tps_canvas" and result["pb"] == {f"PB{x}": 64.0 for x in (90, 80, 70, 60)}
    assert result["aup"] == pytest.approx(aup([(r["tps_canvas"], r["accuracy"]) for r in result["points"]]))
    out = capsys.readouterr().out
    assert "| tokens/step |" in out and "PB80 64.00" in out and "over tokens per step" in out
    assert main(args[:-1] + [str(tmp_path / "bad"), "--sweep", "steps=many"]) == 2
    assert "steps takes a whole number, got 'many'" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    assert (tmp_path / "pareto.png").stat().st_size > 0  # one curve per sampler


def test_list_families_for_a_tiny_parallelbench_model():
    """ParallelBench's waiting-line operations on letters (eval/synthetic.py `LIST_FAMILIES`): every drawn target is
    a right answer, the checker takes the other right answers and refuses the near misses."""
    import re

    from dllm.eval import synthetic

    assert synthetic.FAMILIES == ("copy", "reverse", "sort", "count", "add")  # the shipped models' suite unchanged
    for family in synthetic.LIST_FAMILIES:
        for ex in synthetic.make_split("train", 100, families=[family]):
            items = ex.prompt.partition(": ")[2].split(",")
            assert re.fullmatch(synthetic.PROMPT_FORMATS[family], ex.prompt) and 3 <= len(set(items)) == len(items) <= 8
            assert synthetic.score(ex, ex.answer), ex
    ok = synthetic.list_answer_ok
    assert ok("shuffle: a,b,c", "c,a,b") and not ok("shuffle: a,b,c", "a,b,c") and not ok("shuffle: a,b,c", "a,a,c")
    assert ok("replace any with x: a,b,c", "a,b,x") and not ok("replace any with x: a,b,c", "x,x,c")
    assert not ok("replace any with x: a,b,c", "a,b,c")
    assert ok("replace 1 with x: a,b,c", "a,x,c") and not ok("replace 1 with x: a,b,c", "x,b,c")
    assert ok("insert x: a,b,c", "x,a,b,c") and ok("insert x: a,b,c", "a,b,c,x") and not ok("insert x: a,b,c", "b,x,a,c")
    assert ok("remove any: a,b,c", "a,c") and not ok("remove any: a,b,c", "c,a")
    assert ok("sort list: c,a,b", "a,b,c") and not ok("reverse list: c,a,b", "c,a,b")
    summary = evaluate(None, None, "synthetic_lists", gold=True, limit=16)
    assert summary["accuracy"] == 1.0 and set(summary["per_group_accuracy"]) == set(synthetic.LIST_FAMILIES)
