"""KLASS, KL-Adaptive Stability Sampling (Kim et al., arXiv 2511.05664; spec `strategies_2026.md` section 2; the
authors' shkim0116/KLASS `src/model/llada_klass.py::stable_confident_decode` and `src/model/dream_klass.py`
`_sample`, alg `klass`, unmask strategy `all`).

Every step compares each position's predicted distribution with the one of the step before (KL divergence, float64)
and keeps the last `history_length` values. A masked position of the block is ready when its prediction is confident
and was stable at each of them; every ready position is committed, and when none is, the most confident ones.

The distributions are carried across blocks: the first step of a block compares the new block's predictions with
those of the previous block's last step. So every step needs the logits of every later position too (`logit_window`
reaches the end of the canvas; under prefix and dual caches those rows are computed, as prefix computes them), and a
row's state outlives its block (`block_local = False`: a batch runs to its end, no row joins it). Block-causal and
causal-prefix models (SDAR, Nemotron, ...) are refused: they predict a block only from finished blocks.

The two variants, as the authors wrote them, chosen by the model family:
- LLaDA (aligned logits): p = softmax(logits) in float64, x = argmax p, c = p[x]; a position is stable once the
  block's step t >= H - 1 and its last H KLs are below kappa; ready: c > tau. No ready position: the LLaDA schedule's
  n_t most confident (n_t from the block's masks at its first step, the larger shares first).
- Dream (shifted logits): x = argmax of the softmax in the logits' dtype, c from the float64 softmax; no t >= H - 1
  gate; ready: c >= tau. No ready position: exactly one, at the highest confidence of Dream's `sample_tokens`
  (temperature and top_p applied: a drawn token's probability at temperature > 0), committed with x.

Deliberate differences from the authors' code: the step that ends a block's step budget commits every mask left
(their loops end there and leave the masks that a ready step committing fewer than n_t left behind; LLaDA's
`topk(n_t)` with fewer masks than n_t would overwrite decoded tokens), the fallback count is never above the
masks left, and equal fallback confidences go to the lowest position (their `topk` runs over the whole sequence;
float64 confidences practically never tie). At temperature > 0 the LLaDA variant softmaxes the authors' `add_gumbel_noise` output exp(l) / g^T
(their quirk, kept); each row draws from its own generator. MASK is never proposed (see `samplers.base`)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
from torch import Tensor

from dllm.core.params import param

from .base import (Commit, Sampler, StepContext, each_value, most_confident, per_row, register, row_values, tempered,
                   top_k_per_row, uniform)
from .dream import keep_top_p

EPS = 1e-12  # inside the logarithms of the KL, as the authors'


@register("klass")
@dataclass
class Klass(Sampler):
    """KLASS (arXiv 2511.05664): commit every masked position that is confident and whose KL from the previous step's
    prediction stayed below kl_threshold for history_length steps; else the most confident (LLaDA: the scheduled
    number, Dream: one). Authors' code: shkim0116/KLASS (defaults: its functions'; their scripts use tau 0.6-0.9,
    kappa 0.001-0.015, H 2, steps = gen_length)."""

    block_local: ClassVar[bool] = False  # each position's last distribution and KLs carry over into later blocks
    orders_by_token_probability: ClassVar[bool] = False  # by its float64 confidences of the full distribution
    threshold: float = param(0.9, "tau: a stable position is ready when its confidence exceeds this (LLaDA: >, "
                                  "Dream: >=, as the authors')", ge=0.0)
    kl_threshold: float = param(0.01, "kappa: stable when the KL from the previous step's prediction is below this "
                                      "at each of the last history_length steps", ge=0.0)
    history_length: int = param(2, "H: the steps of KL history a stable position needs", ge=1, le=1024)
    top_p: float | None = param(None, "Dream: nucleus mass of the distribution the fallback position is chosen by "
                                "(the authors' Dream evaluation: 0.95 at temperature 0.2; None: off)", gt=0.0, le=1.0)

    def logit_window(self, prompt_length: int, length: int, start: int, end: int, step: int) -> tuple[int, int]:
        return start, length  # the block and every later position

    def check_model(self, config: Any) -> str | None:
        problem = super().check_model(config)
        if problem is None and config.decoded_keys_fixed:
            kind = "block-causal" if config.block_size else "causal-prefix"
            problem = (f"it carries every later position's prediction into the next block, and a {kind} model "
                       f"predicts a block only from finished blocks; use another sampler")
        if problem is None and self.top_p is not None and not config.logit_shift:
            problem = ("top_p picks the fallback position of Dream's KLASS; the authors' LLaDA KLASS (aligned "
                       "logits) has none: drop top_p")
        return problem

    def step(self, ctx: StepContext) -> Commit:
        dream = ctx.family == "dream"
        if dream:
            tokens = ctx.logits.softmax(-1).argmax(-1)  # in the logits' dtype, as Dream's `p_curr_masked`
            probs = ctx.logits.double().softmax(-1)
        else:
            probs = llada_probabilities(ctx.logits, self.temperature, ctx.generators)
            tokens = probs.argmax(-1)
        confidence = probs.gather(-1, tokens[..., None])[..., 0]
        stable = self.stable(ctx, probs)
        if not dream:  # the authors' LLaDA waits for H steps of the block
            stable = stable & (per_row(self.history_length, confidence) - 1 <= ctx.step)
        tau = per_row(self.threshold, confidence)
        ready = stable & (confidence >= tau if dream else confidence > tau) & ctx.eligible
        any_ready = ready.any(1, keepdim=True)
        fallback = (most_confident(self.fallback_confidence(ctx, any_ready[:, 0]), ctx.eligible) if dream else
                    top_k_per_row(confidence, ctx.eligible, self.scheduled(ctx)))
        mask = torch.where(any_ready, ready, fallback)
        if ctx.step >= ctx.steps - 1:  # the block's last budgeted step
            mask = ctx.eligible.clone()
        return Commit(mask, tokens, confidence)

    def stable(self, ctx: StepContext, probs: Tensor) -> Tensor:
        """`[B, C]`: every one of the last `history_length` KLs (this step's included) below `kl_threshold`. Keeps
        this step's distributions and KL history in `ctx.state` for the window's positions (`lo`: the first one's
        column), of the rows that step: a row waiting for the others of its batch keeps its own, as alone."""
        state, rows = ctx.state, len(probs)
        depth = int(max(row_values(self.history_length, rows)))
        if not hasattr(state, "previous"):  # the generation's first step: the authors' zeros
            previous, history = torch.zeros_like(probs), probs.new_zeros((*probs.shape[:2], depth))
        else:  # the window starts at the block: drop the columns of the blocks before it
            cut = ctx.block_start - state.lo
            previous, history = state.previous[:, cut:], state.history[:, cut:]
        kl = (probs * (torch.log(probs + EPS) - torch.log(previous + EPS))).sum(-1)
        updated = torch.cat((history[..., 1:], kl[..., None]), -1)  # oldest dropped, newest last
        stepping = ctx.eligible.any(1)
        if bool(stepping.all()):
            state.previous, state.history = probs, updated
        else:
            state.previous = torch.where(stepping[:, None, None], probs, previous)
            state.history = torch.where(stepping[:, None, None], updated, history)
        state.lo = ctx.block_start
        age = torch.arange(depth, 0, -1, device=probs.device)  # steps back of each entry: 1 is this step's
        counted = age <= per_row(self.history_length, state.history)  # per row: [B, 1, 1]
        return ((state.history < per_row(self.kl_threshold, state.history)) | ~counted).all(-1)

    def scheduled(self, ctx: StepContext) -> Tensor:
        """`[B]` the LLaDA schedule's count for this step: the block's masks at its first step split over its
        steps, the first `masks mod steps` steps one more (the authors' `get_num_transfer_tokens`)."""
        if ctx.step == 0:
            ctx.state.block_masks = ctx.eligible.sum(1)
        masks = ctx.state.block_masks
        return masks // ctx.steps + (ctx.step < masks % ctx.steps)

    def fallback_confidence(self, ctx: StepContext, ready: Tensor) -> Tensor:
        """`[B, C]` Dream's `sample_tokens` confidence: the softmax of the tempered, top-p truncated logits (their
        dtype) at its argmax, or at temperature > 0 at a token drawn from it, row b from `ctx.generators[b]` when it
        has no `ready` `[B]` position (only then do the authors call it)."""
        probs = each_value(self.top_p, partial(keep_top_p, tempered(ctx.logits, self.temperature))).softmax(-1)
        temperatures = row_values(self.temperature, len(probs))
        if not any(temperatures):
            return probs.amax(-1)
        drawing = [t and g is not None and not r for g, t, r in zip(ctx.generators, temperatures, ready.tolist())]
        drawn = torch.stack([torch.multinomial(p, 1, generator=g)[:, 0] if d else p.argmax(-1)
                             for p, g, d in zip(probs, ctx.generators, drawing)])
        return probs.gather(-1, drawn[..., None])[..., 0]


def llada_probabilities(logits: Tensor, temperature: Any, generators: list[torch.Generator | None]) -> Tensor:
    """The authors' LLaDA KLASS distributions: softmax(logits) in float64; at temperature T > 0 the softmax of
    their `add_gumbel_noise` output exp(l) / (-ln u)^T (a quirk: noisy positive values, not logits), u float64
    uniforms drawn per row from its generator."""
    logits = logits.double()
    temperatures = row_values(temperature, len(logits))
    if any(temperatures):
        u = uniform(logits.shape, [g if t else None for g, t in zip(generators, temperatures)], logits.device)
        noisy = logits.exp() / (-torch.log(u)) ** per_row(temperature, logits)
        hot = torch.tensor([bool(t) for t in temperatures], device=logits.device)[:, None, None]
        logits = torch.where(hot, noisy, logits)
    return logits.softmax(-1)
