"""DUS, the dilated unmasking scheduler (spec `strategies_2026.md` section 7): a plan per block, confidence-free."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dllm.core.params import param

from .base import Commit, Sampler, StepContext, gumbel_argmax, per_row, register, row_values, token_probability


@register("dus")
@dataclass
class DUS(Sampler):
    """DUS, the dilated unmasking scheduler (Luxembourg et al., arXiv 2506.19037; omerlux/DUS
    `generate_scheduled`): each block is split by a plan fixed in advance into levels of far-apart positions
    (about log_base(block) of them), and each step commits the model's argmax at every masked position of the next
    level, whatever its confidence. A block takes as many forwards as its plan has levels, whatever `steps` says.

    Defaults: the paper's method (dilated, base 2, skip 1, every planned token committed); the authors' README run
    adds `threshold=0.3` (and blocks of 32 over 256 tokens), their harness `scheduler="binary"`. With a threshold,
    the positions of a level (not the last) whose float64 probability is below it are given up: never revisited,
    they stay masked in the answer (token ids keep the mask id; texts leave it out, as the authors' harness
    decodes without special tokens). `remasking="high_entropy"` gives up where the entropy is below the threshold,
    as the authors' code does (the confident positions, despite the name). At T > 0 the probability is the model's
    (theirs is taken from the noise-perturbed scores)."""

    commits_known_ahead: ClassVar[bool] = True  # the plan names the next step's positions

    scheduler: str = param("dilated", "dilated: coarse to fine on strides block / base^skip, / base, ... 1; binary: "
                                      "midpoints of the halves, depth by depth", choices=("dilated", "binary"))
    base: int = param(2, "dilation base a: each level's stride is the last one's / a (dilated)", ge=1)
    skip: int = param(1, "the first stride is the block / base^skip (dilated)", ge=1)
    threshold: float = param(0.0, "give up planned positions (not of a block's last level) scoring below this; they "
                                  "stay masked (0: never; the authors' README: 0.3)", ge=0.0)
    remasking: str = param("low_confidence", "what the threshold scores: the token's probability, or (the "
                                             "authors' high_entropy) the entropy in nats",
                           choices=("low_confidence", "high_entropy"))

    @property
    def leaves_masks(self) -> bool:
        return self.threshold > 0

    def step(self, ctx: StepContext) -> Commit:
        """State: `levels` `[B, C]`, each block position's level in its row's plan; `next` `[B, L]`, the positions
        the next step scores."""
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        confidence = token_probability(ctx.logits, tokens, ctx.unscored)
        state, rows = ctx.state, len(tokens)
        if ctx.step == 0:
            state.levels = torch.tensor([levels_of(ctx.block_end - ctx.block_start, self.scheduler, int(a), int(s))
                                         for a, s in zip(row_values(self.base, rows), row_values(self.skip, rows))],
                                        device=tokens.device)
        levels = state.levels
        now = first_level(levels, ctx.eligible)
        planned = ctx.eligible & (levels == now)
        given_up = None
        if any(t > 0 for t in row_values(self.threshold, rows)):
            score = remasking_score(ctx.logits, tokens, self.remasking)
            last = now == levels.amax(1, keepdim=True)
            given_up = planned & ~last & (score < per_row(self.threshold, score))
        left = ctx.eligible & ~planned
        state.next = torch.zeros_like(ctx.canvas, dtype=torch.bool)
        state.next[:, ctx.positions] = left & (levels == first_level(levels, left))
        commit = planned if given_up is None else planned & ~given_up
        return Commit(commit, tokens, confidence, given_up=given_up)

    def next_commits(self, state) -> Tensor | None:
        return getattr(state, "next", None)


def first_level(levels: Tensor, open_positions: Tensor) -> Tensor:
    """`[B, 1]` the lowest level with an open position in each row (past the last level where none is)."""
    return levels.masked_fill(~open_positions, levels.shape[1]).amin(1, keepdim=True)


def remasking_score(logits: Tensor, tokens: Tensor, remasking: str) -> Tensor:
    """`[B, C]` float64: the tokens' probabilities (low_confidence) or the entropies in nats (high_entropy)."""
    probs = logits.double().softmax(-1)
    if remasking == "high_entropy":
        return torch.special.entr(probs).sum(-1)
    return probs.gather(-1, tokens[..., None])[..., 0]


@functools.cache
def levels_of(length: int, scheduler: str, base: int, skip: int) -> tuple[int, ...]:
    """The level of each block offset `0..length-1` in DUS's plan; a last level shorter than the one before it
    joins it."""
    levels = dilated_levels(length, base, skip) if scheduler == "dilated" else binary_levels(length)
    if len(levels) >= 2 and len(levels[-1]) < len(levels[-2]):
        last = levels.pop()
        levels[-1] += last
    level_of = [0] * length
    for level, offsets in enumerate(levels):
        for offset in offsets:
            level_of[offset] = level
    return tuple(level_of)


def dilated_levels(length: int, base: int, skip: int) -> list[list[int]]:
    """Coarse to fine: the offsets on a stride of `length // base**skip`, then on that stride divided (floor) by
    `base` again and again while it is at least 1, each level the offsets no level before lists; the offsets left
    (a stride sequence that jumps over 1) last. Base 1: the whole block at once."""
    if base == 1:
        return [list(range(length))]
    levels, listed, stride = [], set(), length // base ** skip
    while stride >= 1:
        level = [offset for offset in range(0, length, stride) if offset not in listed]
        if level:
            levels.append(level)
            listed.update(level)
        stride //= base
    rest = [offset for offset in range(length) if offset not in listed]
    return levels + [rest] if rest else levels


def binary_levels(length: int) -> list[list[int]]:
    """Binary-search order: the block's midpoint, then the midpoints of the spans either side of it, depth by
    depth."""
    levels, spans = [], [(0, length - 1)]
    while spans:
        mids = [(lo + hi) // 2 for lo, hi in spans]
        levels.append(mids)
        spans = [span for (lo, hi), mid in zip(spans, mids) for span in ((lo, mid - 1), (mid + 1, hi))
                 if span[0] <= span[1]]
    return levels
