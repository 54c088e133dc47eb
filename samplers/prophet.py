"""Prophet (arXiv 2508.19982; spec `prophet_credit_localleap.md` section 1)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dllm.core.errors import DllmError
from dllm.core.params import param

from .base import SAMPLERS, Commit, Sampler, StepContext, gumbel_argmax, per_row, register


@register("prophet")
@dataclass
class Prophet(Sampler):
    """Prophet (arXiv 2508.19982): when the mean top-1/top-2 logit gap of the answer region clears the phase
    threshold, commit every remaining mask with its argmax at once; otherwise step the base sampler.

    The answer region is `answer_length` positions from `answer_start` in the generation, where the prompt
    format puts the answer (the paper anchors "The answer is" at offsets 200-202 of 256 and reads 204-208);
    without `answer_start` Prophet never exits, as the authors' `generate_earlyexit.py`. The gap and the fill
    need logits of the whole generation, so under prefix/dual caches the computed window widens to it (counted
    in rows_per_layer; it also refreshes the later blocks, so logits differ slightly from the base's under the
    same cache). Progress is a row's forwards / total steps."""

    base: str = param("low_confidence", "base sampler for steps that do not exit",
                      choices=("low_confidence", "threshold"))
    threshold: float = param(0.9, "threshold of the base sampler when base=threshold", ge=0.0)
    early_threshold: float = param(7.5, "gap needed while progress < early_bound", ge=0.0)
    mid_threshold: float = param(5.0, "gap needed while progress < late_bound", ge=0.0)
    late_threshold: float = param(2.5, "gap needed afterwards", ge=0.0)
    early_bound: float = param(0.33, "end of the early phase (fraction of steps)", ge=0.0, le=1.0)
    late_bound: float = param(0.67, "start of the late phase (fraction of steps)", ge=0.0, le=1.0)
    answer_start: int | None = param(None, "offset in the generation where the answer is read (None: never exit, "
                                     "as the reference)", ge=0)
    answer_length: int = param(5, "answer window length when answer_start is set", ge=1)

    def __post_init__(self):
        super().__post_init__()
        args = {"threshold": self.threshold} if self.base == "threshold" else {}
        self._base = SAMPLERS.create(self.base, temperature=self.temperature, **args)

    block_local: ClassVar[bool] = False  # looks at the whole answer and counts forwards
    commits_past_block: ClassVar[bool] = True
    batch_params: ClassVar[tuple[str, ...]] = ("answer_start", "answer_length")  # set the logits computed

    @property
    def reads_decoded_logits(self) -> bool:  # the gap averages the whole region, decoded or not
        return self.answer_start is not None

    @property
    def reads_shards(self) -> bool:  # its own reads are the top two and its base's draw
        return self._base.reads_shards

    def check_gen_length(self, gen_length: int) -> None:
        if self.answer_start is not None and self.answer_start >= gen_length:
            raise DllmError(f"sampler 'prophet' parameter answer_start={self.answer_start} is past the answer "
                            f"({gen_length} tokens, gen_length), so it would never exit early; give an offset below "
                            f"{gen_length} (where the prompt format puts the answer) or a longer --gen-length")

    def logit_window(self, prompt_length, length, start, end, step):
        return (start, end) if self.answer_start is None else (prompt_length, length)

    def phase_threshold(self, progress: Tensor) -> Tensor:
        early, mid, late, early_bound, late_bound = (per_row(v, progress) for v in (
            self.early_threshold, self.mid_threshold, self.late_threshold, self.early_bound, self.late_bound))
        return torch.where(progress < early_bound, early, torch.where(progress < late_bound, mid, late))

    def step(self, ctx: StepContext) -> Commit:
        if self.answer_start is None:
            return self._base.step(ctx)
        # the base sampler steps on the block alone, drawing what it draws without Prophet
        block = (ctx.positions >= ctx.block_start) & (ctx.positions < ctx.block_end)
        out = self._base.step(dataclasses.replace(ctx, logits=ctx.logits[:, block], eligible=ctx.eligible[:, block],
                                                  masked=ctx.masked[:, block], positions=ctx.positions[block]))
        mask, tokens = torch.zeros_like(ctx.masked), ctx.canvas[:, ctx.positions].clone()
        confidence = out.confidence.new_zeros(ctx.masked.shape)
        mask[:, block], tokens[:, block], confidence[:, block] = out.mask, out.tokens, out.confidence
        # progress counts each row's own forwards (a row alone runs none while its block waits for others)
        forwards = ctx.state.__dict__.setdefault("forwards", torch.zeros_like(ctx.masked[:, 0], dtype=torch.long))
        progress = (forwards + 1) / ctx.total_steps
        forwards += ctx.eligible.any(1)
        offset = ctx.positions - ctx.prompt_length
        window = (offset >= self.answer_start) & (offset < self.answer_start + self.answer_length)
        top2 = ctx.logits[:, window].float().topk(2, dim=-1).values
        gap = (top2[..., 0] - top2[..., 1]).mean(-1)  # NaN (never fires) for a region past the generation
        fire = (gap >= self.phase_threshold(progress)) & ctx.eligible.any(1)
        if fire.any():  # every mask of the generation gets the step's token (drawn only for the rows that fire)
            drawn = gumbel_argmax(ctx.logits, self.temperature, [g if f else None for g, f in
                                                                 zip(ctx.generators, fire.tolist())])
            tokens = torch.where(block, tokens, drawn)
            mask = torch.where(fire[:, None], ctx.masked, mask)
        return Commit(mask, tokens, confidence)
