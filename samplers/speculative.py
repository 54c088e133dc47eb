"""Lossless self-speculative decoding (FreeDave arXiv 2510.00294, cychomatica/FreeDave `generation/core.py`
`block_decode_with_full_attention_FreeDave`; the linear chain of SSD arXiv 2510.04147; spec `adablock_selfspec.md`
part B, `strategies_2026.md` section 9).

Stepwise decoding commits the single most confident masked position per forward. One forward already ranks
every masked position, so the next K stepwise states can be guessed from it: draft d_k fills the top k+1.
One batched forward over the drafts gives F(d_k); d_{k+1} is right exactly when F(d_k) picks the position and
token that d_{k+1} added. The longest right chain is committed and its forward is the next step's, so a round
costs one forward and the output is the stepwise output, token for token.

With a threshold (FreeDave++) d_0 is the threshold step (every position whose probability reaches it, else the
most probable) and d_k adds the top k of the rest, as FreeDave's `token_transfer` drafts them; the rule is then
the threshold rule. FreeDave++ accepts a draft whose positions are a subset of a target (`match_rule='subset'`),
which can commit a state threshold decoding never reaches; here a draft is accepted only when it equals the
target, so the output is threshold decoding's, token for token, in at most its forwards."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dllm.core.errors import DllmError
from dllm.core.params import param

from .base import Commit, Sampler, StepContext, register, row_values, token_probability
from .fastdllm import threshold_commit

DRAFT_STEPS = {"llada": 4, "dream": 8}  # FreeDave's K per model family


@register("speculative")
@dataclass
class Speculative(Sampler):
    """Lossless self-speculative decoding (FreeDave arXiv 2510.00294 / SSD linear chain): stepwise output in fewer
    forwards.

    At temperature 0 its output is one-token-per-step low_confidence decoding's (with `threshold`: threshold
    decoding's; with `force_first`: theirs after each block's forced first token, FreeDave's static reference), in
    fewer forwards (except that the verification forward of the step whose commit ends a row is spent for nothing:
    with K = 1 that can be one forward more)."""

    reads_shards: ClassVar[bool] = True
    drafts: ClassVar[bool] = True
    draft_steps: int | None = param(None, "K: nested drafts verified per forward (None: 4 for LLaDA, 8 for Dream, "
                                    "FreeDave's)", ge=1)
    threshold: float | None = param(None, "FreeDave++: decode as sampler threshold at this threshold (each step every "
                                    "position whose probability reaches it, else the most probable); None: one "
                                    "position per step", ge=0.0)
    force_first: bool = param(False, "commit each block's first position from the block-start forward whatever its "
                                     "probability, and read no logits for it after (FreeDave's Dream path; on Dream "
                                     "the caches then keep the row before the block as the block start left it)")
    verify: str = param("tree", "how the drafts share the verifying forward: tree (FreeDave's tree attention: the "
                                "drafts as extra rows of each row; measured faster on a CPU) or batch (a copy of each "
                                "row per draft on a forked store)", choices=("tree", "batch"))

    def __post_init__(self):
        super().__post_init__()
        if self.temperature != 0:
            raise DllmError("sampler 'speculative' is lossless for greedy decoding only; set temperature=0")

    def logit_window(self, prompt_length: int, length: int, start: int, end: int, step: int) -> tuple[int, int]:
        return (start + 1, end) if self.force_first and step > 0 else (start, end)

    def rule(self, confidence, eligible):
        """What one step of the decoder it equals commits: the most probable eligible position, and with a
        threshold every one whose probability reaches it."""
        return threshold_commit(confidence, eligible, float("inf") if self.threshold is None else self.threshold)

    def step(self, ctx: StepContext) -> Commit:
        eligible = ctx.eligible
        tokens = ctx.logits.argmax(-1)
        confidence = token_probability(ctx.logits, tokens, ctx.unscored)
        first = self.rule(confidence, eligible)
        if self.force_first and ctx.step == 0:
            forced = eligible & (ctx.positions == ctx.block_start)
            first = torch.where(forced.any(1, keepdim=True), forced, first)
        rest = eligible & ~first
        left = rest.sum(1)  # [B] masks d_0 leaves
        own = [int(k or DRAFT_STEPS[ctx.family]) for k in row_values(self.draft_steps, len(first))]  # each row's K
        # drafts that leave a mask; one that fills the block needs no forward of its own
        n = min(max(own), int(left.max()))
        if n < 1 or ctx.forward is None:
            return Commit(first, tokens, confidence)
        own = torch.tensor(own, device=left.device)
        # draft k: d_0 and the top k of the rest by this forward's ranking (ties: lowest position)
        order = confidence.masked_fill(~rest, float("-inf")).sort(dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device)
                                                .expand_as(order))
        k = torch.arange(n, device=rank.device)
        fill = first[:, None] | (rest[:, None] & (rank[:, None] < k[None, :, None]))  # [B, n, C]
        drafts = torch.where(fill, tokens[:, None], ctx.canvas[:, ctx.positions][:, None])
        logits = ctx.forward(drafts, self.verify == "tree")  # [B, n, C, V]
        # target of draft i: its successor by the rule; from d_0 (right by construction) move to the draft equal to
        # the target of the last one reached, among a row's own K drafts that leave a mask
        after = logits.argmax(-1)
        targets = torch.where(self.rule(token_probability(logits, after, ctx.unscored), eligible[:, None] & ~fill), after, drafts)
        agree = (drafts[:, None] == targets[:, :, None]).all(-1)  # [B, i, j]: d_j == target of d_i
        agree &= torch.ones(n, n, dtype=torch.bool, device=k.device).triu(1)
        agree &= ((k[None] < own[:, None]) & (k[None] < left[:, None]))[:, None]
        best = torch.zeros_like(left)
        for _ in range(n - 1):
            reached = agree[torch.arange(len(best), device=best.device), best]  # [B, n]
            best = torch.where(reached, k, -1).max(1).values.clamp(min=best)
        return Commit(fill[torch.arange(len(best), device=best.device), best], tokens, confidence, verified=best)
