import random
import re

import pytest

from dllm.eval import synthetic as S
from dllm.eval.synthetic import Example, extract_answer, make_split, score


@pytest.fixture(scope="module")
def test_split() -> list[Example]:
    return make_split("test")


@pytest.fixture(scope="module")
def train_split() -> list[Example]:
    return make_split("train", n_per_family=2000, seed=0)


def test_test_split_is_deterministic_and_distinct(test_split):
    assert make_split("test") == test_split
    assert len(test_split) == S.TEST_PER_FAMILY * len(S.FAMILIES)
    assert len({ex.prompt for ex in test_split}) == len(test_split)
    for fam in S.FAMILIES:
        assert sum(ex.family == fam for ex in test_split) == S.TEST_PER_FAMILY
    # A smaller test split is a prefix of the larger one, family by family.
    small = make_split("test", n_per_family=10, families=["add"])
    assert small == [ex for ex in test_split if ex.family == "add"][:10]
    # Another seed gives another split.
    other = make_split("test", seed=1)
    assert {ex.prompt for ex in other} != {ex.prompt for ex in test_split}


def test_train_never_contains_a_test_prompt(test_split, train_split):
    assert len(train_split) == 2000 * len(S.FAMILIES)
    reserved = S.reserved_test_prompts(seed=0)
    assert {ex.prompt for ex in test_split} <= reserved
    assert not {ex.prompt for ex in train_split} & reserved
    assert make_split("train", n_per_family=50, seed=0, families=["copy"]) == train_split[:50]


def test_train_excludes_reserved_prompts_even_when_the_space_is_small(monkeypatch):
    # Force a tiny prompt space so the train generator must actually reject test prompts.
    def tiny(rng: random.Random) -> Example:
        a, b = rng.randint(10, 14), rng.randint(10, 14)
        return Example("add", f"add: {a}+{b}", f"#### {a + b}")

    monkeypatch.setitem(S._MAKERS, "add", tiny)
    monkeypatch.setattr(S, "TEST_RESERVED", 20)
    test = make_split("test", n_per_family=20, families=["add"])
    train = make_split("train", n_per_family=100, families=["add"])
    assert len(train) == 100
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in test}
    assert len({ex.prompt for ex in train}) == 5


def test_answers_end_with_final_answer_and_fit_lengths(test_split, train_split):
    for ex in test_split + train_split:
        assert re.search(r" ?#### \S+$", ex.answer), ex
        assert ex.answer.count("####") == 1
        assert extract_answer(ex.answer) == ex.final_answer
        assert len(ex.prompt) <= S.MAX_PROMPT_CHARS
        assert len(ex.answer) <= S.MAX_ANSWER_CHARS
        assert len(ex.prompt) + len(ex.answer) <= S.MAX_TOTAL_CHARS <= 64
        assert set(ex.prompt + ex.answer) <= set(S.CHARSET)
    # The bounds are attained.
    assert len(" ".join(S.add_steps(9999, 9999)) + " #### 19998") == S.MAX_ANSWER_CHARS
    assert len("sort: " + ",".join(["99"] * 8)) == S.MAX_PROMPT_CHARS


def _payload(ex: Example) -> str:
    return ex.prompt.split(": ", 1)[1]


def test_final_answers_are_correct(train_split):
    seen = set()
    for ex in train_split:
        seen.add(ex.family)
        p, final = _payload(ex), ex.final_answer
        if ex.family == "copy":
            assert final == p and 4 <= len(p) <= 12 and p.isalnum()
        elif ex.family == "reverse":
            assert final == p[::-1] and 4 <= len(p) <= 12
        elif ex.family == "sort":
            xs, ys = p.split(","), final.split(",")
            assert 4 <= len(xs) <= 8 and all(len(x) == 2 and x.isdigit() for x in xs)  # zero-padded
            assert [int(y) for y in ys] == sorted(int(x) for x in xs) and ys == sorted(xs)
        elif ex.family == "count":
            assert ex.prompt.startswith("count digits: ") and 4 <= len(p) <= 12 and p.isalnum()
            digits = [c.isdigit() for c in p]
            running = ex.answer.rsplit(" #### ", 1)[0]
            assert running == "".join(str(sum(digits[: i + 1])) for i in range(len(p)))
            assert int(final) == sum(digits) == int(running[-1])
        elif ex.family == "add":
            assert re.fullmatch(r"\d{4}\+\d{4}", p)  # zero-padded to four digits
            a, b = (int(x) for x in p.split("+"))
            assert 10 <= a <= 9999 and 10 <= b <= 9999
            assert int(final) == a + b
        else:  # pragma: no cover
            raise AssertionError(ex.family)
    assert seen == set(S.FAMILIES)


def test_add_worked_steps_are_arithmetically_right(train_split):
    adds = [ex for ex in train_split if ex.family == "add"]
    step_re = re.compile(r"^(\d)\+(\d)\+([01])=(\d\d)$")
    for ex in adds:
        a, b = (int(x) for x in _payload(ex).split("+"))
        body = ex.answer.rsplit(" #### ", 1)[0]
        steps = body.split(" ")
        assert len(steps) == S.ADD_WIDTH
        carry, digits = 0, []
        for i, step in enumerate(steps):
            m = step_re.match(step)
            assert m, step
            x, y, c, s = (int(g) for g in m.groups())
            assert x == a // 10**i % 10 and y == b // 10**i % 10  # LSD first, missing digits are 0
            assert c == carry and s == x + y + c
            carry, digits = s // 10, digits + [s % 10]
        total = int(str(carry) + "".join(map(str, reversed(digits))))
        assert total == a + b == int(ex.final_answer)
    assert S.add_steps(457, 168) == ["7+8+0=15", "5+6+1=12", "4+1+1=06", "0+0+0=00"]
    assert S.add_steps(95, 7) == ["5+7+0=12", "9+0+1=10", "0+0+1=01", "0+0+0=00"]


def test_extract_answer_and_score():
    assert extract_answer("no mark here") is None
    assert extract_answer("x #### 5 #### 12  \n") == "12"
    assert extract_answer("####") == ""
    ex = Example("add", "add: 12+30", "2+0+0=02 1+3+0=04 #### 42")
    assert score(ex, "whatever #### 42")
    assert score(ex, "#### 42\n")
    assert not score(ex, "42")
    assert not score(ex, "#### 4 2")
    assert ex.final_answer == "42"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(split="dev"), "unknown split"),
        (dict(split="train", families=["mul"]), "unknown family"),
        (dict(split="train", n_per_family=-1), "non-negative"),
        (dict(split="test", n_per_family=1.5), "non-negative"),
        (dict(split="test", n_per_family=S.TEST_RESERVED + 1), "TEST_RESERVED"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_split(**kwargs)


def test_make_example_rejects_unknown_family():
    with pytest.raises(ValueError, match="unknown family"):
        S.make_example("mul", random.Random(0))
    assert make_split("train", n_per_family=0) == []


def test_solve_agrees_with_every_generated_answer(test_split):
    from dllm.eval.synthetic import solve

    assert all(solve(ex.prompt) == ex.final_answer for ex in test_split)
    with pytest.raises(ValueError, match="not a prompt of the synthetic suite"):
        solve("translate: hola")
