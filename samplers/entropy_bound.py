"""DiffusionGemma's decoding of a uniform-state canvas (spec `new_families.md` section 1; transformers'
`EntropyBoundSampler`, `LinearTemperatureScheduleLogitsProcessor` and `StableAndConfidentStoppingCriteria`; the
bound after arXiv 2505.24857): the sampler `entropy_bound`, and its rule as pure functions of one step's logits.

A canvas (the block) starts as uniformly random tokens and is denoised for at most `steps` steps (the block's step
budget: transformers' max_denoising_steps), counted down s = N..1. Each step scales the logits by the temperature
`t_min + (t_max - t_min) * s / N`, samples every position, keeps the samples of the lowest-entropy positions whose
entropies, all but the largest, sum to at most `bound`, and gives every other position a fresh random token. A
canvas stops once its argmax has not changed for `stability` steps and the mean entropy of its scaled predictions
is below `confidence`; it then commits that argmax (after `steps` steps in any case). The scaled logits are the
next step's self-conditioning input."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import ClassVar

import torch
from torch import Tensor

from dllm.core.errors import DllmError
from dllm.core.params import param

from .base import Commit, Sampler, StepContext, entropy_bounded, per_row, register, token_entropy


@register("entropy_bound")
@dataclass
class EntropyBound(Sampler):
    """DiffusionGemma's uniform-state decoding (transformers' EntropyBoundSampler): each block starts as random
    tokens; every step keeps the lowest-entropy samples within an entropy bound and renoises the rest; the block
    commits its argmax once stable and confident, or at its last step. Steps per block: its denoising steps at most.

    Defaults: transformers' generation defaults, as the released `generation_config.json` sets them (t 0.8 -> 0.4,
    bound 0.1, stability 1, confidence 0.005; and 48 steps per block, DiffusionGemma's default `steps`)."""

    may_commit_nothing: ClassVar[bool] = True  # a canvas commits nothing until it stops
    temperature: float = field(default=0.0, init=False)  # not a parameter: the schedule t_max -> t_min is
    bound: float = param(0.1, "keep the lowest-entropy samples while their entropies but the largest sum to at "
                              "most this (nats)", gt=0.0)
    t_max: float = param(0.8, "temperature of a block's first step", ge=0.0)
    t_min: float = param(0.4, "temperature the schedule falls towards (its last step: t_min + (t_max - t_min) / "
                              "steps)", ge=0.0)
    stability: int = param(1, "stop once the argmax canvas equals that of each of this many steps before (0: "
                              "confidence alone)", ge=0)
    confidence: float = param(0.005, "... and the mean entropy of the scaled predictions is below this (nats)",
                              gt=0.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.t_max <= self.t_min:
            raise DllmError(f"sampler 'entropy_bound' needs t_max > t_min, got t_max {self.t_max} and t_min "
                            f"{self.t_min}")

    def check_model(self, config) -> str | None:
        if config.mask_id is not None:
            return ("it denoises a uniform-state canvas of random tokens, and this is a masked model; use a masked "
                    "sampler such as low_confidence")
        return None

    def fill_block(self, shape, generators, config) -> Tensor:
        return random_canvas(shape, config.vocab_size, generators)

    def model_inputs(self, state: SimpleNamespace, step: int) -> dict | None:
        return {"self_conditioning": state.scaled} if step else None  # a canvas's first step has none

    def step(self, ctx: StepContext) -> Commit:
        state = ctx.state
        canvas = ctx.canvas.index_select(1, ctx.positions)
        if ctx.step == 0:
            state.history = new_history(self.stability, canvas)
        out = entropy_bound_step(ctx.logits, canvas, state.history, ctx.steps - ctx.step, ctx.steps, self,
                                 ctx.generators)
        state.history, state.scaled = out.history, out.scaled
        commit = ctx.eligible if ctx.step >= ctx.steps - 1 else ctx.eligible & out.stop[:, None]
        return Commit(commit, out.argmax, out.confidence, draft=out.canvas)


def temperature(steps_left: int, steps: int, t_min: float, t_max: float, like: Tensor | None = None) -> Tensor:
    """The schedule's temperature with `steps_left` of `steps` steps to go (N at the first step, 1 at the last),
    computed in float32 as transformers does (so scaled logits match it bit for bit); per-row bounds (`stack_rows`)
    give one per row, shaped for `like` (`[B, ...]` float32)."""
    ratio = torch.tensor(steps_left, dtype=torch.int32) / steps
    like = ratio if like is None else like
    return per_row(t_min, like) + per_row(t_max - t_min, like) * ratio


def low_entropy_keep(entropy: Tensor, bound: float) -> Tensor:
    """`[B, C]` bool: the positions kept, the lowest-entropy first while the sum of their entropies minus the
    largest of them stays within `bound` (so the lowest one always; ties in entropy: the lowest position first):
    `eb_sampler`'s bound over the whole canvas (`base.entropy_bounded`)."""
    return entropy_bounded(entropy, torch.ones_like(entropy, dtype=torch.bool), bound)


def new_history(stability: int | Tensor, argmax: Tensor) -> Tensor:
    """The stop rule's memory at a canvas's start: `stability` argmax canvases that match nothing (-1); per-row
    stabilities (`stack_rows`): as many as the largest."""
    depth = int(stability.max()) if isinstance(stability, Tensor) else stability
    return argmax.new_full((depth, *argmax.shape), -1)


def stops(argmax: Tensor, history: Tensor, entropy: Tensor, confidence: float | Tensor,
          stability: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`[B]` rows whose canvas stops (argmax equal to every canvas in `history` `[k, B, C]`, or to the last
    `stability[b]` of them for per-row stabilities; mean entropy below `confidence`), and the history with `argmax`
    appended (the oldest dropped)."""
    same = history == argmax
    if isinstance(stability, Tensor):  # a canvas `age` steps back counts for rows that look that far back
        age = torch.arange(len(history), 0, -1, device=argmax.device)
        same |= (age[:, None] > stability.to(argmax.device))[..., None]
    mean = entropy.mean(-1)
    stop = same.all(-1).all(0) & (mean < per_row(confidence, mean))
    return stop, torch.cat((history, argmax[None]))[1:]


@dataclass
class CanvasStep:
    """One step of a batch of canvases."""

    canvas: Tensor  # [B, C] the next canvas: kept samples, fresh random tokens elsewhere
    argmax: Tensor  # [B, C] what a stopping canvas commits
    confidence: Tensor  # [B, C] the argmax's probability under the scaled logits
    keep: Tensor  # [B, C] bool: positions whose sample was kept
    stop: Tensor  # [B] bool: canvases that stop (commit `argmax`) now
    scaled: Tensor  # [B, C, V] the temperature-scaled logits: the next step's self-conditioning input
    history: Tensor  # [stability, B, C] the stop rule's memory for the next step


def random_canvas(shape: tuple[int, int], vocab: int, generators: list[torch.Generator | None]) -> Tensor:
    """`[B, C]` uniformly random token ids, row b drawn from `generators[b]` (a fresh canvas's tokens; a None row
    draws nothing and gets zeros)."""
    device = next(g.device for g in generators if g is not None)
    return torch.stack([torch.zeros(shape[1:], dtype=torch.long, device=device) if g is None else
                        torch.randint(0, vocab, shape[1:], generator=g, device=device) for g in generators])


def entropy_bound_step(logits: Tensor, canvas: Tensor, history: Tensor, steps_left: int, steps: int,
                       rule: EntropyBound, generators: list[torch.Generator | None]) -> CanvasStep:
    """One step for canvases `[B, C]` given their logits `[B, C, V]` (soft-capped, unscaled), `steps_left` of
    `steps` to go. Row b draws from `generators[b]`: its samples (one multinomial draw per position) then its fresh
    tokens, the order of transformers' `generate` for one row; a None row (stopped) draws nothing and keeps its
    canvas."""
    scaled = logits.float()
    scaled = scaled / temperature(steps_left, steps, rule.t_min, rule.t_max, scaled).to(logits.device)
    entropy = token_entropy(scaled)
    argmax = scaled.argmax(-1)
    probs = scaled.softmax(-1)
    confidence = probs.gather(-1, argmax[..., None])[..., 0]
    keep = low_entropy_keep(entropy, rule.bound)
    rows = []
    for b, g in enumerate(generators):
        if g is None:
            rows.append(canvas[b])
            continue
        sample = torch.multinomial(probs[b], 1, generator=g)[:, 0]
        noise = torch.randint(0, probs.shape[-1], sample.shape, generator=g, device=sample.device)
        rows.append(torch.where(keep[b], sample, noise))
    stop, history = stops(argmax, history, entropy, rule.confidence, rule.stability)
    return CanvasStep(torch.stack(rows), argmax, confidence, keep, stop, scaled, history)
