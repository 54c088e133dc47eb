"""Dream's samplers (`diffusion_generate` / `_sample`; spec `baseline_and_fastdllm.md` section 2): tokens from the
tempered top-p/top-k distribution, count from the time grid `linspace(1, eps, steps + 1)`.

Deviations kept on purpose: the count is per row (the reference averages masks over the batch, which breaks
rows with different mask counts), and it is max(1, floor(n (1 - s/t))) for n masks left (all of them on the
last step), where the reference `_sample` takes `int(n * (1 - s / t))`, which is 0 whenever n (1 - s/t) < 1: it
then runs a forward that commits nothing (e.g. step 0 when steps == gen_length, where n (1 - s/t) = 1 - eps),
and the trajectories part from there. MASK is never proposed (see `samplers.base`)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
from torch import Tensor

from dllm.core.params import param

from .base import (Commit, Sampler, StepContext, each_value, per_row, register, row_values, tempered, top_k_per_row,
                   uniform)


@dataclass
class _DreamSampler(Sampler):
    orders_by_token_probability: ClassVar[bool] = False  # by Dream's own confidences of the truncated distribution

    top_p: float | None = param(None, "nucleus sampling mass (None = off)", gt=0.0, le=1.0)
    top_k: int | None = param(None, "keep only the k most likely tokens (None = off)", ge=1)
    eps: float = param(1e-3, "terminal time of the grid linspace(1, eps, steps + 1)", gt=0.0, lt=1.0)

    def truncated(self, logits: Tensor) -> Tensor:
        """The tempered logits (float64) with the tokens outside top-p / top-k at -inf (per row where rows have
        their own)."""
        logits = each_value(self.top_p, partial(keep_top_p, tempered(logits.double(), self.temperature)))
        return each_value(self.top_k, partial(keep_top_k, logits))

    def log_distribution(self, logits: Tensor) -> Tensor:
        """The tempered, truncated distribution the tokens are drawn from (its argmax at T = 0)."""
        return self.truncated(logits).log_softmax(-1).float()

    def propose(self, ctx: StepContext) -> tuple[Tensor, Tensor]:
        """Return (tokens, probabilities) from the tempered, truncated distribution."""
        probs = self.truncated(ctx.logits).softmax(-1)
        temperatures = row_values(self.temperature, len(probs))
        if not any(temperatures):
            return probs.argmax(-1), probs
        tokens = torch.stack([torch.multinomial(p, 1, generator=g)[:, 0] if t and g is not None else p.argmax(-1)
                              for p, g, t in zip(probs, ctx.generators, temperatures)])
        return tokens, probs

    def unmasked_fraction(self, ctx: StepContext, like: Tensor):
        """1 - s/t on the time grid linspace(1, eps, steps + 1): the share of masks this step unmasks."""
        eps = per_row(self.eps, like)
        t = 1 + ctx.step * (eps - 1) / ctx.steps
        s = 1 + (ctx.step + 1) * (eps - 1) / ctx.steps
        return 1 - s / t

    def count(self, ctx: StepContext) -> Tensor:
        left = ctx.eligible.sum(1)
        if ctx.step >= ctx.steps - 1:
            return left
        return torch.floor(left.double() * self.unmasked_fraction(ctx, left.double())).long().clamp(min=1)


def keep_top_p(logits: Tensor, top_p: float | None) -> Tensor:
    """Nucleus truncation: drop the tokens after the first ones whose mass reaches top_p (None or 1: none)."""
    if top_p is None or top_p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    mass_before = sorted_logits.softmax(-1).cumsum(-1) - sorted_logits.softmax(-1)
    drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, mass_before > top_p)
    return logits.masked_fill(drop, float("-inf"))


def keep_top_k(logits: Tensor, top_k: float | None) -> Tensor:
    """Keep the top_k most likely tokens (None: all)."""
    if top_k is None:
        return logits
    kth = logits.topk(min(int(top_k), logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


@dataclass
class _ConfidenceOrder(_DreamSampler):
    alg_temp: float | None = param(None, "sample positions from softmax(confidence / alg_temp) instead of top-k "
                                   "(None or 0: top-k, as Dream)", ge=0.0)

    def confidence(self, tokens: Tensor, probs: Tensor) -> Tensor:
        raise NotImplementedError

    def step(self, ctx: StepContext) -> Commit:
        tokens, probs = self.propose(ctx)
        confidence = self.confidence(tokens, probs)
        count = self.count(ctx)
        mask = top_k_per_row(confidence, ctx.eligible, count)
        alg_temps = row_values(self.alg_temp, len(mask))
        if not any(alg_temps):
            return Commit(mask, tokens, confidence)
        weights = torch.softmax(tempered(confidence, self.alg_temp).masked_fill(~ctx.eligible, float("-inf")), dim=1)
        for row in (row for row, alg_temp in enumerate(alg_temps) if alg_temp):  # sampled positions
            k = int(min(count[row], ctx.eligible[row].sum()))
            mask[row] = False
            if k:
                mask[row, torch.multinomial(weights[row], k, generator=ctx.generators[row])] = True
        return Commit(mask, tokens, confidence)


@register("maskgit_plus")
@dataclass
class MaskGitPlus(_ConfidenceOrder):
    """Dream maskgit_plus: confidence = probability of the proposed token."""

    def confidence(self, tokens, probs):
        return probs.gather(-1, tokens[..., None])[..., 0]


@register("topk_margin")
@dataclass
class TopKMargin(_ConfidenceOrder):
    """Dream topk_margin: confidence = p(top1) - p(top2)."""

    def confidence(self, tokens, probs):
        top2 = probs.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]


@register("entropy")
@dataclass
class Entropy(_ConfidenceOrder):
    """Dream entropy: confidence = negative entropy of the predictive distribution."""

    def confidence(self, tokens, probs):
        return (probs * torch.log(probs + 1e-10)).sum(-1)


@register("origin")
@dataclass
class Origin(_DreamSampler):
    """Dream origin: every masked position unmasks with probability 1 - s/t (all on the last step); a step may
    commit nothing, so a block takes exactly its steps, as Dream's `_sample`."""

    may_commit_nothing: ClassVar[bool] = True

    def step(self, ctx: StepContext) -> Commit:
        tokens, probs = self.propose(ctx)
        if ctx.step >= ctx.steps - 1:
            return Commit(ctx.eligible.clone(), tokens, probs.amax(-1))
        draw = uniform(ctx.eligible.shape, ctx.generators, ctx.logits.device)
        return Commit(ctx.eligible & (draw < self.unmasked_fraction(ctx, draw)), tokens, probs.amax(-1))
