"""Seeded synthetic tasks for training and evaluating tiny masked-diffusion LMs.

Families, roughly from easy-to-parallelize to dependency-heavy:

- ``copy``     ``copy: k3x9a``        -> ``#### k3x9a``
- ``reverse``  ``reverse: abc12``     -> ``#### 21cba``
- ``sort``     ``sort: 42,07,19,03``  -> ``#### 03,07,19,42``
- ``count``    ``count digits: k3x91`` -> ``01123 #### 3``
- ``add``      ``add: 0457+0068``     -> ``7+8+0=15 5+6+1=12 4+0+1=05 0+0+0=00 #### 525``

Numbers in prompts are zero-padded to a fixed width (two digits for ``sort``, four for ``add``), so a digit's
place is a fixed distance from the end of the prompt. ``count`` writes the running count of digits after each
character of the string. ``add`` writes one fixed-width step per column, least-significant digit first: ``a+b+c=ss``
where ``c`` is the carry in and ``ss`` the two-digit column sum, whose first digit is the carry out.

Every answer ends GSM8K-style with ``#### <final answer>``. Note that ``sort`` answers contain commas:
score them with :func:`extract_answer`, not with an extractor that deletes commas from numbers.

``LIST_FAMILIES`` (not in the default suite, trained with ``scripts/train_tiny.py --mix``) mirror ParallelBench's
waiting-line operations (arXiv 2510.04767; spec ``parallelbench.md`` section 6) on 3-8 distinct letters:
``shuffle: a,b,c`` -> ``#### c,a,b``, ``replace any with x: a,b,c`` -> ``#### a,x,c``, ``replace 1 with x: a,b,c``
(0-based), ``insert x: a,b,c``, ``remove any: a,b,c``, ``copy list:``, ``reverse list:``, ``sort list:``. The random
ones have several right answers (the training target is one drawn uniformly, the distribution the paper's closed
forms assume); :func:`score` accepts any of them, as the benchmark's metrics do.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

FAMILIES: tuple[str, ...] = ("copy", "reverse", "sort", "count", "add")
LIST_FAMILIES: tuple[str, ...] = ("copy_list", "reverse_list", "sort_list", "shuffle", "replace_random",
                                  "replace_index", "insert_random", "remove_random")

#: Every character that can occur in a prompt or an answer.
CHARSET: str = string.ascii_lowercase + string.digits + " #+,:="

#: Exact maxima over all families: the longest prompt is ``sort`` with eight numbers (29), the longest
#: answer and prompt+answer are ``add`` with a five-digit sum (46 and 60).
MAX_PROMPT_CHARS: int = 29
MAX_ANSWER_CHARS: int = 46
MAX_TOTAL_CHARS: int = 60

#: Default sizes per family.
TEST_PER_FAMILY: int = 200
TRAIN_PER_FAMILY: int = 10_000
#: The test stream reserves this many prompts per family; train never contains any of them,
#: and a test split can be at most this large.
TEST_RESERVED: int = 1_000

SPLITS: tuple[str, ...] = ("train", "test")
ANSWER_MARK = "####"

_ALNUM = string.ascii_lowercase + string.digits


@dataclass(frozen=True)
class Example:
    """One prompt/answer pair; ``answer`` ends with ``#### <final answer>``."""

    family: str
    prompt: str
    answer: str

    @property
    def final_answer(self) -> str:
        """The text after the last ``####`` of the answer."""
        final = extract_answer(self.answer)
        assert final is not None
        return final


def extract_answer(text: str) -> str | None:
    """The text after the last ``####``, stripped; None if there is no ``####``."""
    head, mark, tail = text.rpartition(ANSWER_MARK)
    if not mark:
        return None
    return tail.strip()


def score(example: Example, generated_text: str) -> bool:
    """Exact match of the final answer extracted from ``generated_text``; for a list family, any right answer."""
    answer = extract_answer(generated_text)
    if example.family in LIST_FAMILIES:
        return answer is not None and list_answer_ok(example.prompt, answer)
    return answer == example.final_answer


def _final(body: str, final: str) -> str:
    return f"{body} {ANSWER_MARK} {final}" if body else f"{ANSWER_MARK} {final}"


def _alnum(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choices(_ALNUM, k=rng.randint(lo, hi)))


def _copy(rng: random.Random) -> Example:
    s = _alnum(rng, 4, 12)
    return Example("copy", f"copy: {s}", _final("", s))


def _reverse(rng: random.Random) -> Example:
    s = _alnum(rng, 4, 12)
    return Example("reverse", f"reverse: {s}", _final("", s[::-1]))


def _sort(rng: random.Random) -> Example:
    xs = [f"{rng.randrange(100):02d}" for _ in range(rng.randint(4, 8))]
    return Example("sort", f"sort: {','.join(xs)}", _final("", ",".join(sorted(xs))))


def _count(rng: random.Random) -> Example:
    length = rng.randint(4, 12)
    k = rng.randint(0, min(9, length))
    chars = rng.choices(string.digits, k=k) + rng.choices(string.ascii_lowercase, k=length - k)
    rng.shuffle(chars)
    running = "".join(str(sum(c.isdigit() for c in chars[: i + 1])) for i in range(length))
    return Example("count", f"count digits: {''.join(chars)}", _final(running, str(k)))


ADD_WIDTH = 4


def add_steps(a: int, b: int) -> list[str]:
    """Column steps of ``a + b`` over ``ADD_WIDTH`` columns, least-significant digit first, as ``x+y+c=ss``."""
    da, db = f"{a:0{ADD_WIDTH}d}"[::-1], f"{b:0{ADD_WIDTH}d}"[::-1]
    steps, carry = [], 0
    for x, y in zip(map(int, da), map(int, db)):
        s = x + y + carry
        steps.append(f"{x}+{y}+{carry}={s:02d}")
        carry = s // 10
    return steps


def _add(rng: random.Random) -> Example:
    da, db = rng.randint(2, ADD_WIDTH), rng.randint(2, ADD_WIDTH)
    a = rng.randrange(10 ** (da - 1), 10**da)
    b = rng.randrange(10 ** (db - 1), 10**db)
    prompt = f"add: {a:0{ADD_WIDTH}d}+{b:0{ADD_WIDTH}d}"
    return Example("add", prompt, _final(" ".join(add_steps(a, b)), str(a + b)))


# --- list operations on single letters (ParallelBench's waiting line in miniature) ---

LIST_OPS = {"copy_list": "copy list", "reverse_list": "reverse list", "sort_list": "sort list", "shuffle": "shuffle",
            "replace_random": "replace any with {x}", "replace_index": "replace {i} with {x}",
            "insert_random": "insert {x}", "remove_random": "remove any"}


def _list_example(family: str, rng: random.Random) -> Example:
    letters = rng.sample(string.ascii_lowercase, rng.randint(4, 9))
    items, x = letters[:-1], letters[-1]  # x: a letter not in the list
    i = rng.randrange(len(items))
    if family == "shuffle":  # a uniformly drawn order that differs from the input
        out = items
        while out == items:
            out = rng.sample(items, len(items))
    elif family == "insert_random":
        at = rng.randint(0, len(items))
        out = items[:at] + [x] + items[at:]
    else:
        out = {"copy_list": items, "reverse_list": items[::-1], "sort_list": sorted(items),
               "replace_random": items[:i] + [x] + items[i + 1:], "replace_index": items[:i] + [x] + items[i + 1:],
               "remove_random": items[:i] + items[i + 1:]}[family]
    return Example(family, f"{LIST_OPS[family].format(x=x, i=i)}: {','.join(items)}", _final("", ",".join(out)))


def list_answer_ok(prompt: str, answer: str) -> bool:
    """Whether `answer` (comma-separated letters) is a right answer to a list family's prompt."""
    op, _, given = prompt.partition(": ")
    items, out = given.split(","), answer.split(",")
    words = op.split()
    if op in ("copy list", "reverse list", "sort list"):
        return out == {"copy list": items, "reverse list": items[::-1], "sort list": sorted(items)}[op]
    if op == "shuffle":
        return sorted(out) == sorted(items) and out != items
    if op == "remove any":
        return len(out) == len(items) - 1 and any(items[:i] + items[i + 1:] == out for i in range(len(items)))
    x = words[-1]
    if words[0] == "insert":
        return any(items[:i] + [x] + items[i:] == out for i in range(len(items) + 1))
    if words[1] == "any":
        return any(items[:i] + [x] + items[i + 1:] == out for i in range(len(items)))
    i = int(words[1])
    return out == items[:i] + [x] + items[i + 1:]


#: The prompts each family draws (regular expressions), and the same in words. A model trained on them carries
#: them in its generation_config.json (`training_format`), so that a prompt outside them gets a notice.
PROMPT_FORMATS: dict[str, str] = {
    "copy": r"copy: [a-z0-9]{4,12}",
    "reverse": r"reverse: [a-z0-9]{4,12}",
    "sort": r"sort: [0-9]{2}(,[0-9]{2}){3,7}",
    "count": r"count digits: (?!([a-z]*[0-9]){10})[a-z0-9]{4,12}",
    "add": r"add: (?!000)[0-9]{4}\+(?!000)[0-9]{4}",
    **{f: LIST_OPS[f].format(x="[a-z]", i="[0-7]") + r": [a-z](,[a-z]){2,7}" for f in LIST_FAMILIES},
}
FORMAT_WORDS: dict[str, str] = {
    "copy": "copy: 4-12 of a-z0-9",
    "reverse": "reverse: 4-12 of a-z0-9",
    "sort": "sort: 4-8 numbers of two digits each (42,07,19,03)",
    "count": "count digits: 4-12 of a-z0-9, at most 9 digits",
    "add": "add: two numbers of 2-4 digits, each zero-padded to 4 (0457+0068)",
    **{f: f"{LIST_OPS[f].format(x='x', i='1')}: 3-8 distinct letters (a,b,c)" for f in LIST_FAMILIES},
}


def training_format(families: Sequence[str] = FAMILIES) -> dict[str, list[str] | str]:
    """`prompt_formats` and `trained_on` for the generation_config.json of a model trained on `families`, each
    prompt alone in a user turn of the chat template."""
    _check_families(families)
    return {"prompt_formats": [PROMPT_FORMATS[f] for f in families],
            "trained_on": "; ".join(FORMAT_WORDS[f] for f in families) + "; one user turn of the chat template"}


_MAKERS: dict[str, Callable[[random.Random], Example]] = {
    "copy": _copy,
    "reverse": _reverse,
    "sort": _sort,
    "count": _count,
    "add": _add,
    **{f: partial(_list_example, f) for f in LIST_FAMILIES},
}
assert tuple(_MAKERS) == FAMILIES + LIST_FAMILIES


def solve(prompt: str) -> str:
    """The final answer (the text after ``####``) to any prompt of the suite, e.g. ``solve("copy: ab") == "ab"``."""
    family, _, arg = prompt.partition(": ")
    if family == "copy":
        return arg
    if family == "reverse":
        return arg[::-1]
    if family == "sort":
        return ",".join(sorted(arg.split(",")))
    if family == "count digits":
        return str(sum(c.isdigit() for c in arg))
    if family == "add":
        a, b = arg.split("+")
        return str(int(a) + int(b))
    raise ValueError(f"{prompt!r} is not a prompt of the synthetic suite ({', '.join(FAMILIES)})")


def make_example(family: str, rng: random.Random) -> Example:
    """Draw one example of ``family`` from ``rng``."""
    _check_families([family])
    return _MAKERS[family](rng)


def _check_families(families: Sequence[str]) -> None:
    unknown = [f for f in families if f not in _MAKERS]
    if unknown:
        raise ValueError(f"unknown family {unknown[0]!r}; use one of {', '.join(_MAKERS)}")


def _rng(seed: int, split: str, family: str) -> random.Random:
    # A str seed is hashed with SHA-512 by `random`, so streams are stable across runs and platforms.
    return random.Random(f"dllm-synthetic/{seed}/{split}/{family}")


def _test_stream(family: str, n: int, seed: int) -> list[Example]:
    """The first ``n`` distinct test prompts of ``family``."""
    rng, seen, out = _rng(seed, "test", family), set(), []
    make = _MAKERS[family]
    while len(out) < n:
        ex = make(rng)
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            out.append(ex)
    return out


def reserved_test_prompts(seed: int = 0) -> set[str]:
    """All prompts reserved for the test split (``TEST_RESERVED`` per family) for ``seed``."""
    return {ex.prompt for f in FAMILIES for ex in _test_stream(f, TEST_RESERVED, seed)}


def make_split(
    split: str,
    n_per_family: int | None = None,
    seed: int = 0,
    families: Sequence[str] | None = None,
) -> list[Example]:
    """Examples grouped by family (in ``families`` order, default all of ``FAMILIES``).

    ``test`` holds distinct prompts, is deterministic for a seed, and a smaller test split is a prefix of a
    larger one (default ``TEST_PER_FAMILY``, at most ``TEST_RESERVED``). ``train`` (default
    ``TRAIN_PER_FAMILY``) may repeat prompts but never contains one of the reserved test prompts.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use 'train' or 'test'")
    fams = tuple(FAMILIES if families is None else families)
    _check_families(fams)
    if n_per_family is None:
        n_per_family = TEST_PER_FAMILY if split == "test" else TRAIN_PER_FAMILY
    if isinstance(n_per_family, bool) or not isinstance(n_per_family, int) or n_per_family < 0:
        raise ValueError(f"n_per_family must be a non-negative int, got {n_per_family!r}")
    if split == "test" and n_per_family > TEST_RESERVED:
        raise ValueError(f"n_per_family={n_per_family} is above TEST_RESERVED={TEST_RESERVED}; ask for fewer")

    out: list[Example] = []
    for family in fams:
        reserved = _test_stream(family, TEST_RESERVED, seed)
        if split == "test":
            out.extend(reserved[:n_per_family])
            continue
        banned = {ex.prompt for ex in reserved}
        rng, make, count = _rng(seed, "train", family), _MAKERS[family], 0
        while count < n_per_family:
            ex = make(rng)
            if ex.prompt not in banned:
                out.append(ex)
                count += 1
    return out
