"""CreditDecoding (arXiv 2510.06133; spec `prophet_credit_localleap.md` section 2)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dllm.core.params import param

from .base import Commit, Sampler, StepContext, each_value, gumbel_argmax, per_row, register, token_probability


def near_best_or_threshold(confidence: Tensor, eligible: Tensor, threshold) -> Tensor:
    """dInfer's threshold rule (`parallel_strategy.py::get_transfer_index_threshold`): every eligible position
    whose confidence reaches min(threshold, best - 1e-5), so when none reaches the threshold every one within
    1e-5 of the best commits (Fast-dLLM's rule commits the first best alone)."""
    best = confidence.masked_fill(~eligible, float("-inf")).amax(1, keepdim=True)
    return eligible & (confidence >= (best - 1e-5).clamp(max=per_row(threshold, confidence)))


@register("credit")
@dataclass
class Credit(Sampler):
    """CreditDecoding (arXiv 2510.06133): decaying per-token trace credits fused into the logits, then the
    threshold rule; credits reset every block.

    No code of the paper's was found; this follows its closest code, inclusionAI/dInfer's
    `CreditThresholdParallelDecoder`: the credits and fused logits in float32, log(credit + 1), and dInfer's
    threshold rule (`near_best_or_threshold`). dInfer also never commits a position whose prediction is the mask
    token; here MASK is never proposed (`samplers.base`), so such a position commits its best other token."""

    threshold: float = param(0.9, "commit fused confidence >= this (else every one within 1e-5 of the best)",
                             ge=0.0)
    alpha: float = param(0.65, "fusion strength: logits + alpha * log(1 + credit)", ge=0.0)
    beta: float = param(0.7, "credit decay per step", ge=0.0, lt=1.0)
    gamma: float = param(0.2, "concave exponent: the top-1 earns p ** gamma", gt=0.0)
    tuning_free: bool = param(False, "gamma = 1, alpha = beta = 1 - (masked fraction of the block)")

    def step(self, ctx: StepContext) -> Commit:
        logits = ctx.logits.float()
        top_p, top_token = torch.softmax(logits, -1).max(-1)
        alpha, beta, gamma = per_row(self.alpha, logits), per_row(self.beta, logits), self.gamma
        if self.tuning_free:
            masked_fraction = ctx.eligible.sum(1, keepdim=True).float() / ctx.eligible.shape[1]
            alpha = beta = (1 - masked_fraction)[..., None]
            gamma = 1.0
        credit = getattr(ctx.state, "credit", None)  # [B, C, V], this run's
        if ctx.step == 0 or credit is None or credit.shape != logits.shape:
            credit = ctx.state.credit = torch.zeros_like(logits)  # per block: reset
        else:
            credit *= beta
        earned = each_value(gamma, top_p.pow)  # a power rounds unlike a number's with a tensor exponent
        gain = torch.where(ctx.eligible, earned, 0.0)  # only masked positions of the block earn credit
        credit.scatter_add_(-1, top_token[..., None], gain[..., None])
        fused = logits + alpha * torch.log(credit + 1)  # as dInfer (not log1p: it rounds otherwise)
        tokens = gumbel_argmax(fused, self.temperature, ctx.generators)
        confidence = token_probability(fused, tokens, ctx.unscored)
        return Commit(near_best_or_threshold(confidence, ctx.eligible, self.threshold), tokens, confidence,
                      logits=fused)
