"""No cache, and Fast-dLLM's prefix and dual block caches (arXiv 2505.22618, section 3; spec
`baseline_and_fastdllm.md` section 4). The first step of every block is a full forward whose K/V fill the store
and whose logits decode that step, so refreshes cost no extra forward.

Deviation kept on purpose: for AR-shifted models (Dream) the computed window starts one row earlier
(`start - 1`), so every block position is scored by a recomputed predecessor (d2Cache's choice) instead of
Fast-dLLM's unconditional commit of the first block token at block start."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dllm.params import param

from . import register
from .base import Cache


@register("none")
@dataclass
class NoCache(Cache):
    """Recompute the whole canvas every step (vanilla LLaDA/Dream decoding)."""

    stores_kv: ClassVar[bool] = False
    verifies_drafts: ClassVar[bool] = True
    compiles: ClassVar[bool] = True
    block_fresh: ClassVar[bool] = True

    def active_rows(self, step, start, end, length, shift):
        return slice(0, length)


@dataclass
class _Refreshing(Cache):
    verifies_drafts: ClassVar[bool] = True
    compiles: ClassVar[bool] = True
    block_fresh: ClassVar[bool] = True
    refresh_every: int = param(0, "also recompute everything every k steps inside a block (0: block start only)", ge=0)

    def full_step(self, step: int) -> bool:
        return step == 0 or (self.refresh_every > 0 and step % self.refresh_every == 0)


@register("prefix")
@dataclass
class PrefixCache(_Refreshing):
    """Fast-dLLM PrefixCache: cache prompt and finished blocks; recompute the block and everything after it."""

    def active_rows(self, step, start, end, length, shift):
        return slice(0, length) if self.full_step(step) else slice(start - shift, length)


@register("dual")
@dataclass
class DualCache(_Refreshing):
    """Fast-dLLM DualCache: cache prefix and masked suffix; recompute only the current block."""

    def active_rows(self, step, start, end, length, shift):
        return slice(0, length) if self.full_step(step) else slice(start - shift, end)
