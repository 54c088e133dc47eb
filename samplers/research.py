"""Training-free samplers from recent papers, each a small policy over the shared loop (specs
`prophet_credit_localleap.md`, `adablock_selfspec.md`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from dllm.core.errors import DllmError
from dllm.core.params import param

from . import SAMPLERS, register
from .base import Commit, Sampler, StepContext, each_value, gumbel_argmax, per_row, row_values, token_probability
from .fastdllm import threshold_commit

DELIMITER_THRESHOLD = {"llada": 0.3, "dream": 0.5}  # AdaBlock's tau_D per model family


@register("credit")
@dataclass
class Credit(Sampler):
    """CreditDecoding (arXiv 2510.06133): decaying per-token trace credits fused into the logits, then the
    threshold rule; credits reset every block."""

    threshold: float = param(0.9, "commit fused confidence >= this (Fast-dLLM rule)", ge=0.0)
    alpha: float = param(0.65, "fusion strength: logits + alpha * log(1 + credit)", ge=0.0)
    beta: float = param(0.7, "credit decay per step", ge=0.0, lt=1.0)
    gamma: float = param(0.2, "concave exponent: the top-1 earns p ** gamma", gt=0.0)
    tuning_free: bool = param(False, "gamma = 1, alpha = beta = 1 - (masked fraction of the block)")

    def step(self, ctx: StepContext) -> Commit:
        logits = ctx.logits.double()
        top_p, top_token = torch.softmax(logits, -1).max(-1)
        alpha, beta, gamma = per_row(self.alpha, logits), per_row(self.beta, logits), self.gamma
        if self.tuning_free:
            masked_fraction = ctx.eligible.sum(1, keepdim=True).double() / ctx.eligible.shape[1]
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
        fused = logits + alpha * torch.log1p(credit)
        tokens = gumbel_argmax(fused, self.temperature, ctx.generators)
        confidence = token_probability(fused, tokens, ctx.unscored)
        return Commit(threshold_commit(confidence, ctx.eligible, self.threshold), tokens, confidence, logits=fused)


@register("localleap")
@dataclass
class LocalLeap(Sampler):
    """LocalLeap: anchors (confidence >= threshold) let masked neighbours within `radius` commit at the
    relaxed threshold; everything else follows the strict threshold."""

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


@register("adablock")
@dataclass
class AdaBlock(Sampler):
    """AdaBlock-dLLM (arXiv 2509.26432): at each block start, end the block on the most confident predicted
    delimiter in a window of gen_length/4 if its confidence reaches delimiter_threshold; threshold decoding
    inside. Batch rows share block boundaries: the smallest block any row asks for is used."""

    threshold: float = param(0.9, "token commit threshold inside the block", ge=0.0)
    delimiter_threshold: float | None = param(None, "delimiter confidence that sets the block end (None: 0.3 for "
                                              "LLaDA, 0.5 for Dream, the paper's; inf disables)", ge=0.0,
                                              allow_inf=True)
    delimiters: str = param("\n", "characters whose tokens end a semantic step (resolved with the tokenizer)")
    delimiter_ids: str | None = param(None, "comma-separated token ids; overrides delimiters")
    window_fraction: float = param(0.25, "delimiter search window as a fraction of gen_length", gt=0.0, le=1.0)
    _ids: Tensor | None = field(default=None, init=False, repr=False)
    block_local: ClassVar[bool] = False  # its window is a fraction of the whole answer
    batch_params: ClassVar[tuple[str, ...]] = ("window_fraction",)  # sets the logits computed

    def __post_init__(self):
        super().__post_init__()
        if self.delimiter_ids is not None:
            try:
                self._ids = torch.tensor([int(t) for t in self.delimiter_ids.split(",") if t.strip()])
            except ValueError:
                raise DllmError(f"sampler 'adablock' parameter delimiter_ids={self.delimiter_ids!r} must be "
                                f"comma-separated integers") from None

    def prepare(self, tokenizer) -> None:
        """Resolve `delimiters` to every vocabulary token made only of delimiter characters."""
        if self.delimiter_ids is not None:
            outside = [int(i) for i in self._ids if not 0 <= i < len(tokenizer)]
            if outside:
                raise DllmError(f"sampler 'adablock' delimiter_ids has {outside[0]}, not a token id of this "
                                f"tokenizer (0..{len(tokenizer) - 1})")
            return
        chars = set(self.delimiters)
        ids = [i for tok, i in tokenizer.get_vocab().items()
               if (text := tokenizer.convert_tokens_to_string([tok])) and set(text) <= chars]
        if not ids:
            raise DllmError(f"sampler 'adablock' delimiters={self.delimiters!r} match no token of this tokenizer; "
                            f"choose characters it has (e.g. a newline) or set delimiter_ids")
        self._ids = torch.tensor(sorted(ids), dtype=torch.long)

    def _window(self, prompt_length, length, start):
        return min(int(self.window_fraction * (length - prompt_length)), length - start)

    def logit_window(self, prompt_length, length, start, end, step):
        return start, max(end, start + self._window(prompt_length, length, start)) if step == 0 else end

    def block_end(self, ctx: StepContext) -> int:
        if self._ids is None:
            raise DllmError("sampler 'adablock' needs delimiter ids: decode through dllm.generate (which reads "
                            "them from the tokenizer) or set delimiter_ids")
        # one draw serves the block length and the block's first step, as the reference's `predicted_tokens`
        tokens = ctx.state.block_start_tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        size = self._window(ctx.prompt_length, ctx.canvas.shape[1], ctx.block_start)
        if size < 1:  # gen_length < 4: no window, the default block
            return ctx.block_end
        window = (ctx.positions >= ctx.block_start) & (ctx.positions < ctx.block_start + size)
        conf = token_probability(ctx.logits[:, window], tokens[:, window], ctx.unscored).double()
        conf = torch.where(torch.isin(tokens[:, window], self._ids.to(tokens.device)), conf, -1.0)
        best_conf, best = conf.max(-1)  # first maximum: ties go to the lowest position
        tau = torch.tensor([DELIMITER_THRESHOLD[ctx.family] if t is None else t  # None: the family's
                            for t in row_values(self.delimiter_threshold, len(best))], dtype=best_conf.dtype)
        ends = torch.where(best_conf >= tau.to(best_conf.device), ctx.block_start + best + 1, ctx.block_end)
        active = ctx.masked.any(1)
        return int(ends[active].min()) if active.any() else ctx.block_end

    def step(self, ctx: StepContext) -> Commit:
        tokens = ctx.state.__dict__.pop("block_start_tokens", None)
        if tokens is None:
            tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        confidence = token_probability(ctx.logits, tokens, ctx.unscored)
        return Commit(threshold_commit(confidence, ctx.eligible, self.threshold), tokens, confidence)
