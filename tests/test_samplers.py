"""Sampler rules on hand-made logits (spec baseline_and_fastdllm.md section 6, invariants 1-8)."""
import math
from types import SimpleNamespace

import pytest
import torch

import dllm
from dllm import samplers
from dllm.samplers import StepContext
from dllm.samplers.base import gumbel_argmax, most_confident, top_k_per_row


def ctx_for(probs, eligible=None, step=0, steps=1, seed=0, state=None):
    logits = torch.tensor(probs, dtype=torch.float64).log()
    if eligible is None:
        eligible = torch.ones(logits.shape[:2], dtype=torch.bool)
    C = logits.shape[1]
    return StepContext(logits, eligible, eligible.clone(), torch.arange(C), torch.zeros(1, C, dtype=torch.long), step,
                       steps, 0, [torch.Generator().manual_seed(seed)], 0, steps, 0, C, 0,
                       SimpleNamespace() if state is None else state)


def peaked(confidences, vocab=4):
    """Rows of distributions whose top probability is the given confidence (token 0 wins)."""
    return [[[c] + [(1 - c) / (vocab - 1)] * (vocab - 1) for c in row] for row in confidences]


@pytest.mark.parametrize("m,steps,want", [(32, 10, [4, 4, 3, 3, 3, 3, 3, 3, 3, 3]), (8, 8, [1] * 8),
                                          (5, 2, [3, 2])])
def test_low_confidence_follows_the_linear_schedule(m, steps, want):
    sampler = samplers.SAMPLERS.create("low_confidence")
    probs = peaked([[0.3 + 0.6 * i / m for i in range(m)]])
    eligible = torch.ones(1, m, dtype=torch.bool)
    counts = []
    for step in range(steps):
        out = sampler.step(ctx_for(probs, eligible.clone(), step, steps))
        counts.append(int(out.mask.sum()))
        eligible &= ~out.mask
    assert counts == want and not eligible.any()


def test_ties_go_to_the_lowest_position():
    mask = top_k_per_row(torch.tensor([[0.5, 0.9, 0.9, 0.9]]), torch.ones(1, 4, dtype=torch.bool), torch.tensor([2]))
    assert mask.tolist() == [[False, True, True, False]]


def test_threshold_set_is_monotone_and_keeps_the_best():
    probs = peaked([[0.95, 0.5, 0.91, 0.3, 0.99]])
    committed = {}
    for tau in (0.0, 0.9, 0.96, 1.5):
        committed[tau] = samplers.SAMPLERS.create("threshold", threshold=tau).step(ctx_for(probs)).mask[0].tolist()
    assert committed[0.9] == [True, False, True, False, True]
    assert committed[0.96] == [False, False, False, False, True]
    assert committed[1.5] == committed[0.96]  # only the argmax
    assert committed[0.0] == [True] * 5
    eligible = torch.tensor([[True, True, False, True, False]])
    only = samplers.SAMPLERS.create("threshold", threshold=2.0).step(ctx_for(probs, eligible)).mask
    assert only.tolist() == [[True, False, False, False, False]]


def test_factor_rule_and_its_compat_quirk():
    two_left = peaked([[0.9, 0.1]])  # bar for rank 2 at f = 1 is 1 - 1/3: 0.1 fails
    clean = samplers.SAMPLERS.create("factor", factor=1.0).step(ctx_for(two_left)).mask
    compat = samplers.SAMPLERS.create("factor", factor=1.0, compat=True).step(ctx_for(two_left)).mask
    assert clean.tolist() == [[True, False]] and compat.tolist() == [[True, True]]
    # ranks: 0.99 (bar .5), 0.9 (bar .667), 0.8 (bar .75), 0.7 (bar .8 fails), 0.6
    five = peaked([[0.7, 0.99, 0.6, 0.9, 0.8]])
    for compat in (False, True):
        got = samplers.SAMPLERS.create("factor", compat=compat).step(ctx_for(five)).mask
        assert got.tolist() == [[False, True, False, True, True]]


def test_gumbel_sampling_matches_softmax_and_greedy_uses_no_randomness():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]]).expand(1, 20000, 4)
    g = torch.Generator().manual_seed(0)
    before = g.get_state()
    assert (gumbel_argmax(logits, 0.0, [g]) == 0).all()
    assert torch.equal(g.get_state(), before)
    draws = gumbel_argmax(logits, 1.0, [g])[0]
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    assert (freq - torch.softmax(logits[0, 0].double(), -1)).abs().max() < 0.015
    again = gumbel_argmax(logits, 1.0, [torch.Generator().manual_seed(0)])[0]
    assert torch.equal(again, gumbel_argmax(logits, 1.0, [torch.Generator().manual_seed(0)])[0])


@pytest.mark.parametrize("name", ["maskgit_plus", "topk_margin", "entropy"])
def test_dream_counts_follow_the_time_grid(name):
    sampler = samplers.SAMPLERS.create(name)
    n, steps = 16, 4
    probs = peaked([[0.5 + 0.4 * i / n for i in range(n)]])
    eligible = torch.ones(1, n, dtype=torch.bool)
    counts = []
    for step in range(steps):
        out = sampler.step(ctx_for(probs, eligible.clone(), step, steps))
        counts.append(int(out.mask.sum()))
        assert out.mask[0, eligible[0]].sum() == out.mask.sum()  # only eligible positions
        eligible &= ~out.mask
    eps, left, want = 1e-3, n, []
    for step in range(steps - 1):
        t, s = 1 + step * (eps - 1) / steps, 1 + (step + 1) * (eps - 1) / steps
        want.append(max(1, math.floor(left * (1 - s / t))))
        left -= want[-1]
    assert counts == want + [left]


def test_dream_confidences_rank_as_defined():
    probs = [[[0.6, 0.4, 0.0, 0.0], [0.5, 0.1, 0.2, 0.2]]]  # maskgit prefers row 0; margin prefers row 1
    pick = {name: samplers.SAMPLERS.create(name).step(ctx_for(probs, steps=2)).mask[0].tolist()
            for name in ("maskgit_plus", "topk_margin", "entropy")}
    assert pick["maskgit_plus"] == [True, False]
    assert pick["topk_margin"] == [False, True]
    assert pick["entropy"] == [True, False]  # 2 outcomes beat 4


def test_origin_unmasks_each_position_with_probability_1_minus_s_over_t():
    """Dream's `_sample`: independent draws, so a step may commit nothing; the last step commits what is left."""
    sampler = samplers.SAMPLERS.create("origin")
    probs = peaked([[0.5] * 6])
    counts = [int(sampler.step(ctx_for(probs, step=1, steps=4, seed=seed)).mask.sum()) for seed in range(400)]
    t, s = 1 + 1 * (1e-3 - 1) / 4, 1 + 2 * (1e-3 - 1) / 4
    assert abs(sum(counts) / (400 * 6) - (1 - s / t)) < 0.03 and 0 in counts
    assert sampler.step(ctx_for(probs, step=3, steps=4)).mask.all()


def test_origin_takes_every_step_of_its_block():
    model, tok = dllm.load("tiny-dream")
    out = dllm.generate(model, tok, ["copy: abcd"], sampler="origin", gen_length=64, block_length=64, steps=64,
                        stop_early=False)
    assert out.stats.nfe == 64 and "abcd" in out.texts[0]


def test_dream_alg_temp_zero_is_top_k():
    """Dream's README runs alg_temp=0., which its code treats as no position sampling."""
    probs = peaked([[0.9, 0.5, 0.7, 0.6]])
    for name in ("maskgit_plus", "topk_margin", "entropy"):
        plain = samplers.SAMPLERS.create(name).step(ctx_for(probs, steps=2)).mask
        assert torch.equal(samplers.SAMPLERS.create(name, alg_temp=0.0).step(ctx_for(probs, steps=2)).mask, plain)


def test_most_confident_is_top_one_per_row_ties_to_the_lowest_position():
    """The one-per-row path equals top_k_per_row with k = 1, on ties (coarse confidences) and on rows with nothing
    eligible."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        confidence = torch.randint(0, 4, (6, 9), generator=g).float() / 4  # many exact ties
        eligible = torch.rand(6, 9, generator=g) < 0.5
        eligible[0] = False
        want = top_k_per_row(confidence, eligible, torch.ones(6, dtype=torch.long))
        assert torch.equal(most_confident(confidence, eligible), want)
