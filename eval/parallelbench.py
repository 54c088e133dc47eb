"""ParallelBench (Kang, Galim, Oh et al., "ParallelBench: Understanding the Trade-offs of Parallel Decoding in
Diffusion LLMs", arXiv 2510.04767, ICLR 2026): 17 tasks that are easy one token at a time and break when a dLLM
decodes several tokens per step.

The data carries no license, so nothing of it ships: records and prompt templates are read from a checkout the user
names (`--data DIR` or `DLLM_PARALLELBENCH_DIR`). The metrics are our own code after the behaviour of the authors'
`dataset/parallel_bench/metrics.py` (quirks kept, see the spec `parallelbench.md`). The grammar score (LanguageTool)
and BERTScore run only where their tools are available locally; otherwise they are `None`, never 0.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from functools import cache
from itertools import zip_longest
from pathlib import Path

from dllm.core.errors import DllmError

DATA_ENV = "DLLM_PARALLELBENCH_DIR"
LANGUAGETOOL_ENV = "DLLM_LANGUAGETOOL_URL"  # a running LanguageTool server, e.g. http://localhost:8081
BERTSCORE_ENV = "DLLM_BERTSCORE_MODEL"  # a local roberta-large directory
CLONE_SUBDIR = Path("dataset/parallel_bench/data/output/test")
WHERE = ("ParallelBench's data is not shipped (it has no license): clone github.com/furiosa-ai/ParallelBench and "
         f"pass --data CLONE (or its {CLONE_SUBDIR}), or set {DATA_ENV}")

WAITING_LINE = tuple(f"waiting_line/{op}" for op in (
    "copy", "sort", "reverse", "shuffle", "insert_index", "insert_random", "remove_index", "remove_random",
    "replace_index", "replace_random"))
TEXT_WRITING = ("paraphrase_summarize/chatgpt-paraphrases", "paraphrase_summarize/samsum",
                "words_to_sentence/easy", "words_to_sentence/medium", "words_to_sentence/hard")
PUZZLES = ("puzzle/latin_square_n4", "puzzle/sudoku_n4_12")
TASK_IDS = WAITING_LINE + TEXT_WRITING + PUZZLES
SUITES = {"parallelbench/waiting_line": WAITING_LINE, "parallelbench/text_writing": TEXT_WRITING,
          "parallelbench/puzzles": PUZZLES, "parallelbench": TASK_IDS}


def gen_length(task_id: str) -> int:
    """The paper's answer length: 32 tokens for the waiting line, 64 for the others (spec section 1)."""
    return 32 if task_id.startswith("waiting_line/") else 64


def default_fewshot(task_id: str) -> int:
    """One-shot for the waiting line and the puzzles, zero-shot for text (the authors' configs)."""
    return 0 if task_id in TEXT_WRITING else 1


# --- the checkout ---

def data_dir(data: str | Path | None) -> Path:
    """The directory that holds `<group>/task_config.yaml`: `data`, else $DLLM_PARALLELBENCH_DIR; a clone's root is
    accepted too."""
    given = data if data is not None else os.environ.get(DATA_ENV)
    if not given:
        raise DllmError(WHERE)
    for root in (Path(given), Path(given) / CLONE_SUBDIR):
        if any(root.glob("*/task_config.yaml")):
            return root
    raise DllmError(f"{given} holds no <group>/task_config.yaml; {WHERE}")


def load_task(task_id: str, data: str | Path | None) -> tuple[dict, list[dict], str]:
    """The task's entry of its group's task_config.yaml, its records and where they came from."""
    import yaml

    root = data_dir(data)
    group = task_id.split("/")[0]
    config_file, records_file = root / group / "task_config.yaml", root / f"{task_id}.jsonl"
    if not config_file.is_file() or not records_file.is_file():
        raise DllmError(f"{root} has no {task_id}.jsonl or {group}/task_config.yaml; {WHERE}")
    config = (yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}).get(task_id)
    if not isinstance(config, dict) or not isinstance(config.get("prompt"), str):
        raise DllmError(f"{config_file} has no entry {task_id!r} with a prompt; pass --data a ParallelBench checkout")
    if config.get("metric") != METRIC_OF[task_id]:
        raise DllmError(f"{config_file} scores {task_id} with {config.get('metric')!r}, dllm with "
                        f"{METRIC_OF[task_id]!r}; use the checkout of commit 72de8f7 or later")
    rows = [json.loads(line) for line in records_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    return config, rows, str(records_file)


def render(template: str, fields: dict) -> str:
    """A user turn: the template filled in, then each literal backslash-n made a newline (as the authors do)."""
    return template.format(**fields).replace("\\n", "\n")


def answer_text(answer) -> str:
    """An answer as the one-shot turn writes it: the string, or a dict answer's `example`."""
    return answer if isinstance(answer, str) else answer.get("example", "")


def turns(template: str, record: dict, shots: int) -> tuple[tuple[str, str], ...]:
    """[user: example, assistant: its answer]*shots + [user: the record], as (role, content) pairs."""
    examples = record["input"].get("icl_examples", [])
    if shots > len(examples):
        raise DllmError(f"this task's records hold {len(examples)} one-shot example(s); use --num-fewshot "
                        f"{len(examples)} or 0")
    out: list[tuple[str, str]] = []
    for ex in examples[:shots]:
        out += [("user", render(template, ex["input"])), ("assistant", answer_text(ex["answer"]))]
    return (*out, ("user", render(template, record["input"])))


def interleave_by_length(rows: list[dict]) -> list[int]:
    """Line numbers taken round-robin over the list lengths (the files are sorted by length), so that `--limit`
    keeps every length."""
    by_length: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_length.setdefault(r.get("metadata", {}).get("length", 0), []).append(i)
    return [i for lane in zip_longest(*by_length.values()) for i in lane if i is not None]


# --- list and puzzle metrics (offline) ---

def parse_list(text: str, strict: bool = False) -> list[str] | None:
    """The list in `text`. Lenient: after the last `[`, before the next `]`, split on commas, quotes and spaces
    stripped. Strict: both brackets, items separated by `", "` and each quoted; otherwise None."""
    if "[" in text:
        text = text.rsplit("[", 1)[1]
    elif strict:
        return None
    if "]" in text:
        text = text.split("]", 1)[0]
    elif strict:
        return None
    if not strict:
        return [piece.strip('" ') for piece in text.split(",") if piece.strip()]  # `""` stays, as an empty item
    items = []
    for piece in text.split(", "):
        if not (piece.startswith('"') and piece.endswith('"')) or '"' in piece[1:-1]:
            return None
        items.append(piece[1:-1])
    return items


def _reference_list(answer) -> list[str]:
    return list(answer["input"]) if isinstance(answer, dict) else parse_list(answer)


def _match(out: list[str], answer) -> bool:
    return out == _reference_list(answer)


def _shuffled(out: list[str], answer) -> bool:
    given = answer["input"]
    return sorted(out) == sorted(given) and out != given


def _inserted(out: list[str], answer) -> bool:
    if answer["word"] not in out:
        return False
    rest = list(out)
    rest.remove(answer["word"])
    return rest == answer["input"]


def _removed(out: list[str], answer) -> bool:
    given = answer["input"]
    missing = set(given) - set(out)
    if len(out) != len(given) - 1 or len(missing) != 1:
        return False
    rest = list(given)
    rest.remove(missing.pop())
    return rest == out


def _replaced(out: list[str], answer) -> bool:
    given, word = answer["input"], answer["word"]
    if len(out) != len(given) or word not in out:
        return False
    expected = list(given)
    expected[out.index(word)] = word
    return out == expected


def _list_metric(check):
    def score(text: str, answer) -> dict[str, float]:
        return {name: float(out is not None and check(out, answer))
                for name, out in (("score", parse_list(text)), ("score_strict", parse_list(text, strict=True)))}
    return score


def latin_square(text: str, answer) -> dict[str, float]:
    """Any valid square counts. As upstream: lines whose cells are not exactly the symbol set are skipped, the
    first `size` remaining rows and their columns must each be the set, and a cell may repeat (`A,B,A` for {A,B})."""
    symbols = set(answer["symbols"])
    rows = [[c.strip() for c in line.strip().split(",")] for line in text.split("\n") if line.strip()]
    rows = [r for r in rows if set(r) == symbols][:len(symbols)]
    ok = len(rows) == len(symbols) and all(set(col) == symbols for col in zip(*rows))
    return {"score": float(ok), "score_strict": float(ok)}  # upstream has no strict variant


def parse_sudoku(text: str, strict: bool = False) -> list[str] | None:
    """A 4x4 grid as 4 rows of digits. Lenient: spaces and commas dropped, the lines with exactly 4 digits kept,
    exactly 4 of them. Strict: exactly 4 non-empty lines of exactly 4 digits."""
    if strict:
        lines = [line.strip() for line in text.strip().split("\n") if line.strip()]
        ok = len(lines) == 4 and all(len(line) == 4 and line.isdigit() for line in lines)
        return lines if ok else None
    rows = ["".join(re.findall(r"\d", line)) for line in text.replace(" ", "").replace(",", "").split("\n")]
    rows = [r for r in rows if len(r) == 4]
    return rows if len(rows) == 4 else None


def sudoku(text: str, answer) -> dict[str, float]:
    solution = parse_sudoku(answer, strict=True)
    return {"score": float(parse_sudoku(text) == solution),
            "score_strict": float(parse_sudoku(text, strict=True) == solution)}


# --- text metrics ---

_BLEU_STEPS = ((re.compile(r"([\{-\~\[-\` -\&\(-\+\:-\@\/])"), r" \1 "), (re.compile(r"([^0-9])([\.,])"), r"\1 \2 "),
               (re.compile(r"([\.,])([^0-9])"), r" \1 \2"), (re.compile(r"([0-9])(-)"), r"\1 \2 "))


def tokenize_13a(text: str) -> list[str]:
    """mteval-v13a's tokenization (the default of sacrebleu and of `evaluate`'s "bleu")."""
    text = text.replace("<skipped>", "").replace("-\n", "").replace("\n", " ")
    for entity, char in (("&quot;", '"'), ("&amp;", "&"), ("&lt;", "<"), ("&gt;", ">")):
        text = text.replace(entity, char)
    text = f" {text} "
    for pattern, repl in _BLEU_STEPS:
        text = pattern.sub(repl, text)
    return text.split()


def bleu(candidate: str, reference: str, max_order: int = 4) -> float:
    """Corpus BLEU of one pair as `evaluate`'s "bleu" computes it: 13a tokens, clipped n-gram counts up to 4, no
    smoothing (0 when some order has no match), brevity penalty exp(1 - r/c) when c < r."""
    cand, ref = tokenize_13a(candidate), tokenize_13a(reference)
    if not cand:
        return 0.0
    log_precisions = 0.0
    for n in range(1, max_order + 1):
        grams = Counter(tuple(cand[i:i + n]) for i in range(len(cand) - n + 1))
        ref_grams = Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
        matches = sum((grams & ref_grams).values())
        if matches == 0:
            return 0.0
        log_precisions += math.log(matches / (len(cand) - n + 1)) / max_order
    penalty = 1.0 if len(cand) > len(ref) else math.exp(1 - len(ref) / len(cand))
    return math.exp(log_precisions) * penalty


@cache
def _rouge_scorer():
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        return None
    return rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)


def rouge(candidate: str, reference: str) -> dict[str, float | None]:
    """ROUGE-1/2/L F-measures (rouge-score, Porter stemmer, as `evaluate`'s "rouge" with use_stemmer=True); None
    when rouge-score is not installed."""
    scorer = _rouge_scorer()
    if scorer is None:
        return {"rouge1": None, "rouge2": None, "rougeL": None}
    scores = scorer.score(reference, candidate)
    return {name: scores[name].fmeasure for name in ("rouge1", "rouge2", "rougeL")}


@cache
def _language_tool():
    url = os.environ.get(LANGUAGETOOL_ENV)
    if not url:
        return None
    import language_tool_python  # the user who points at a server has it installed
    return language_tool_python.LanguageTool("en-US", remote_server=url)


def grammar(text: str) -> float | None:
    """1 when LanguageTool finds no issue in the stripped text (every match counts, spelling included), 0 for an
    empty text; None without a LanguageTool server ($DLLM_LANGUAGETOOL_URL)."""
    tool = _language_tool()
    if tool is None:
        return None
    return float(bool(text.strip()) and not tool.check(text.strip()))


@cache
def _bert_scorer():
    path = os.environ.get(BERTSCORE_ENV)
    if not path:
        return None
    from bert_score import BERTScorer
    return BERTScorer(model_type=path, num_layers=17, idf=False, rescale_with_baseline=False)


def bertscore(candidate: str, reference: str) -> float | None:
    """BERTScore F1 (roberta-large, layer 17, no idf, no rescaling); None without a local model ($DLLM_BERTSCORE_MODEL)."""
    scorer = _bert_scorer()
    if scorer is None:
        return None
    if not candidate.strip():
        return 0.0
    return float(scorer.score([candidate], [reference])[2][0])


def _product(*values: float | None) -> float | None:
    return None if any(v is None for v in values) else math.prod(values)


def words_to_sentence(text: str, answer) -> dict[str, float | None]:
    """Inclusion: every word occurs in the output as a substring, case-sensitive ("throw" in "throwing")."""
    inclusion = float(all(w in text for w in answer["words"]))
    g = grammar(text)
    return {"inclusion": inclusion, "grammar": g, "score": _product(inclusion, g)}


def summary(text: str, answer) -> dict[str, float | None]:
    scores = rouge(text, answer["summary"])
    g = grammar(text)
    return {**scores, "grammar": g, "score": _product(scores["rougeL"], g)}


def paraphrase(text: str, answer) -> dict[str, float | None]:
    """Against the source sentence (the stored paraphrases are unused upstream): 1 - BLEU, BERTScore F1, grammar;
    an empty output scores 0 on each."""
    inv_bleu = 1 - bleu(text, answer["text"]) if text.strip() else 0.0
    b, g = bertscore(text, answer["text"]), grammar(text)
    return {"inv_bleu": inv_bleu, "bertscore": b, "grammar": g, "score": _product(inv_bleu, b, g)}


METRICS = {
    "list_match_score": _list_metric(_match),
    "list_shuffle_score": _list_metric(_shuffled),
    "list_random_insert_score": _list_metric(_inserted),
    "list_random_remove_score": _list_metric(_removed),
    "list_random_replace_score": _list_metric(_replaced),
    "latin_square_score": latin_square,
    "sudoku_score": sudoku,
    "sentence_to_words_score": words_to_sentence,
    "summary_score": summary,
    "paraphrase_score": paraphrase,
}
METRIC_OF = {
    **{t: "list_match_score" for t in WAITING_LINE},
    "waiting_line/shuffle": "list_shuffle_score", "waiting_line/insert_random": "list_random_insert_score",
    "waiting_line/remove_random": "list_random_remove_score", "waiting_line/replace_random": "list_random_replace_score",
    "paraphrase_summarize/chatgpt-paraphrases": "paraphrase_score", "paraphrase_summarize/samsum": "summary_score",
    **{t: "sentence_to_words_score" for t in TEXT_WRITING[2:]},
    "puzzle/latin_square_n4": "latin_square_score", "puzzle/sudoku_n4_12": "sudoku_score",
}
# the headline when the authors' `score` needs a tool that is missing (their figures plot the grammar score)
OFFLINE_HEADLINE = {"sentence_to_words_score": "inclusion", "summary_score": "rougeL", "paraphrase_score": "inv_bleu"}


def score(metric: str, text: str, answer) -> dict[str, tuple[str | None, float | None]]:
    """`Scores` of one output: the headline first (`score` for lists and puzzles; for text the grammar score when
    LanguageTool runs, as the paper plots, else ROUGE-L, 1 - BLEU or inclusion), then every sub-metric."""
    values = METRICS[metric](text, answer)
    if metric in OFFLINE_HEADLINE:
        head = "grammar" if values["grammar"] is not None else OFFLINE_HEADLINE[metric]
    else:
        head = "score"
    return {name: (text, values[name]) for name in (head, *(n for n in values if n != head))}
