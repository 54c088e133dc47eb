"""WeDLM's fill rule (Liu et al., arXiv 2512.22737, streaming parallel decoding; Tencent/WeDLM
`wedlm/engine/sampler.py`, spec `wedlm.md` 2.3): which masks of the sliding window to fill in one step, and the
greedy token of each.

A mask's score is its entropy plus `pos_penalty` times its distance in slots from the window's first mask; every
mask scoring strictly below `entropy_threshold` is filled, and when none does (or the threshold is None) the single
lowest score, so each step fills at least one. As the authors' engine, the entropy is computed from the raw logits
(no temperature) in the logits' own dtype: bf16 on real checkpoints, where it differs from the float32 entropy by up
to ~0.06 nats (spec section 7, question 3); pass float32 logits for the float32 rule.

The sampler `wedlm` applies it on the window layout (`engine.layouts.SlidingWindow`: W live slots after each row's
committed prefix, filled slots ranked before masks), the only layout it runs on, and only on a causal model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from dllm.core.params import param

from .base import Commit, Sampler, StepContext, gumbel_argmax, per_row, register, row_values

WINDOW_SIZE = 16  # the engine's `wedlm_window_size`
ENTROPY_THRESHOLD = 0.4  # `SamplingParams.wedlm_entropy_threshold`
POS_PENALTY = 0.02  # `SamplingParams.wedlm_pos_penalty_factor`


def logits_dtype_entropy(logits: Tensor) -> Tensor:
    """Entropy (nats) of softmax(logits) over the last dimension, computed in the logits' dtype as torch's
    `Categorical(logits=...).entropy()` computes it, which is what the authors' sampler calls."""
    return torch.distributions.Categorical(logits=logits, validate_args=False).entropy()


def wedlm_fills(logits: Tensor, eligible: Tensor, positions: Tensor, entropy_threshold: Any = ENTROPY_THRESHOLD,
                pos_penalty: Any = POS_PENALTY) -> Tensor:
    """The masks to fill this step, `[B, C]` bool.

    logits `[B, C, V]`: each candidate mask's own row; eligible `[B, C]`: the masks of the row's window; positions
    `[B, C]`: their canvas positions (the distance is counted from each row's first eligible position, the window's
    first mask). `entropy_threshold` (None: one fill per step) and `pos_penalty` are numbers or per-row `[B]`
    tensors (`stack_rows`, NaN for a row's None). The score `entropy + pos_penalty * distance` adds a float32
    distance term to the entropy in the logits' dtype (bf16 logits give a float32 score, as the authors'); ties
    of the fallback go to the first candidate. A row with no eligible mask fills nothing."""
    entropy = logits_dtype_entropy(logits)
    first = positions.masked_fill(~eligible, torch.iinfo(positions.dtype).max).min(1, keepdim=True).values
    distance = (positions - first).float()
    score = (entropy + per_row(pos_penalty, distance) * distance).masked_fill(~eligible, float("inf"))
    if entropy_threshold is None:
        fill = torch.zeros_like(eligible)
    else:
        fill = eligible & (score < per_row(entropy_threshold, score))
    fallback = ~fill.any(1) & eligible.any(1)
    best = torch.zeros_like(eligible).scatter(1, score.argmin(1, keepdim=True), True)
    return fill | (best & fallback[:, None])


def greedy_tokens(logits: Tensor) -> Tensor:
    """The authors' temperature-0 token, `[B, C]`: the argmax of softmax(logits) in the logits' dtype, which is
    the logits' argmax except where rounding makes two probabilities equal (the lower id wins)."""
    return logits.softmax(-1).argmax(-1)


@register("wedlm")
@dataclass
class WeDLM(Sampler):
    """WeDLM's streaming parallel decoding (arXiv 2512.22737; spec `wedlm.md` 2.3, 5): each step fills the masks of
    each row's window `[f, f + window_size)` (f its first unfilled slot) whose entropy plus `pos_penalty` times the
    distance from f is below `entropy_threshold`, else the lowest-scoring one; the window slides as its leading
    filled run is committed. Defaults: the authors' engine, except temperature 0 (every example of their README).
    At T > 0 the tokens are drawn from softmax(logits / T) with each row's generator (the authors draw from the
    global RNG after top-k / top-p, which are not offered here)."""

    slides: ClassVar[bool] = True  # each step a block (`SlidingWindow`), which it decides from alone
    window_size: int = param(WINDOW_SIZE, "W: the masks after the committed prefix a step may fill", ge=1)
    entropy_threshold: float | None = param(ENTROPY_THRESHOLD, "tau: fill every mask whose entropy plus the "
                                            "distance penalty is below this (None: one fill per step)", ge=0.0)
    pos_penalty: float = param(POS_PENALTY, "lambda: nats added per slot of distance from the window's first mask",
                               ge=0.0)

    def check_model(self, config) -> str | None:
        problem = super().check_model(config)
        if problem is None and not getattr(config, "causal", False):
            return ("it decodes WeDLM's sliding window, whose committed tokens must never see later ones (a causal "
                    "model, a wedlm checkpoint); use low_confidence or threshold")
        return problem

    def step(self, ctx: StepContext) -> Commit:
        positions = ctx.positions.expand_as(ctx.eligible)
        fill = wedlm_fills(ctx.logits, ctx.eligible, positions, self.entropy_threshold, self.pos_penalty)
        tokens = greedy_tokens(ctx.logits)
        for b, t in enumerate(row_values(self.temperature, len(tokens))):
            if t:  # row b's draws: one per mask of its own window, so the same in any batch
                own = ctx.eligible[b].nonzero()[:, 0]
                tokens[b, own] = gumbel_argmax(ctx.logits[b, own].float()[None], t, [ctx.generators[b]])[0]
        return Commit(fill, tokens, -logits_dtype_entropy(ctx.logits).float())
