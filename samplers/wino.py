"""WINO, Wide-In Narrow-Out revokable decoding (Hong et al., ICLR 2026, arXiv 2507.18578; the authors' code is
Feng-Hong/WINO-DLLM `LLaDA/decoding.py::decoding_wino`; spec `strategies_2026.md` section 1).

Each step's forward carries a shadow block beside the canvas: one extra row of MASK per block position, at that
position, seeing the whole canvas except its own position (and the other shadow rows); no canvas row sees it.
Shadow row j thus predicts block position j without seeing the token there. Wide-in commits every masked position
of the block whose probability is above `threshold` (at most `min(max(int(0.7 |masked|), 5), 20)`, the most
probable; at least the most probable one). Narrow-out, when more than one was committed, re-masks the block's
tokens decoded before this step whose shadow probability is below `remask_threshold`, at most one fewer than the
previous step committed (the authors' `last_accept`, 30 before a block's first step). A block ends when it has no
mask left, however many steps that takes.

Differences from the authors' function: MASK is never proposed (`samplers.base`); at temperature > 0 each row draws
its Gumbel noise over its block from its own generator (theirs: one draw over every row of the forward; the same
law); the batch is left-padded (theirs: batch 1). `rule="d2cache"` takes Kamichanw/d2Cache's port instead: at least
tau_in, re-masks capped by this step's commits - 1 (the spec's configuration (d))."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dllm.core.params import param

from .base import (Commit, ExtraRows, Sampler, StepContext, gumbel_argmax, most_confident, per_row, register,
                   top_k_per_row)

FIRST_LAST_ACCEPT = 30  # the authors' `last_accept` before a block's first step


@register("wino")
@dataclass
class Wino(Sampler):
    """WINO (arXiv 2507.18578, Feng-Hong/WINO-DLLM): wide-in threshold commits, narrow-out re-masking of the
    tokens a shadow block no longer confirms. Defaults: tau_in 0.7, tau_out 0.9 (the authors' MATH-500 and
    HumanEval configs; GSM8K's tau_in is 0.6)."""

    edits: ClassVar[bool] = True
    adds_rows: ClassVar[bool] = True
    orders_by_token_probability: ClassVar[bool] = False  # its float64 softmax, as the authors' code
    threshold: float = param(0.7, "wide-in (tau_in): commit masked positions whose probability is above this (above "
                                  "1: none is, so each step commits its most confident one)", ge=0.0)
    remask_threshold: float = param(0.9, "narrow-out (tau_out): re-mask decoded tokens whose shadow-block "
                                         "probability is below this (above 1: every one is, as many as the cap "
                                         "allows)", ge=0.0)
    rule: str = param("official", "official: the authors' decoding_wino (strictly above tau_in; re-masks capped by "
                                  "the previous step's commits - 1); d2cache: Kamichanw/d2Cache's port (at least "
                                  "tau_in; capped by this step's commits - 1)", choices=("official", "d2cache"))

    def check_model(self, config: Any) -> str | None:
        if config.logit_shift:
            return ("WINO's shadow row must predict its block position without seeing that position's token, and on "
                    "a shifted model the row that predicts a position is the one before it, which sees it (the "
                    "authors run WINO on LLaDA and MMaDA); use an aligned model such as LLaDA")
        return super().check_model(config)

    def extra_rows(self, canvas, start: int, end: int, config: Any) -> ExtraRows:
        """The shadow block: MASK at the block's columns, each seeing every canvas column but its own."""
        columns = torch.arange(start, end, device=canvas.device)
        return ExtraRows(tokens=canvas.new_full((len(canvas), end - start), config.mask_id), columns=columns,
                         sees_canvas=(columns[:, None] != torch.arange(canvas.shape[1], device=canvas.device))[None],
                         sees_extra=torch.ones((end - start, end - start), dtype=torch.bool, device=canvas.device))

    def step(self, ctx: StepContext) -> Commit:
        state, eligible, official = ctx.state, ctx.eligible, self.rule == "official"
        if ctx.step == 0:
            state.last_accept = torch.full_like(eligible[:, 0], FIRST_LAST_ACCEPT, dtype=torch.long)
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        confidence = ctx.logits.double().softmax(-1).gather(-1, tokens[..., None])[..., 0]
        # wide-in: above the threshold, the most probable `cap` if more, the most probable one if none
        cap = (eligible.sum(1) * 0.7).long().clamp(min=5, max=20)  # as the authors' int(|masked| * 0.7)
        tau_in = per_row(self.threshold, confidence)
        above = eligible & (confidence > tau_in if official else confidence >= tau_in)
        count = above.sum(1, keepdim=True)
        commit = torch.where(count > cap[:, None], top_k_per_row(confidence, eligible, cap),
                             torch.where(count > 0, above, most_confident(confidence, eligible)))
        # narrow-out: the shadow row's probability of each token decoded before this step
        accepted = commit.sum(1)
        block = ctx.canvas[:, ctx.positions]  # the shadow rows stand at the block's columns: the window is the block
        shadow = ctx.extra_logits.double().softmax(-1).gather(-1, block[..., None])[..., 0]
        low = ctx.editable & (shadow < per_row(self.remask_threshold, shadow))
        most = (state.last_accept if official else accepted) - 1
        fewest = top_k_per_row(-shadow, low, most.clamp(min=0))
        remask = torch.where((low.sum(1) > most)[:, None], fewest, low) & (accepted > 1)[:, None]
        state.last_accept = torch.where(eligible.any(1), accepted, state.last_accept)
        return Commit(commit, torch.where(remask, ctx.config.mask_id, tokens), confidence, edit=remask)
