"""Fast-dLLM confidence-aware parallel decoding (arXiv 2505.22618; spec `baseline_and_fastdllm.md` 3.1-3.2)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dllm.core.params import param

from .base import (CausalFirst, Commit, Sampler, StepContext, gumbel_argmax, most_confident, per_row, register,
                   token_probability, top_k_per_row)


def threshold_commit(confidence, eligible, threshold, strict: bool = False):
    """Every eligible position with confidence >= threshold (> with `strict`; a number or per-row values), and
    always the most confident one."""
    threshold = per_row(threshold, confidence)
    return most_confident(confidence, eligible) | (eligible & (confidence > threshold if strict else confidence >= threshold))


def _ranked(confidence, eligible):
    score = confidence.masked_fill(~eligible, float("-inf"))
    return score.sort(dim=1, descending=True, stable=True).values


@register("threshold")
@dataclass
class Threshold(CausalFirst):
    """Fast-dLLM threshold rule: commit every masked block position with confidence >= threshold, and always
    the most confident one."""

    canvas_may_grow: ClassVar[bool] = True
    threshold: float = param(0.9, "commit positions whose probability reaches this (> 1 = one per step)", ge=0.0)

    def choose(self, ctx: StepContext) -> Commit:
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        confidence = token_probability(ctx.logits, tokens, ctx.unscored)
        return Commit(threshold_commit(confidence, ctx.eligible, self.threshold), tokens, confidence)


def factor_count(ranked, left, factor, compat: bool = False):
    """How many of the top ranks the factor rule commits. `ranked`: [B, C] eligible confidences sorted
    descending (-inf past the `left` [B] eligible ones).

    Default (spec 3.2): the top n* = max(1, #{n : c_(n) >= 1 - f/(n+1)}). The passing ranks form a prefix
    (c_(n) falls while the bar rises), so this commits exactly the ranks that clear their bar, and rank 1
    regardless. `compat` reproduces NVlabs/Fast-dLLM `get_transfer_index_dynamic`: it commits the ranks before
    the first one under its bar (rank 1's bar is -1: it never fails), all N when none fails, and also all N when
    the first failure is the last rank N (the reference bumps its loop index there). So where the default
    commits N - 1 of N, compat commits N (with 2 masks left, always both); otherwise they agree. f/(n+1) is
    f * (1/(n+1)), as torch divides a number by a tensor, so that per-row factors round as a number does."""
    n = torch.arange(1, ranked.shape[1] + 1, device=ranked.device, dtype=torch.float64)
    count = (ranked >= 1 - per_row(factor, ranked) * (n + 1).reciprocal()).sum(1).clamp(min=1)
    if compat:
        count = torch.where(count == left - 1, left, count)
    return torch.minimum(count, left)


@register("factor")
@dataclass
class Factor(Sampler):
    """Fast-dLLM factor rule: commit the top n while c_(n) >= 1 - f/(n+1) (at least one); `factor_count` has
    the exact count and what `compat` changes."""

    canvas_may_grow: ClassVar[bool] = True
    reads_shards: ClassVar[bool] = True

    factor: float = param(1.0, "f in c_(n) >= 1 - f/(n+1); larger commits more per step", gt=0.0)
    compat: bool = param(False, "reproduce the reference edge case (a failing last rank still commits all)")

    def step(self, ctx: StepContext) -> Commit:
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        confidence = token_probability(ctx.logits, tokens, ctx.unscored)
        count = factor_count(_ranked(confidence, ctx.eligible), ctx.eligible.sum(1), self.factor, self.compat)
        return Commit(top_k_per_row(confidence, ctx.eligible, count), tokens, confidence)
