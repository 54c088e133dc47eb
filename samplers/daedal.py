"""DAEDAL, answers that pick their own length (Li et al., ICLR 2026, arXiv 2508.00819; the authors' code is
Li-Jinsong/DAEDAL `models/LLaDA_DAEDAL.py::generate`; spec `strategies_2026.md` section 10): `gen_length="auto"`.

Not a sampler: a length policy, the canvas layout `dllm.engine.layouts.GrowingCanvas`, applied around any sampler
that can decode a growing canvas (`Sampler.canvas_may_grow`). Its paper decodes with `threshold` 0.9 (their fill rule: the masks of
the block above 0.9, else the most confident one), the sampler `gen_length="auto"` takes when none is named.

- The EOS confidence of a row: scanning its answer canvas from the end, the probabilities of EOS (the model's
  filler, LLaDA's <|endoftext|>) at the last `eos_check_tokens` positions whose prediction is EOS, summed and divided
  by `eos_check_tokens` (however many were found).
- Before decoding (stage 1): the answer starts as `initial_gen_length` masks; each forward grows it by
  `expansion_factor` masks while its EOS confidence is below `eos_threshold` (and it is shorter than
  `max_gen_length`); then `eos_check_tokens // 2` EOS tokens end it (committed tokens, not masks).
- While decoding (stage 2), at each step of a row whose EOS confidence is below `expand_threshold` and whose answer
  is shorter than `max_gen_length`: of the block's masks the step left, the least confident one below
  `low_threshold` becomes `expansion_factor` masks; later tokens move right and the answer is cut at
  `max_gen_length`. The block keeps its columns, so inserted masks past its end fall into the next block.

Reproduced from the authors' function: the EOS confidence over committed positions too (the EOS tail included),
divided by `eos_check_tokens` even when fewer positions predict EOS, rounded to float32 before it is compared; the
EOS tail counted in the answer's length; the truncation at `max_gen_length`; one insertion per row and step, scored
by the probability of the step's proposal (their Gumbel-noised argmax); blocks from the answer's start, a block
without masks skipped without a forward; every stage-1 forward counted (at least one, even when nothing can grow).
Differences: MASK is never proposed (`samplers.base`), so their fallback for a block whose every prediction is MASK
never applies and their softmax leaves MASK out; float32 (theirs: CUDA fp16 autocast); `threshold` commits at 0.9
and above (theirs: above); each row decodes as it would alone (theirs attends to a left-padded prompt's padding);
rows of a batch share the current block, so a row that finished its block waits for the others (theirs has a cursor
per row: the same tokens, fewer forwards for the batch); the loop stops a row once its answer has ended
(`stop_early`; theirs decodes every mask); their checks that stop stage 1 when the longest canvas cannot grow and
stage 2 when a step changes nothing never fire (a row that stops growing never grows again; every row with a mask in
its block commits one) and are left out. `max_gen_length` is capped at what the model's context leaves after the
row's prompt."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dllm.core.errors import DllmError
from dllm.core.params import Params, param


@dataclass
class Daedal(Params):
    """DAEDAL (arXiv 2508.00819; Li-Jinsong/DAEDAL): grow a short answer canvas until the model predicts its end,
    and split a low-confidence mask into several where the answer needs room. Defaults: the paper's."""

    kind: ClassVar[str] = "length policy"
    name: ClassVar[str] = "daedal"

    initial_gen_length: int = param(64, "answer masks to start from (L0)", ge=1)
    max_gen_length: int = param(2048, "the longest answer canvas, its EOS tail included (capped by the model's "
                                      "context)", ge=1)
    eos_threshold: float = param(0.5, "before decoding, grow the canvas while its EOS confidence is below this",
                                 ge=0.0)
    expand_threshold: float = param(0.9, "while decoding, insert masks only while the EOS confidence is below this",
                                    ge=0.0)
    low_threshold: float = param(0.1, "the block's least confident mask left by a step, below this, is expanded",
                                 ge=0.0)
    expansion_factor: int = param(8, "masks added per growth before decoding; masks one expanded mask becomes", ge=1)
    eos_check_tokens: int = param(32, "positions predicting EOS whose probabilities make the EOS confidence; half "
                                      "as many EOS tokens end the canvas before decoding", ge=1)

    def __post_init__(self):
        super().__post_init__()
        if self.initial_gen_length > self.max_gen_length:
            raise DllmError(f"gen_length auto: initial_gen_length ({self.initial_gen_length}) exceeds max_gen_length "
                            f"({self.max_gen_length}); lower it (CLI: --length-arg initial_gen_length=N) or raise "
                            f"max_gen_length")

    def limit(self, prompt_length: int, context: int) -> int:
        """The longest answer canvas of a row with a prompt of `prompt_length` tokens."""
        return min(self.max_gen_length, context - prompt_length)

    def eos_confidence(self, logits: Tensor, answer: Tensor, eos: int) -> Tensor:
        """[B] float32: each row's EOS confidence from the logits `[B, C, V]` of columns whose answer positions are
        `answer` `[B, C]` (the authors' `_calculate_eos_confidence`)."""
        predicts_eos = (logits.argmax(-1) == eos) & answer
        from_end = predicts_eos.flip(1).cumsum(1).flip(1)  # EOS predictions at or after each column
        counted = predicts_eos & (from_end <= self.eos_check_tokens)
        probability = torch.zeros(counted.shape, dtype=torch.float64, device=logits.device)
        probability[counted] = logits[counted].float().softmax(-1)[:, eos].double()
        return (probability.sum(1) / self.eos_check_tokens).float()

    def growth(self, eos_confidence: Tensor, lengths: list[int], limits: list[int]) -> list[int]:
        """Stage 1: the masks each row's canvas grows by after a forward (0: its length is chosen)."""
        short = (eos_confidence < self.eos_threshold).tolist()
        return [min(n + self.expansion_factor, cap) - n if s and n < cap else 0
                for s, n, cap in zip(short, lengths, limits)]

    def tail(self, length: int, limit: int) -> int:
        """Stage 1's EOS tokens after a canvas of `length` answer masks."""
        return min(length + self.eos_check_tokens // 2, limit) - length

    def expansion(self, eos_confidence: Tensor, confidence: Tensor, left: Tensor, room: Tensor) -> Tensor:
        """Stage 2: `[B]` the window index of the mask each row expands (-1: none), from the step's EOS confidence,
        the confidence `[B, C]` of each position's proposal and the masks of the block the step `left` `[B, C]`;
        `room` `[B]`: rows shorter than their longest canvas."""
        candidates = left & (confidence < self.low_threshold)
        lowest = confidence.masked_fill(~candidates, float("inf")).argmin(1)
        expands = (eos_confidence < self.expand_threshold) & room & candidates.any(1)
        return torch.where(expands, lowest, -1)
