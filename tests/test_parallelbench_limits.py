"""ParallelBench's closed forms (spec parallelbench.md section 5) and the samplers against them: an oracle stand-in
for the network, whose logits are the exact conditionals of copy, shuffle and replace-at-random given what is already
committed, decoded through the real loop (`dllm.generate`, cache none). A sampler whose parallel decoding breaks the
math fails here, on a CPU, with no checkpoint.

Which samplers the oracle drives: on copy (a conditional of probability 1 everywhere) every registered sampler but
the three of `NOT_DRIVEN`, each exact at every tokens-per-step. The statistical checks run the samplers the formulas
describe (the oracle's conditionals are those of the canvas rows; a draft or an extra row, as speculative's and
wino's, would need its own context): `random` at temperature 1 (shuffle, replace), `low_confidence` at temperature 1
(shuffle: every confidence is 1/m, so its order is immaterial), greedy `low_confidence`/`threshold` where the outcome
is deterministic. Greedy top-k on replace with 2 positions left ties "keep" and F at 1/2 each; the paper counts 1/2,
our argmax breaks ties by lowest id, so both take the same token (0).
"""
import math
from fractions import Fraction

import pytest
import torch

import dllm
from dllm.core.errors import DllmError
from dllm.eval import parallel_limits as pl
from dllm.samplers import SAMPLERS

ROWS = 3000
ITEMS = list(range(40, 52))  # token ids of the item vocabulary
F, TASK, SEP = 60, 30, 31  # the replacement item, the task marker, the end of the input


class Oracle:
    """`DiffusionLM.run` of a perfect model for one task over n items: the prompt is [TASK, x_1..x_n, SEP], the
    answer the n positions after it; each masked answer position gets the log of its exact conditional."""

    def __init__(self, task: str, n: int, vocab: int, mask_id: int):
        self.task, self.n, self.vocab, self.mask_id = task, n, vocab, mask_id

    def __call__(self, tokens, positions, key_mask=None, kv=None, rows=None, logit_rows=None, **_):
        n, batch = self.n, tokens.shape[0]
        at = positions[:, None, :] == (n + 2 + torch.arange(n))[None, :, None]  # [B, n, A]: answer position j
        assert bool(at.any(-1).all()), "the oracle reads the whole answer in every forward (cache none)"
        answer = tokens.gather(1, at.int().argmax(-1))  # [B, n]: the first column at each answer position
        given = tokens.gather(1, (positions[:, None, :] == (1 + torch.arange(n))[None, :, None]).int().argmax(-1))
        masked = answer == self.mask_id
        probs = torch.zeros(batch, n, self.vocab, dtype=torch.float64)
        if self.task == "copy":
            probs.scatter_(2, given[..., None], 1.0)
        elif self.task == "shuffle":  # uniform over the items not yet placed
            left = torch.zeros(batch, self.vocab, dtype=torch.float64)
            left.scatter_add_(1, given, torch.ones_like(given, dtype=torch.float64))
            left.scatter_add_(1, answer.masked_fill(masked, 0), -(~masked).double())
            left[:, 0] = 0.0
            probs += (left / left.sum(1, keepdim=True))[:, None]
        else:  # replace_random: F at one uniformly chosen position, the others kept
            placed = (answer == F).any(1, keepdim=True)
            m = masked.sum(1, keepdim=True).clamp(min=1)
            p_f = torch.where(placed, 0.0, 1.0 / m).double()  # [B, 1]
            probs.scatter_(2, given[..., None], (1 - p_f)[..., None].expand(-1, n, 1).contiguous())
            probs[..., F] = p_f
        logits = probs.clamp(min=1e-30).log().float()
        canvas = torch.zeros(batch, tokens.shape[1], self.vocab)
        canvas += at.transpose(1, 2).float() @ logits  # each answer position's conditional wherever it sits
        return canvas.gather(1, logit_rows[..., None].expand(-1, -1, self.vocab)) if logit_rows is not None else canvas


@pytest.fixture(scope="module")
def stand_in():
    model, tok = dllm.load("random:llada-tiny")  # a model of its own: `decode` replaces its `run`
    yield model, tok
    vars(model).pop("run", None)


def decode(stand_in, task, n, rows=ROWS, **kwargs):
    """The accuracy of `rows` oracle decodes of one instance (each row its own seed), and row 0's counts per step."""
    model, tok = stand_in
    model.run = Oracle(task, n, model.config.vocab_size, model.config.mask_id)
    x = ITEMS[:n]
    kwargs.setdefault("steps", n)
    out = dllm.generate(model, tok, [[TASK, *x, SEP]] * rows, gen_length=n, block_length=n, chat=False,
                        stop_early=False, seed=list(range(rows)), trace=rows == 1, **kwargs)
    answers = torch.tensor([ids[:n] for ids in out.canvas_ids])
    if task == "copy":
        ok = (answers == torch.tensor(x)).all(1)
    elif task == "shuffle":  # success: a permutation of the input (the benchmark also wants it to differ)
        ok = (answers.sort(1).values == torch.tensor(x)).all(1)
    else:
        kept = answers == torch.tensor(x)
        ok = ((answers == F).sum(1) == 1) & (kept.sum(1) == n - 1)
    counts = [len(s["commits"][0]) for s in out.trace] if rows == 1 else None
    return ok.double().mean().item(), out.stats.nfe, counts


def within_4_sigma(measured: float, p: Fraction, rows: int = ROWS) -> bool:
    return abs(measured - float(p)) <= 4 * math.sqrt(float(p) * (1 - float(p)) / rows) + 1e-12


def test_closed_forms():
    assert pl.shuffle_accuracy([3]) == Fraction(2, 9)
    assert pl.shuffle_accuracy([2, 2]) == Fraction(3, 8)
    assert pl.shuffle_accuracy([3, 3]) == Fraction(10, 81)
    assert pl.shuffle_accuracy([2] * 5) == Fraction(945, 3840)
    assert pl.shuffle_accuracy([1] * 7) == 1
    assert pl.shuffle_accuracy([6]) == Fraction(math.factorial(6), 6 ** 6)
    assert pl.replace_random_accuracy([3]) == Fraction(4, 9)
    assert float(pl.replace_random_accuracy([10])) == pytest.approx(0.38742, abs=1e-5)
    assert float(pl.replace_random_accuracy([500])) == pytest.approx(1 / math.e, abs=1e-3)
    assert pl.replace_random_accuracy([2, 1]) == Fraction(8, 9)
    assert pl.replace_random_accuracy([2, 2]) == Fraction(21, 32)
    assert float(pl.replace_random_accuracy([4, 1])) == pytest.approx(0.8192)
    assert pl.replace_random_accuracy([1] * 5) == 1
    assert [pl.replace_random_greedy_accuracy(c) for c in ([2, 1], [2, 2], [3])] == [1, Fraction(1, 2), 0]
    assert pl.shuffle_threshold_accuracy(6, 0.6) == 1 and pl.shuffle_threshold_accuracy(6, 0.3) == Fraction(2, 9)
    assert pl.replace_random_threshold_accuracy(10, 0.95) == 1 and pl.replace_random_threshold_accuracy(10, 0.8) == 0
    assert pl.replace_random_total_correlation(10) == pytest.approx(1.368, abs=1e-3)
    assert pl.shuffle_total_correlation(10) == pytest.approx(11.428, abs=1e-3)
    assert pl.shuffle_decoding_loss([2] * 5) == pytest.approx(2.023, abs=1e-3)
    assert pl.shuffle_decoding_loss([2] * 5) == pytest.approx(math.log2(3840 / 945))  # log2(n!!/(n-1)!!)
    assert pl.top_k_schedule(4, 2) == [2, 2] and pl.top_k_schedule(6, 4) == [2, 2, 1, 1]


@pytest.mark.parametrize("n", [4, 6])
def test_random_top_k_matches_the_closed_forms(stand_in, n):
    for k in (1, 2, 3, n):
        steps = -(-n // k)
        _, _, counts = decode(stand_in, "shuffle", n, rows=1, sampler="random", steps=steps, temperature=1.0)
        assert counts == pl.top_k_schedule(n, steps)  # the schedule the formulas are evaluated on
        for task, formula in (("shuffle", pl.shuffle_accuracy), ("replace_random", pl.replace_random_accuracy)):
            acc, nfe, _ = decode(stand_in, task, n, sampler="random", steps=steps, temperature=1.0)
            assert nfe == steps
            assert within_4_sigma(acc, formula(counts)), (task, n, k, acc, float(formula(counts)))


def test_confidence_top_k_at_temperature_1(stand_in):
    """Shuffle: every confidence is 1/m, the order does not matter, the formula holds. Replace: a sampled F has
    confidence 1/m against (m-1)/m for "keep", so it is put off to the end, and the random-order formula is not
    reached (spec section 5)."""
    for n, steps in ((4, 2), (6, 2), (6, 1)):
        acc, _, _ = decode(stand_in, "shuffle", n, sampler="low_confidence", steps=steps, temperature=1.0)
        assert within_4_sigma(acc, pl.shuffle_accuracy(pl.top_k_schedule(n, steps)))
    for n, steps in ((4, 2), (6, 3)):
        expected = float(pl.replace_random_accuracy(pl.top_k_schedule(n, steps)))
        acc, _, _ = decode(stand_in, "replace_random", n, sampler="low_confidence", steps=steps, temperature=1.0)
        assert acc < expected - 4 * math.sqrt(expected * (1 - expected) / ROWS)


def test_deterministic_threshold_and_greedy_cases(stand_in):
    acc, nfe, _ = decode(stand_in, "shuffle", 6, rows=4, sampler="threshold", threshold=0.6)
    assert (acc, nfe) == (1.0, 6)  # every confidence 1/m <= 1/2: one commit per step
    acc, nfe, _ = decode(stand_in, "shuffle", 6, rows=4, sampler="threshold", threshold=0.3)
    assert (acc, nfe) == (0.0, 4)  # one per step until 3 are left (1/3 >= 0.3), which all take the same argmax
    # sampled instead (temperature 1), those 3 draw independently: 3!/3^3
    acc, nfe, _ = decode(stand_in, "shuffle", 6, sampler="threshold", threshold=0.3, temperature=1.0)
    assert nfe == 4 and within_4_sigma(acc, pl.shuffle_threshold_accuracy(6, 0.3))
    acc, nfe, _ = decode(stand_in, "replace_random", 10, rows=4, sampler="threshold", threshold=0.95)
    assert (acc, nfe) == (1.0, 10)
    acc, nfe, _ = decode(stand_in, "replace_random", 10, rows=4, sampler="threshold", threshold=0.8)
    assert (acc, nfe) == (0.0, 1)  # "keep" at 0.9 >= 0.8 everywhere at once
    for steps, expected in ((5, 1.0), (2, 1.0), (3, 1.0)):  # n = 5: schedules [1]*5, [3, 2] -> 0, [2, 2, 1]
        counts = pl.top_k_schedule(5, steps)
        acc, _, _ = decode(stand_in, "replace_random", 5, rows=4, sampler="low_confidence", steps=steps)
        assert acc == (1.0 if counts[-1] == 1 else 0.0), counts  # ties at 2 left go to one token: 0, not 1/2


NOT_DRIVEN = {  # registered samplers the oracle cannot run, and why
    "entropy_bound": "denoises a uniform-state canvas (DiffusionGemma); the oracle is a masked model",
    "joint_threshold_indel": "writes an insert/delete model's delete and split tokens, which copy has no use for",
    "pc_sampler": "needs the model directory's token_frequency.json, which the oracle has none of",
    "wedlm": "slides WeDLM's window over a causal model; the oracle attends both ways",
}


@pytest.mark.parametrize("sampler", [s.name for s in SAMPLERS if s.name not in NOT_DRIVEN])
def test_every_sampler_copies_exactly_at_any_parallelism(stand_in, sampler):
    """Copy has C(Y|X) = 0: a perfect model is right at any tokens per step, in any order, at any threshold. (Its
    conditionals do not depend on the context, so drafts and extra rows (speculative, wino) read them right too.)"""
    for steps in (6, 2, 1):
        acc, _, _ = decode(stand_in, "copy", 6, rows=8, sampler=sampler, steps=steps)
        assert acc == 1.0, (sampler, steps)


def test_the_samplers_not_driven_are_refused_by_name(stand_in):
    model, tok = stand_in
    assert set(NOT_DRIVEN) <= {s.name for s in SAMPLERS}
    for sampler in NOT_DRIVEN:
        with pytest.raises(DllmError, match=sampler):
            dllm.generate(model, tok, [[TASK, SEP]], sampler=sampler, gen_length=4, block_length=4, chat=False)
