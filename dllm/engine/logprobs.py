"""Log-probabilities of the committed tokens (`logprobs=k`): each token's, under the distribution the sampler drew it
from (`Sampler.log_distribution`), with the k most probable tokens of that distribution, captured at the step that
wrote the token and never overwritten by a later step (the semantics vLLM's diffusion support gives RL users).

A token rewritten by a token-editing sampler (`edits`, LLaDA2.1) is a new token: its log-probability is captured
again at the step that rewrote it, so every answer token carries the distribution it was drawn from."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.checks import check_int
from ..core.errors import DllmError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs (vLLM's default max_logprobs)


def check_logprobs(value, sampler=None, name: str = "logprobs") -> int | None:
    """None (off) or the number of alternatives to report per token, 0..`MAX_TOP_LOGPROBS`, for `sampler`."""
    if value is None:
        return None
    value = check_int(name, value, 0, MAX_TOP_LOGPROBS)
    if sampler is not None and sampler.moves_tokens:
        raise DllmError(f"sampler {sampler.name!r} moves decoded tokens to other positions (insert/delete), so a "
                        f"token's log-probability cannot follow it; drop {name}")
    if sampler is not None and sampler.leaves_masks:
        raise DllmError(f"sampler {sampler.name!r} leaves the positions it gives up masked, which have no "
                        f"log-probability; drop {name} or its threshold")
    return value


@dataclass
class TokenLogprob:
    token: int
    logprob: float  # of `token` under the distribution it was drawn from, at the step that committed it
    top: list[tuple[int, float]]  # the k most probable (token, logprob) of that distribution, most probable first


class Captured:
    """The log-probabilities of a batch's tokens in canvas columns, beside `Canvas.tokens`: `values` `[B, L, 1 + k]`
    (the written token's, then the step's k best), `ids` `[B, L, k]`; NaN and -1 where nothing was captured (the
    prompt, masks). A row keeps its own columns between layouts (`cut`, `lay_out`), as it keeps its tokens."""

    def __init__(self, values: Tensor, ids: Tensor):
        self.values, self.ids = values, ids

    @classmethod
    def lay_out(cls, saved: list[tuple[Tensor, Tensor] | None], firsts: list[int], length: int, top: int,
                device: torch.device) -> "Captured":
        """A canvas of `length` columns whose row b holds `saved[b]` (a row's `cut`, or None) from column `firsts[b]`."""
        values = torch.full((len(saved), length, 1 + top), float("nan"), device=device)
        ids = torch.full((len(saved), length, top), -1, dtype=torch.long, device=device)
        for b, (row, first) in enumerate(zip(saved, firsts)):
            if row is not None:
                width = min(top, row[1].shape[1])
                values[b, first:first + len(row[0]), :1 + width] = row[0][:, :1 + width]
                ids[b, first:first + len(row[0]), :width] = row[1][:, :width]
        return cls(values, ids)

    def cut(self, b: int, first: int, length: int) -> tuple[Tensor, Tensor]:
        """Row b's `length` columns from `first`."""
        return self.values[b, first:first + length].clone(), self.ids[b, first:first + length].clone()

    def write(self, written: Tensor, lo: int, hi: int, log_probs: Tensor, tokens: Tensor) -> None:
        """Capture at the window `[lo, hi)`'s `written` `[B, C]` positions: their `tokens`' log-probabilities under
        `log_probs` `[B, C, V]` and its k best."""
        top = log_probs.topk(self.ids.shape[-1], dim=-1)
        values = torch.cat((log_probs.gather(-1, tokens[..., None]), top.values), -1)
        self.values[:, lo:hi] = torch.where(written[..., None], values, self.values[:, lo:hi])
        self.ids[:, lo:hi] = torch.where(written[..., None], top.indices, self.ids[:, lo:hi])


def token_logprobs(saved: tuple[Tensor, Tensor], ids: list[int], top: int) -> list[TokenLogprob]:
    """The first `len(ids)` captured positions of a row's answer (`saved`, cut from its answer's start) with `top`
    alternatives each."""
    values, alternatives = saved[0][:len(ids)].tolist(), saved[1][:len(ids), :top].tolist()
    return [TokenLogprob(token, row[0], list(zip(others, row[1:1 + top])))
            for token, row, others in zip(ids, values, alternatives)]
