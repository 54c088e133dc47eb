"""What a perfect model scores when it decodes several tokens per step (ParallelBench, arXiv 2510.04767, section 4,
and spec `parallelbench.md` section 5): closed forms that a sampler's parallel decoding must reproduce on an oracle.

Setup: n single-token items, only the item positions decoded, and a model whose prediction at each masked position
is the exact conditional marginal given what is committed. `counts` is the decoding schedule: the positions committed
at each step (s_t), so m_t = n - sum of the earlier counts are masked before step t. Accuracies are exact fractions.
"""
from __future__ import annotations

import math
from fractions import Fraction
from math import factorial


def top_k_schedule(n: int, steps: int) -> list[int]:
    """LLaDA's linear schedule over one block: each step ceil(masks left / steps left), the larger shares first."""
    counts, left = [], n
    for t in range(steps):
        counts.append(-(-left // (steps - t)))
        left -= counts[-1]
    return counts


def _masked(counts: list[int]) -> list[int]:
    n = sum(counts)
    return [n - sum(counts[:t]) for t in range(len(counts))]


def shuffle_accuracy(counts: list[int]) -> Fraction:
    """A uniform random permutation decoded with random order or sampled tokens (temperature 1): the s_t positions
    of a step draw independently from the m_t items left and must all differ:
    prod_t m_t! / ((m_t - s_t)! m_t^s_t) (the paper's Eq. 5 with the schedule written out). k = 2, n even:
    (n-1)!!/n!!; k = n: n!/n^n."""
    acc = Fraction(1)
    for m, s in zip(_masked(counts), counts):
        acc *= Fraction(factorial(m), factorial(m - s) * m ** s)
    return acc


def replace_random_accuracy(counts: list[int]) -> Fraction:
    """Exactly one of n items becomes F, random order, sampled tokens: the step that places F must place exactly one,
    and no earlier step may have placed any. With q_t = (m_t - 1)/m_t:
    sum_t [prod_{u<t} q_u^s_u] s_t (1/m_t) q_t^(s_t - 1). k = n: ((n-1)/n)^(n-1), towards 1/e."""
    acc, none_yet = Fraction(0), Fraction(1)
    for m, s in zip(_masked(counts), counts):
        q = Fraction(m - 1, m)
        acc += none_yet * s * Fraction(1, m) * q ** (s - 1)
        none_yet *= q ** s
    return acc


def replace_random_greedy_accuracy(counts: list[int]) -> Fraction:
    """Greedy top-k: "keep" (probability (m-1)/m) wins every step until only the last step's positions are left,
    where F has probability 1/s_last at each; exactly one F: 1 when the last step commits 1, 1/2 for 2, 0 beyond."""
    return {1: Fraction(1), 2: Fraction(1, 2)}.get(counts[-1], Fraction(0))


def shuffle_threshold_accuracy(n: int, threshold: float) -> Fraction:
    """A confidence threshold (commit where confidence >= threshold, at least one) with tokens sampled at
    temperature 1: every confidence of a shuffle is 1/m, so once m <= floor(1/threshold) all m left commit at once,
    drawn independently. threshold > 1/2: one per step, accuracy 1; else m*!/m*^m*, m* = min(n, floor(1/threshold)).
    (Greedy, those m* take one argmax: accuracy 0 for m* >= 2.)"""
    m = min(n, math.floor(1 / threshold)) if threshold > 0 else n
    return Fraction(1) if m <= 1 else Fraction(factorial(m), m ** m)


def replace_random_threshold_accuracy(n: int, threshold: float) -> Fraction:
    """Greedy with a threshold (>=): "keep" has confidence (m-1)/m; at threshold <= (n-1)/n every position commits
    "keep" at the first step (accuracy 0), above it one per step and the last one becomes F (accuracy 1)."""
    return Fraction(0) if threshold <= Fraction(n - 1, n) else Fraction(1)


def shuffle_total_correlation(n: int) -> float:
    """C(Y|X) of a uniform permutation in bits: n log2 n - log2 n! (10 items: 11.43)."""
    return n * math.log2(n) - math.log2(factorial(n))


def replace_random_total_correlation(n: int) -> float:
    """C(Y|X) of replacing one random item in bits: (n-1)(log2 n - log2(n-1)), towards log2 e (10 items: 1.37)."""
    return (n - 1) * (math.log2(n) - math.log2(n - 1))


def shuffle_decoding_loss(counts: list[int]) -> float:
    """The shuffle's KL from the truth of a factorized decoder with this schedule, in bits:
    L = sum_t s_t log2 m_t - log2 n! (k = 2, 10 items: 2.02)."""
    return sum(s * math.log2(m) for m, s in zip(_masked(counts), counts)) - math.log2(factorial(sum(counts)))
