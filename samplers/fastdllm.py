"""Fast-dLLM confidence-aware parallel decoding (arXiv 2505.22618; spec `baseline_and_fastdllm.md` 3.1-3.2)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.params import param

from . import register
from .base import Commit, Sampler, StepContext, gumbel_argmax, token_probability, top_k_per_row


def threshold_commit(confidence, eligible, threshold: float):
    """Every eligible position with confidence >= threshold, and always the most confident one."""
    best = top_k_per_row(confidence, eligible, torch.ones_like(eligible[:, 0], dtype=torch.long))
    return best | (eligible & (confidence >= threshold))


def _ranked(confidence, eligible):
    score = confidence.masked_fill(~eligible, float("-inf"))
    return score.sort(dim=1, descending=True, stable=True).values


@register("threshold")
@dataclass
class Threshold(Sampler):
    """Fast-dLLM threshold rule: commit every masked block position with confidence >= threshold, and always
    the most confident one."""

    threshold: float = param(0.9, "commit positions whose probability reaches this (> 1 = one per step)", ge=0.0)

    def step(self, ctx: StepContext) -> Commit:
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generator)
        confidence = token_probability(ctx.logits, tokens)
        return Commit(threshold_commit(confidence, ctx.eligible, self.threshold), tokens, confidence)


@register("factor")
@dataclass
class Factor(Sampler):
    """Fast-dLLM factor rule: commit the top n while (n + 1)(1 - c_(n)) < factor (at least one)."""

    factor: float = param(1.0, "f in c_(n) >= 1 - f/(n+1); larger commits more per step", gt=0.0)
    compat: bool = param(False, "reproduce the reference off-by-one (a failing last rank still commits all)")

    def step(self, ctx: StepContext) -> Commit:
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generator)
        confidence = token_probability(ctx.logits, tokens)
        ranked = _ranked(confidence, ctx.eligible)
        n = torch.arange(1, ranked.shape[1] + 1, device=ranked.device, dtype=torch.float64)
        passes = ranked >= 1 - self.factor / (n + 1)
        left = ctx.eligible.sum(1)
        if self.compat:  # stop at the first failing rank; if it is the last eligible one (or none fails) take all
            failed = ~passes & (n[None] <= left[:, None])
            first_fail = torch.where(failed.any(1), failed.float().argmax(1), left)
            count = torch.where(first_fail >= left - 1, left, first_fail)
        else:
            count = passes.sum(1)
        return Commit(top_k_per_row(confidence, ctx.eligible, count.clamp(min=1)), tokens, confidence)
