"""LocalLeap (arXiv 2510.07081; spec `prophet_credit_localleap.md` section 3)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F

from dllm.core.params import param

from .base import Commit, Sampler, StepContext, each_value, gumbel_argmax, per_row, register, token_probability
from .fastdllm import threshold_commit


@register("localleap")
@dataclass
class LocalLeap(Sampler):
    """LocalLeap: anchors (confidence >= threshold) let masked neighbours within `radius` commit at the
    relaxed threshold; everything else follows the strict threshold."""

    canvas_may_grow: ClassVar[bool] = True
    reads_shards: ClassVar[bool] = True

    threshold: float = param(0.9, "anchor and strict commit threshold (kappa)", ge=0.0)
    relaxed_threshold: float = param(0.75, "threshold within radius of an anchor (tau <= kappa)", ge=0.0)
    radius: int = param(4, "neighbourhood radius W around each anchor", ge=0)

    def step(self, ctx: StepContext) -> Commit:
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        confidence = token_probability(ctx.logits, tokens, ctx.unscored)
        anchors = ctx.eligible & (confidence >= per_row(self.threshold, confidence))
        near = each_value(self.radius, lambda radius: F.max_pool1d(
            anchors[:, None].float(), 2 * int(radius) + 1, stride=1, padding=int(radius))[:, 0] > 0)
        relaxed = ctx.eligible & near & (confidence >= per_row(self.relaxed_threshold, confidence))
        return Commit(threshold_commit(confidence, ctx.eligible, self.threshold) | relaxed, tokens, confidence)
