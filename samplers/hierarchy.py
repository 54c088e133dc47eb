"""dInfer's hierarchical decoding (dInfer tech report, arXiv 2510.08666; inclusionAI/dInfer
`python/dinfer/decoding/parallel_strategy.py::HierarchyDecoder`; spec `strategies_2026.md` section 8)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from dllm.core.params import param

from .base import Commit, Sampler, StepContext, each_value, gumbel_argmax, most_confident, register


@register("hierarchy")
@dataclass
class Hierarchy(Sampler):
    """dInfer hierarchical decoding (arXiv 2510.08666): the most confident position of each run of consecutive
    masks above low_threshold, every mask above threshold, and always the block's most confident one.

    As `HierarchyDecoder`: every position equal to its run's maximum counts (ties, frequent in bfloat16), the
    comparisons are strict, and the confidence is exp(log_softmax) of the logits in their own dtype. Blocks
    start at multiples of block_length from the prompt's first token (dInfer's `start_block_align`, on in all
    its scripts), so the first block overlaps the prompt. Defaults: the authors' evaluation guide
    (`evaluations/eval_guide.md`, hierarchy: 0.92 / 0.62); the class's own are None / 0.4, its CLI's 0.9 / 0.3.
    On a shifted model (Dream) it runs on the aligned logits, as dInfer's `use_shift` iteration does."""

    threshold: float | None = param(0.92, "also commit every mask whose confidence is above this (None: off)",
                                    ge=0.0)
    low_threshold: float | None = param(0.62, "keep a run's most confident position only above this (None: always)",
                                        ge=0.0)
    align_blocks: bool = param(True, "start blocks at multiples of block_length from the prompt's first token, the "
                                     "first overlapping the prompt (dInfer's start_block_align)")
    orders_by_token_probability: ClassVar[bool] = False  # its confidence (in the logits' dtype) is not token_probability

    def block_origin(self, prompt_length: int, block_length: int) -> int:
        return prompt_length // block_length * block_length if self.align_blocks else prompt_length

    def step(self, ctx: StepContext) -> Commit:
        logits, eligible = ctx.logits, ctx.eligible
        tokens = gumbel_argmax(logits, self.temperature, ctx.generators)
        confidence = logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0].exp()  # the logits' dtype
        scored = confidence.masked_fill(~eligible, torch.finfo(confidence.dtype).min)
        # runs of consecutive eligible positions, numbered from 1 (0: not eligible)
        starts = eligible & ~F.pad(eligible[:, :-1], (1, 0))
        run = torch.where(eligible, starts.cumsum(1), 0)
        run_max = scored.new_full((len(scored), scored.shape[1] + 1), torch.finfo(scored.dtype).min)
        run_max = run_max.scatter_reduce(1, run, scored, "amax").gather(1, run)
        best = eligible & (scored == run_max)
        best = each_value(self.low_threshold, lambda low: best if low is None else best & (scored > low))
        above = each_value(self.threshold, lambda high: scored > (float("inf") if high is None else high))
        return Commit(best | (eligible & above) | most_confident(scored, eligible), tokens, confidence)
