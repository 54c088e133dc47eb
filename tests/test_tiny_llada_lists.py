"""The shipped tiny-llada-lists (issue #55): trained on the list families of `synthetic_lists`, it answers the
deterministic ones one token per step, and a perfect model's closed form bounds its shuffle decoded in one step
(RESULTS.md, "tiny-llada-lists")."""
import math

import pytest

import dllm
from dllm.eval.parallel_limits import shuffle_accuracy, top_k_schedule
from dllm.eval.synthetic import make_split, score


@pytest.fixture(scope="module")
def lists_model():
    return dllm.load("tiny-llada-lists")


def right(texts, examples) -> int:
    return sum(score(ex, text) for text, ex in zip(texts, examples))


def test_copy_and_reverse_are_answered_one_token_per_step(lists_model):
    model, tok = lists_model
    examples = make_split("test", 16, families=["copy_list", "reverse_list"])
    out = dllm.generate(model, tok, [ex.prompt for ex in examples], gen_length=32, block_length=32, steps=32,
                        stop_early=False)
    assert right(out.texts, examples) >= 30, out.texts


def test_shuffle_all_at_once_stays_under_a_perfect_models_score(lists_model):
    """32 tokens in one step with sampled tokens: a perfect model is right on n items with probability n!/n^n
    (6.3% over 3-8 items); the network may not do better (4 sigma over 96 items)."""
    model, tok = lists_model
    examples = make_split("test", 96, families=["shuffle"])
    out = dllm.generate(model, tok, [ex.prompt for ex in examples], sampler="random", temperature=1.0,
                        gen_length=32, block_length=32, steps=1, stop_early=False, seed=list(range(96)))
    n = [len(ex.prompt.split(": ")[1].split(",")) for ex in examples]
    p = [float(shuffle_accuracy(top_k_schedule(k, 1))) for k in n]
    mean, sigma = sum(p), math.sqrt(sum(q * (1 - q) for q in p))
    assert right(out.texts, examples) <= mean + 4 * sigma
