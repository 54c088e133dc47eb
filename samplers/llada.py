"""LLaDA's remasking samplers (ML-GSAI/LLaDA `generate.py`; spec `baseline_and_fastdllm.md` section 1):
a fixed number of tokens per step from the linear schedule, chosen by confidence or at random."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import register
from .base import Commit, Sampler, StepContext, gumbel_argmax, quota, token_probability, top_k_per_row


@register("low_confidence")
@dataclass
class LowConfidence(Sampler):
    """LLaDA low-confidence remasking: commit the scheduled number of most probable predictions."""

    def step(self, ctx: StepContext) -> Commit:
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generator)
        confidence = token_probability(ctx.logits, tokens)
        return Commit(top_k_per_row(confidence, ctx.eligible, quota(ctx)), tokens, confidence)


@register("random")
@dataclass
class RandomRemasking(Sampler):
    """LLaDA random remasking: commit the scheduled number of predictions at random positions."""

    def step(self, ctx: StepContext) -> Commit:
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generator)
        confidence = torch.rand(ctx.eligible.shape, dtype=torch.float64, device=ctx.logits.device,
                                generator=ctx.generator)
        return Commit(top_k_per_row(confidence, ctx.eligible, quota(ctx)), tokens, confidence)
