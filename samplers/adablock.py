"""AdaBlock-dLLM (arXiv 2509.26432; spec `adablock_selfspec.md`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from dllm.core.errors import DllmError
from dllm.core.params import param

from .base import Commit, Sampler, StepContext, gumbel_argmax, register, row_values, token_probability
from .fastdllm import threshold_commit

DELIMITER_THRESHOLD = {"llada": 0.3, "dream": 0.5}  # AdaBlock's tau_D per model family


@register("adablock")
@dataclass
class AdaBlock(Sampler):
    """AdaBlock-dLLM (arXiv 2509.26432): at each block start, end the block on the most confident predicted
    delimiter in a window of gen_length/4 if its confidence reaches delimiter_threshold; threshold decoding
    inside. Batch rows share block boundaries: the smallest block any row asks for is used."""

    reads_shards: ClassVar[bool] = True

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
