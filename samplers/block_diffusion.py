"""Decoding rules that ship with block-diffusion models (spec `block_diffusion_moe.md`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.params import param

from . import register
from .base import Commit, Sampler, StepContext, gumbel_argmax, token_probability, top_k_per_row


@register("low_confidence_dynamic")
@dataclass
class LowConfidenceDynamic(Sampler):
    """SDAR's default (JetAstra/SDAR `generate.py`, `low_confidence_dynamic`): commit every masked block
    position whose probability exceeds the threshold when there are at least the step's scheduled count of
    them, else the scheduled count of most probable ones. The schedule splits the block evenly over the steps,
    the larger shares first; a step past the schedule commits what is left."""

    threshold: float = param(0.85, "commit positions above this probability (SDAR: 0.85)", ge=0.0)

    def step(self, ctx: StepContext) -> Commit:
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        confidence = token_probability(ctx.logits, tokens)
        size, eligible = ctx.block_end - ctx.block_start, ctx.eligible
        scheduled = size // ctx.steps + int(ctx.step < size % ctx.steps) if ctx.step < ctx.steps else size
        above = eligible & (confidence > self.threshold)
        count = torch.full_like(eligible[:, 0], max(scheduled, 1), dtype=torch.long)  # >= 1: the loop's rule
        enough = above.sum(1) >= count
        mask = torch.where(enough[:, None], above, top_k_per_row(confidence, eligible, count))
        return Commit(mask, tokens, confidence)
