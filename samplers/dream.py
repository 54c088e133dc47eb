"""Dream's samplers (`diffusion_generate` / `_sample`; spec `baseline_and_fastdllm.md` section 2): tokens from the
tempered top-p/top-k distribution, count from the time grid `linspace(1, eps, steps + 1)`.

Deviations kept on purpose: the count is per row (the reference averages masks over the batch, which breaks
rows with different mask counts), and it is max(1, floor(n (1 - s/t))) for n masks left (all of them on the
last step), where the reference `_sample` takes `int(n * (1 - s / t))`, which is 0 whenever n (1 - s/t) < 1: it
then runs a forward that commits nothing (e.g. step 0 when steps == gen_length, where n (1 - s/t) = 1 - eps),
and the trajectories part from there. MASK is never proposed (see `samplers.base`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dllm.core.params import param

from . import register
from .base import Commit, Sampler, StepContext, top_k_per_row, uniform


@dataclass
class _DreamSampler(Sampler):
    top_p: float | None = param(None, "nucleus sampling mass (None = off)", gt=0.0, le=1.0)
    top_k: int | None = param(None, "keep only the k most likely tokens (None = off)", ge=1)
    eps: float = param(1e-3, "terminal time of the grid linspace(1, eps, steps + 1)", gt=0.0, lt=1.0)

    def truncated(self, logits: Tensor) -> Tensor:
        """The tempered logits (float64) with the tokens outside top-p / top-k at -inf."""
        logits = logits.double()
        if self.temperature > 0:
            logits = logits / self.temperature
        if self.top_p is not None and self.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            mass_before = sorted_logits.softmax(-1).cumsum(-1) - sorted_logits.softmax(-1)
            drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, mass_before > self.top_p)
            logits = logits.masked_fill(drop, float("-inf"))
        if self.top_k is not None:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return logits

    def log_distribution(self, logits: Tensor) -> Tensor:
        """The tempered, truncated distribution the tokens are drawn from (its argmax at T = 0)."""
        return self.truncated(logits).log_softmax(-1).float()

    def propose(self, ctx: StepContext) -> tuple[Tensor, Tensor]:
        """Return (tokens, probabilities) from the tempered, truncated distribution."""
        probs = self.truncated(ctx.logits).softmax(-1)
        if self.temperature > 0:
            tokens = torch.stack([p.argmax(-1) if g is None else torch.multinomial(p, 1, generator=g)[:, 0]
                                  for p, g in zip(probs, ctx.generators)])
        else:
            tokens = probs.argmax(-1)
        return tokens, probs

    def count(self, ctx: StepContext) -> Tensor:
        left = ctx.eligible.sum(1)
        if ctx.step >= ctx.steps - 1:
            return left
        t = 1 + ctx.step * (self.eps - 1) / ctx.steps
        s = 1 + (ctx.step + 1) * (self.eps - 1) / ctx.steps
        return torch.floor(left.double() * (1 - s / t)).long().clamp(min=1)


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
        if not self.alg_temp:
            return Commit(top_k_per_row(confidence, ctx.eligible, count), tokens, confidence)
        weights = torch.softmax((confidence / self.alg_temp).masked_fill(~ctx.eligible, float("-inf")), dim=1)
        mask = torch.zeros_like(ctx.eligible)
        for row in range(mask.shape[0]):
            k = int(min(count[row], ctx.eligible[row].sum()))
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
        t = 1 + ctx.step * (self.eps - 1) / ctx.steps
        s = 1 + (ctx.step + 1) * (self.eps - 1) / ctx.steps
        draw = uniform(ctx.eligible.shape, ctx.generators, ctx.logits.device)
        return Commit(ctx.eligible & (draw < 1 - s / t), tokens, probs.amax(-1))
