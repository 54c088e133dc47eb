"""Benchmarks: prompts (few-shot as in lm-eval / the LLaDA and Fast-dLLM evals), answer extraction, scoring.

Every task turns a generated text into named metrics `{name: (extracted, correct)}`, the first one being the
task's accuracy. `gold` holds the dataset's own reference solution written as a model would write it, so
`--gold` checks extraction and execution without a model.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from functools import partial
from typing import Callable

from dllm.core.checks import choose_from
from dllm.core.errors import DllmError

from . import math_answers, parallelbench, sandbox, sources, synthetic

Scores = dict[str, tuple[str | None, bool | float | None]]  # float: a graded metric (ROUGE-L); None: unavailable


@dataclass(frozen=True)
class Item:
    id: str
    prompt: str
    reference: str  # the answer, or for code the tests that follow the program
    group: str  # per-group accuracy (synthetic family, MATH subject)
    gold: str  # the reference solution as model output
    setup: str = ""  # code that precedes the generated program (HumanEval's prompt, MBPP's imports)
    tested: tuple[str, ...] = ()  # the program's functions the tests call (code tasks), even one named like a builtin
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) turns when the prompt is a conversation


@dataclass(frozen=True)
class Task:
    load: Callable[[str | None, int], tuple[list[Item], str]]  # (data file, few-shot count) -> items, source
    score: Callable[..., Scores]  # (item, text) -> scores; with `runs_code`, also `unsafe_exec`
    default_fewshot: int = 0
    runs_code: bool = False  # scoring executes the generated program (in `sandbox`)
    gen_length: int | None = None  # the task's own answer length (block_length and steps default to it)
    stop_early: bool = True  # False: every block decoded, as the paper counts tokens per step (ParallelBench)

    def scorer(self, unsafe_exec: bool = False) -> Callable[[Item, str], Scores]:
        """`score` for one evaluation; a code task's programs run isolated unless `unsafe_exec`."""
        if not self.runs_code:
            return self.score
        sandbox.check(unsafe_exec)
        return partial(self.score, unsafe_exec=unsafe_exec)


def _cut(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to the first stop string."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(ends)] if ends else text


def _shots(rows: list[dict], k: int, task: str) -> list[dict]:
    if k > len(rows):
        raise DllmError(f"{task} has {len(rows)} few-shot examples; use --num-fewshot {len(rows)} or fewer")
    return rows[:k]


def _check_no_shots(task: str, k: int) -> None:
    if k:
        raise DllmError(f"{task} is evaluated zero-shot; use --num-fewshot 0")


# --- synthetic ---

def _synthetic_items(families: tuple[str, ...], data: str | None, k: int) -> tuple[list[Item], str]:
    """The held-out split, families interleaved so that `--limit` keeps every family."""
    if data is not None:
        raise DllmError("the synthetic task is generated, not read; drop --data")
    _check_no_shots("synthetic", k)
    per_family = {f: synthetic.make_split("test", families=[f]) for f in families}
    n = min(map(len, per_family.values()))
    items = [Item(f"{f}-{i}", per_family[f][i].prompt, per_family[f][i].final_answer, f, per_family[f][i].answer)
             for i in range(n) for f in families]
    return items, "generated:eval.synthetic"


def _synthetic_score(item: Item, text: str) -> Scores:
    answer = synthetic.extract_answer(text)
    return {"exact": (answer, answer == item.reference)}


def _synthetic_lists_score(item: Item, text: str) -> Scores:
    """Any right answer: a shuffle is any other order, a random replacement any one position."""
    answer = synthetic.extract_answer(text)
    return {"valid": (answer, answer is not None and synthetic.list_answer_ok(item.prompt, answer))}


# --- GSM8K: lm-eval's `gsm8k` task (5-shot from train, strict and flexible extraction) ---

GSM8K_STOPS = ("Question:", "</s>", "<|im_end|>")
_GSM8K_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_GSM8K_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_GSM8K_IGNORE = (re.compile(","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))  # in turn


def _gsm8k_question(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def _gsm8k_items(data: str | None, k: int) -> tuple[list[Item], str]:
    """Each question after its own k train examples, drawn as lm-eval's default sampler draws them: one
    random.Random(1234) over the whole train split, k per question in test order."""
    rows, source = sources.load("gsm8k-test", data)
    sources.require_fields(rows, ("question", "answer"), source)
    train, _ = sources.load("gsm8k-train") if k else ([], "")
    _shots(train, k, "gsm8k")
    draw = random.Random(1234)
    items = []
    for i, r in enumerate(rows):
        context = "".join(f"{_gsm8k_question(s['question'])} {s['answer']}\n\n" for s in draw.sample(train, k))
        items.append(Item(f"gsm8k-{i}", context + _gsm8k_question(r["question"]), r["answer"], "gsm8k", r["answer"]))
    return items, source


def _gsm8k_clean(answer: str) -> str:
    """lm-eval's exact_match cleaning: each of `regexes_to_ignore` removed in turn, then lower case."""
    for pattern in _GSM8K_IGNORE:
        answer = pattern.sub("", answer)
    return answer.strip().lower()


def _gsm8k_score(item: Item, text: str) -> Scores:
    text = _cut(text, GSM8K_STOPS)
    strict = _GSM8K_STRICT.search(text)
    flexible = [next(g for g in groups if g) for groups in _GSM8K_FLEXIBLE.findall(text)]
    target = _gsm8k_clean(item.reference)
    out: Scores = {}
    for name, answer in (("strict", strict[1] if strict else None), ("flexible", flexible[-1] if flexible else None)):
        out[name] = (answer, answer is not None and _gsm8k_clean(answer) == target)
    return out


# --- MATH-500: boxed answers, normalized equivalence ---

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
MATH_STOPS = ("Problem:",)
MATH_SHOT_MAX_CHARS = 300


def _math_items(data: str | None, k: int) -> tuple[list[Item], str]:
    rows, source = sources.load("math500-test", data)
    sources.require_fields(rows, ("problem", "solution", "answer"), source)
    if k:
        pool, _ = sources.load("math-train")
        shots = _shots([r for r in pool if len(r["solution"]) <= MATH_SHOT_MAX_CHARS], k, "math500")
        context = "".join(f"Problem: {s['problem']}\nSolution: {s['solution']}\n\n" for s in shots)
        prompts = [f"{context}Problem: {r['problem']}\n{MATH_INSTRUCTION}\nSolution:" for r in rows]
    else:
        prompts = [f"{r['problem']}\n{MATH_INSTRUCTION}" for r in rows]
    items = [Item(r.get("unique_id", f"math500-{i}"), p, r["answer"], r.get("subject", "math"), r["solution"])
             for i, (r, p) in enumerate(zip(rows, prompts))]
    return items, source


def _math_score(item: Item, text: str) -> Scores:
    answer = math_answers.last_boxed(_cut(text, MATH_STOPS))
    return {"boxed": (answer, math_answers.equivalent(answer, item.reference))}


# --- code: HumanEval (completion of the prompt) and MBPP sanitized (lm-eval's 3-shot [BEGIN]/[DONE] format) ---

HUMANEVAL_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
MBPP_STOPS = ("[DONE]",)
_FENCED = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)(?:```|$)", re.S)


def _fenced(text: str) -> str | None:
    m = _FENCED.search(text)
    return m[1] if m else None


def _run_tests(item: Item, code: str, unsafe_exec: bool) -> bool:
    """The program (setup + code), then the tests against the interpreter as it started (`sandbox`)."""
    return sandbox.run_python(f"{item.setup}{code}\n", tests=item.reference, keep=item.tested,
                              unsafe=unsafe_exec).passed


def _tested(tests: str, gold: str) -> tuple[str, ...]:
    """The functions the reference solution defines at its top level that the tests call (MBPP 126's is `sum`)."""
    defined = set(re.findall(r"^def (\w+)\(", gold, re.M))
    return tuple(sorted(defined & set(re.findall(r"(\w+)\(", tests))))


def _humaneval_items(data: str | None, k: int) -> tuple[list[Item], str]:
    _check_no_shots("humaneval", k)
    rows, source = sources.load("humaneval-test", data)
    sources.require_fields(rows, ("task_id", "prompt", "canonical_solution", "test", "entry_point"), source)
    items = [Item(r["task_id"], r["prompt"], f"{r['test']}\n\ncheck({r['entry_point']})\n", "humaneval",
                  r["canonical_solution"], setup=r["prompt"], tested=(r["entry_point"],)) for r in rows]
    return items, source


def _humaneval_score(item: Item, text: str, unsafe_exec: bool = False) -> Scores:
    """A fenced block is a whole program (appended after the prompt); plain text completes the prompt."""
    block = _fenced(text)
    code = "\n" + block if block is not None else _cut(text, HUMANEVAL_STOPS)
    return {"pass@1": (code, _run_tests(item, code, unsafe_exec))}


def _mbpp_query(row: dict) -> str:
    # the MBPP paper's prompt, as lm-eval's `mbpp` task writes it
    tests = "\n".join(row["test_list"])
    return (f"You are an expert Python programmer, and here is your task: {row['prompt']} "
            f"Your code should pass these tests:\n\n{tests}\n[BEGIN]\n")


def _mbpp_items(data: str | None, k: int) -> tuple[list[Item], str]:
    rows, source = sources.load("mbpp-test", data)
    fields = ("task_id", "prompt", "code", "test_list")
    sources.require_fields(rows, fields, source)
    shots, _ = sources.load("mbpp-prompt") if k else ([], "")
    context = "".join(f"{_mbpp_query(s)}{s['code']}\n[DONE]\n\n" for s in _shots(shots, k, "mbpp"))
    items = [Item(f"mbpp-{r['task_id']}", context + _mbpp_query(r), "\n".join(r["test_list"]) + "\n", "mbpp",
                  r["code"], setup="".join(f"{line}\n" for line in r.get("test_imports", [])),
                  tested=_tested("\n".join(r["test_list"]), r["code"])) for r in rows]
    return items, source


def _mbpp_score(item: Item, text: str, unsafe_exec: bool = False) -> Scores:
    text = _cut(text, MBPP_STOPS)
    block = _fenced(text)
    code = block if block is not None else text.replace("[BEGIN]", "")
    return {"pass@1": (code, _run_tests(item, code, unsafe_exec))}


# --- ParallelBench: read from the user's checkout (`parallelbench`) ---

def _parallelbench_items(task_id: str, data: str | None, k: int) -> tuple[list[Item], str]:
    """The records as the authors prompt them (one-shot turns included), rows interleaved over list lengths."""
    if k > 1:
        raise DllmError(f"parallelbench/{task_id} records hold one example; use --num-fewshot 0 or 1")
    config, rows, source = parallelbench.load_task(task_id, data)
    waiting_line = task_id in parallelbench.WAITING_LINE
    items = []
    for i in parallelbench.interleave_by_length(rows) if waiting_line else range(len(rows)):
        answer = rows[i]["answer"]
        messages = parallelbench.turns(config["prompt"], rows[i], k)
        gold = answer if isinstance(answer, str) else answer.get("example", answer.get("summary", ""))
        group = f"n={rows[i].get('metadata', {}).get('length')}" if waiting_line else task_id
        items.append(Item(f"{task_id}-{i}", messages[-1][1], json.dumps(answer), group, gold, messages=messages))
    return items, source


def _parallelbench_score(task_id: str, item: Item, text: str) -> Scores:
    return parallelbench.score(parallelbench.METRIC_OF[task_id], text, json.loads(item.reference))


def _parallelbench_task(task_id: str) -> Task:
    return Task(partial(_parallelbench_items, task_id), partial(_parallelbench_score, task_id),
                default_fewshot=parallelbench.default_fewshot(task_id), gen_length=parallelbench.gen_length(task_id),
                stop_early=False)


TASKS: dict[str, Task] = {
    "synthetic": Task(partial(_synthetic_items, synthetic.FAMILIES), _synthetic_score),
    # ParallelBench's list operations on letters, for a tiny model trained on them (every block decoded, as
    # ParallelBench counts tokens per step)
    "synthetic_lists": Task(partial(_synthetic_items, synthetic.LIST_FAMILIES), _synthetic_lists_score,
                            stop_early=False),
    "gsm8k": Task(_gsm8k_items, _gsm8k_score, default_fewshot=5),
    "math500": Task(_math_items, _math_score),
    "humaneval": Task(_humaneval_items, _humaneval_score, runs_code=True),
    "mbpp": Task(_mbpp_items, _mbpp_score, default_fewshot=3, runs_code=True),
    **{f"parallelbench/{t}": _parallelbench_task(t) for t in parallelbench.TASK_IDS},
}
SUITES = {name: tuple(f"parallelbench/{t}" for t in tasks) for name, tasks in parallelbench.SUITES.items()}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise DllmError(f"unknown task {name!r}; {choose_from(name, [*TASKS, *SUITES])}")
    return TASKS[name]
