"""LLaDA's remasking samplers (ML-GSAI/LLaDA `generate.py`; spec `baseline_and_fastdllm.md` section 1):
a fixed number of tokens per step from the linear schedule, chosen by confidence or at random."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor

from .base import (CausalFirst, Commit, Sampler, StepContext, gumbel_argmax, quota, register, token_probability,
                   top_k_per_row, uniform)


@register("low_confidence")
@dataclass
class LowConfidence(CausalFirst):
    """LLaDA low-confidence remasking: commit the scheduled number of most probable predictions."""

    canvas_may_grow: ClassVar[bool] = True  # its quota spreads the masks left (inserted ones too) over the steps left

    def choose(self, ctx: StepContext) -> Commit:
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        confidence = token_probability(ctx.logits, tokens, ctx.unscored)
        return Commit(top_k_per_row(confidence, ctx.eligible, quota(ctx)), tokens, confidence)


@register("random")
@dataclass
class RandomRemasking(Sampler):
    """LLaDA random remasking: commit the scheduled number of predictions at random positions.

    The random order is drawn once per block (as dKV-Cache-Greedy's reference does; the same law as fresh
    draws every step), so the next step's commits are known before its forward."""

    reads_shards: ClassVar[bool] = True
    commits_known_ahead: ClassVar[bool] = True

    def step(self, ctx: StepContext) -> Commit:
        """State: `order` [B, C], the block's random scores; `next` [B, L], the next step's commits."""
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        if ctx.step == 0:
            ctx.state.order = uniform(ctx.eligible.shape, ctx.generators, ctx.logits.device)
        order = ctx.state.order
        mask = top_k_per_row(order, ctx.eligible, quota(ctx))
        following = replace(ctx, eligible=ctx.eligible & ~mask, step=ctx.step + 1)
        ctx.state.next = torch.zeros_like(ctx.canvas, dtype=torch.bool)
        ctx.state.next[:, ctx.positions] = top_k_per_row(order, following.eligible, quota(following))
        return Commit(mask, tokens, order)

    def next_commits(self, state) -> Tensor | None:
        return getattr(state, "next", None)
