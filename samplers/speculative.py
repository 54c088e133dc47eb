"""Lossless self-speculative decoding (FreeDave arXiv 2510.00294, `draft_verification_vectorized`; the linear
chain of SSD arXiv 2510.04147; spec `adablock_selfspec.md` part B).

Stepwise decoding commits the single most confident masked position per forward. One forward already ranks
every masked position, so the next K stepwise states can be guessed from it: draft d_k fills the top k+1.
One batched forward over the drafts gives F(d_k); d_{k+1} is right exactly when F(d_k) picks the position and
token that d_{k+1} added. The longest right chain is committed and its forward is the next step's, so a round
costs one forward and the output is the stepwise output, token for token."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dllm.core.errors import DllmError
from dllm.core.params import param

from . import register
from .base import Commit, Sampler, StepContext, row_values, token_probability, top_k_per_row

DRAFT_STEPS = {"llada": 4, "dream": 8}  # FreeDave's K per model family


def stepwise_choice(logits, eligible, unscored=None):
    """The stepwise decoder's next commit: argmax token at the most probable eligible position (ties: lowest
    position), as `low_confidence` with one token per step (`unscored`: `StepContext.unscored`). Returns (mask,
    tokens, confidence)."""
    tokens = logits.argmax(-1)
    confidence = token_probability(logits, tokens, unscored)
    one = torch.ones(eligible.shape[:-1], dtype=torch.long, device=eligible.device)
    return top_k_per_row(confidence.flatten(0, -2), eligible.flatten(0, -2), one.flatten()).view_as(eligible), \
        tokens, confidence


@register("speculative")
@dataclass
class Speculative(Sampler):
    """Lossless self-speculative decoding (FreeDave / SSD linear chain): output identical to one-token-per-step
    low_confidence decoding at temperature 0, with fewer forwards (except that the verification forward of the
    step whose commit ends a row is spent for nothing: with K = 1 that can be one forward more)."""

    drafts: ClassVar[bool] = True
    draft_steps: int | None = param(None, "K: nested drafts verified per forward (None: 4 for LLaDA, 8 for Dream, "
                                    "FreeDave's)", ge=1)

    def __post_init__(self):
        super().__post_init__()
        if self.temperature != 0:
            raise DllmError("sampler 'speculative' is lossless for greedy decoding only; set temperature=0")

    def step(self, ctx: StepContext) -> Commit:
        first, tokens, confidence = stepwise_choice(ctx.logits, ctx.eligible, ctx.unscored)
        masks_left = int(ctx.eligible.sum(1).max())
        own = [int(k or DRAFT_STEPS[ctx.family]) for k in row_values(self.draft_steps, len(first))]  # each row's K
        # a draft that fills the block needs no forward of its own
        n = min(max(own), masks_left - 1)
        if n < 1 or ctx.forward is None:
            return Commit(first, tokens, confidence)
        # draft k commits the top k+1 positions of this forward's ranking
        score = confidence.masked_fill(~ctx.eligible, float("-inf"))
        order = score.sort(dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
        window = ctx.canvas[:, ctx.positions]
        k = torch.arange(n, device=rank.device)[None, :, None]
        fill = ctx.eligible[:, None] & (rank[:, None] <= k)  # [B, n, C]
        drafts = torch.where(fill, tokens[:, None], window[:, None])
        logits = ctx.forward(drafts)  # [B, n, C, V]
        # target of draft j: its stepwise successor; draft j+1 is right when it equals that target
        still = ctx.eligible[:, None] & ~fill
        nxt, nxt_tokens, _ = stepwise_choice(logits, still, ctx.unscored)
        targets = torch.where(nxt, nxt_tokens, drafts)
        right = (drafts[:, 1:] == targets[:, :-1]).all(-1)  # [B, n-1]
        best = right.long().cumprod(1).sum(1)  # length of the right chain after d_0, which is always right
        best = best.clamp(max=torch.tensor(own, device=best.device) - 1)  # at most a row's own K drafts
        return Commit(fill[torch.arange(len(best)), best], tokens, confidence, verified=best)
