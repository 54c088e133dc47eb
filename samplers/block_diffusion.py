"""Decoding rules that ship with block-diffusion models (spec `block_diffusion_moe.md`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dllm.core.params import param

from .base import (CausalFirst, Commit, Sampler, StepContext, entropy_bounded, gumbel_argmax, per_row, quota, register,
                   tempered, token_entropy, token_probability, top_k_per_row)
from .fastdllm import threshold_commit


def sampled_probability(logits, tokens, temperature, unscored=None):
    """Probability of the sampled `tokens` under the distribution they were drawn from, softmax(logits / T),
    as the confidence of SDAR's and Fast-dLLM v2's samplers (the plain softmax at T = 0)."""
    return token_probability(tempered(logits, temperature), tokens, unscored)


@register("low_confidence_dynamic")
@dataclass
class LowConfidenceDynamic(Sampler):
    """SDAR's default (JetAstra/SDAR `generate.py`, `low_confidence_dynamic`, threshold 0.85) and LLaDA2.0's
    rule (inclusionAI/dFactory `generate`: the same rule at threshold 0.95, 32 steps per block of 32): commit
    every masked block position whose probability exceeds the threshold when there are at least the step's
    scheduled count of them, else the scheduled count of most probable ones. The schedule splits the block
    evenly over the steps, the larger shares first; a step past the schedule commits what is left. At T > 0 the
    probabilities are the tempered ones the tokens were drawn from, as in SDAR."""

    reads_shards: ClassVar[bool] = True

    threshold: float = param(0.85, "commit positions above this probability (SDAR: 0.85, LLaDA2.0: 0.95)", ge=0.0)

    def step(self, ctx: StepContext) -> Commit:
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        confidence = sampled_probability(ctx.logits, tokens, self.temperature, ctx.unscored)
        size, eligible = ctx.block_end - ctx.block_start, ctx.eligible
        scheduled = size // ctx.steps + int(ctx.step < size % ctx.steps) if ctx.step < ctx.steps else size
        above = eligible & (confidence > per_row(self.threshold, confidence))
        count = torch.full_like(eligible[:, 0], max(scheduled, 1), dtype=torch.long)  # >= 1: the loop's rule
        enough = above.sum(1) >= count
        mask = torch.where(enough[:, None], above, top_k_per_row(confidence, eligible, count))
        return Commit(mask, tokens, confidence)


@register("leftmost")
@dataclass
class Leftmost(CausalFirst):
    """vLLM's `selection_policy=leftmost` for Nemotron-Labs-Diffusion (PR 48279, `_compiled_masked_step`): the
    scheduled number of masked positions (LLaDA's even schedule), leftmost first whatever their confidence, so a
    block is revealed left to right as a policy's per-token log-probabilities assume."""

    def choose(self, ctx: StepContext) -> Commit:
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        first = ctx.eligible & (ctx.eligible.long().cumsum(1) <= quota(ctx)[:, None])
        return Commit(first, tokens, token_probability(ctx.logits, tokens, ctx.unscored))


@register("entropy_bounded")
@dataclass
class EntropyBounded(Sampler):
    """SDAR's entropy-bounded rule (JetAstra's engine, `entropy_bounded`, bound 0.35): order the block's masked
    positions by the entropy of their predicted distribution, lowest first, and commit the longest prefix
    whose entropies sum below the bound (at least one): the entropy bound of `eb_sampler` as SDAR's engine reads
    it (`base.entropy_bounded`)."""

    reads_shards: ClassVar[bool] = True
    orders_by_token_probability: ClassVar[bool] = False  # by entropy

    bound: float = param(0.35, "commit the lowest-entropy positions while their entropies sum below this (nats)",
                         gt=0.0)

    def step(self, ctx: StepContext) -> Commit:
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        chosen = entropy_bounded(token_entropy(ctx.logits), ctx.eligible, self.bound, sdar=True)
        return Commit(chosen, tokens, token_probability(ctx.logits, tokens, ctx.unscored))


@register("sub_block")
@dataclass
class SubBlock(Sampler):
    """Fast-dLLM v2's rule (NVlabs/Fast-dLLM `v2`, `small_block_size` 8, threshold 0.9): a block's first token
    comes alone from the logit of the position before it, as an autoregressive step (the reference reads it off
    the forward that caches the finished block; here the block-start forward, which the block cache also uses
    to store the finished block, so the forwards are as many; a block that the prompt ends in has no such step,
    as in v2); then the block is decoded in sub-blocks, left to right: inside the leftmost sub-block with masks,
    every position above the threshold and always the most confident one. At T > 0 confidences are the
    tempered probabilities the tokens were drawn from."""

    reads_shards: ClassVar[bool] = True

    threshold: float = param(0.9, "commit positions whose probability exceeds this (Fast-dLLM v2: 0.9)", ge=0.0)
    sub_block: int = param(8, "sub-block length, filled left to right (Fast-dLLM v2: 8)", ge=1)
    first_token: bool = param(True, "commit the block's first masked position alone at its first step")

    def step(self, ctx: StepContext) -> Commit:
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        confidence = sampled_probability(ctx.logits, tokens, self.temperature, ctx.unscored)
        offset = ctx.positions - ctx.block_start  # [C]
        first = torch.where(ctx.eligible, offset, offset.max() + 1).amin(1, keepdim=True)  # leftmost mask
        size = per_row(self.sub_block, first)
        current = ctx.eligible & (offset // size == first // size)
        mask = threshold_commit(confidence, current, self.threshold, strict=True)  # strictly above, as v2
        if self.first_token and ctx.step == 0:  # a block that starts with a mask (not one shared with the prompt)
            mask = torch.where(first == 0, ctx.eligible & (offset == first), mask)
        return Commit(mask, tokens, confidence)


@register("joint_threshold")
@dataclass
class JointThreshold(Sampler):
    """LLaDA2.1's token editing (SGLang `JointThreshold`; spec section 2): each step commits the block's masked
    positions above `threshold` (at least the most probable one) and rewrites decoded answer tokens of the
    block whose argmax differs with probability above `edit_threshold`. Once the block has no masks, up to
    `edit_steps` more steps edit; a row's block ends at a step that changes nothing. The prompt and finished
    blocks are never edited, so the block caches stay exact. Defaults: ZHZisZZ/dllm's (0.95 / 0.9 / 16);
    SGLang's are 0.5 / 0 / 16."""

    reads_shards: ClassVar[bool] = True

    edits = True
    threshold: float = param(0.95, "commit masked positions above this probability (mask -> token)", ge=0.0)
    edit_threshold: float = param(0.9, "rewrite a decoded token when another is more probable than this "
                                       "(token -> token)", ge=0.0)
    edit_steps: int = param(16, "steps of editing allowed after the block's last mask is filled", ge=0)

    def step(self, ctx: StepContext) -> Commit:
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        confidence = token_probability(ctx.logits, tokens, ctx.unscored)
        state = ctx.state
        if ctx.step == 0:
            state.edit_steps = torch.zeros_like(ctx.eligible[:, 0], dtype=torch.long)  # steps without masks
            state.done = torch.zeros_like(ctx.eligible[:, 0])  # rows whose block has ended
        state.edit_steps += ~ctx.eligible.any(1) & ~state.done
        commit = ctx.eligible & ((confidence > per_row(self.threshold, confidence)) | top_k_per_row(
            confidence, ctx.eligible, torch.ones_like(state.edit_steps)))
        edit = ctx.editable & ~state.done[:, None] & (confidence > per_row(self.edit_threshold, confidence))
        edit &= tokens != ctx.canvas[:, ctx.positions]
        again = (commit.any(1) | edit.any(1)) & (state.edit_steps < per_row(self.edit_steps, state.edit_steps))
        state.done |= ~again & ~(ctx.eligible & ~commit).any(1)
        return Commit(commit, tokens, confidence, edit=edit, again=again)
