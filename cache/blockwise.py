"""No cache, and Fast-dLLM's prefix and dual block caches (arXiv 2505.22618, section 3; spec
`baseline_and_fastdllm.md` section 4). The first step of every block is a full forward whose K/V fill the store
and whose logits decode that step, so refreshes cost no extra forward.

Deviation kept on purpose: for AR-shifted models (Dream) the computed window starts one row earlier
(`start - 1`), so every block position is scored by a recomputed predecessor (d2Cache's choice) instead of
Fast-dLLM's unconditional commit of the first block token at block start. A sampler that commits that token at the
block start and asks for no logits of it afterwards (`logit_window`; speculative's `force_first`, FreeDave's Dream
path) gets the block alone, the row before it kept as the block start left it, as Fast-dLLM's and FreeDave's caches
keep it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dllm.core.params import param
from dllm.models import Rows

from .base import Cache, KVStore, PlanContext, register, zeros


@register("none")
@dataclass
class NoCache(Cache):
    """Recompute the whole canvas every step (vanilla LLaDA/Dream decoding)."""

    stores_kv: ClassVar[bool] = False
    verifies_drafts: ClassVar[bool] = True
    compiles: ClassVar[bool] = True
    covers_window: ClassVar[bool] = True
    block_fresh: ClassVar[bool] = True
    follows_window: ClassVar[bool] = True

    def active_rows(self, step, start, end, length, shift):
        return slice(0, length)


@dataclass
class _Refreshing(Cache):
    verifies_drafts: ClassVar[bool] = True
    compiles: ClassVar[bool] = True
    covers_window: ClassVar[bool] = True
    block_fresh: ClassVar[bool] = True
    refresh_every: int = param(0, "also recompute everything every k steps inside a block (0: block start only)", ge=0)

    def full_step(self, step: int) -> bool:
        return step == 0 or (self.refresh_every > 0 and step % self.refresh_every == 0)


@register("prefix")
@dataclass
class PrefixCache(_Refreshing):
    """Fast-dLLM PrefixCache: cache prompt and finished blocks; recompute the block and everything after it."""

    def active_rows(self, step, start, end, length, shift):
        return slice(0, length) if self.full_step(step) else slice(start, length)


@register("dual")
@dataclass
class DualCache(_Refreshing):
    """Fast-dLLM DualCache: cache prefix and masked suffix; recompute only the current block."""

    def active_rows(self, step, start, end, length, shift):
        return slice(0, length) if self.full_step(step) else slice(start, end)


@register("block")
@dataclass
class BlockCache(Cache):
    """The exact cache of block-causal models (SDAR; spec `block_diffusion_moe.md` section 1) and causal-prefix ones
    (Nemotron-Labs-Diffusion): a finished block only attends to itself and earlier blocks, so its keys and values
    never change. The first forward after a
    fresh store computes everything before the block's end (the prompt's blocks); each block-start forward also
    recomputes the block just finished (its final tokens: SDAR's extra forward folded into the next one); every
    other step computes the block alone (from the row before it on an AR-shifted model, Fast-dLLM v2: that row
    scores the block's first token). Equal to recomputing everything every step."""

    compiles: ClassVar[bool] = True
    covers_window: ClassVar[bool] = True
    verifies_drafts: ClassVar[bool] = True  # past step 0 its only state is the store (`final` is set at step 0)
    block_fresh: ClassVar[bool] = True  # a fresh store at a block start recomputes what it needs
    block_causal_only: ClassVar[bool] = True
    keeps_final_blocks: ClassVar[bool] = True

    def new_kv(self, model, batch: int, length: int, allocate=zeros) -> KVStore:
        kv = super().new_kv(model, batch, length, allocate)
        kv.final = 0  # rows before this hold their blocks' final keys and values
        return kv

    def plan(self, kv: KVStore, plan: PlanContext) -> Rows:
        first = kv.final if plan.step == 0 else plan.start
        if plan.step == 0:
            kv.final = plan.start
        return Rows(slice(max(min(first, plan.lo - plan.shift), 0), max(plan.end, plan.hi)))


@register("frontier")
@dataclass
class FrontierCache(Cache):
    """The exact cache of causal models (WeDLM; spec `wedlm.md` 5 item 5): a token whose every predecessor is
    committed sees only committed tokens, so its keys and values, computed in a forward planned then, are final.
    Each forward computes from the frontier (the previous forward's first column, where every row's first
    uncommitted position was at or after it) to the window's end, `W + p` rows per step of WeDLM's window; the first
    forward of a fresh store computes everything before the window's end. Equal to recomputing everything every
    step (fixed blocks too)."""

    compiles: ClassVar[bool] = True
    covers_window: ClassVar[bool] = True
    verifies_drafts: ClassVar[bool] = True
    block_fresh: ClassVar[bool] = True
    block_causal_only: ClassVar[bool] = True
    follows_window: ClassVar[bool] = True

    def new_kv(self, model, batch: int, length: int, allocate=zeros) -> KVStore:
        kv = super().new_kv(model, batch, length, allocate)
        kv.frontier = 0  # rows before this hold final keys and values
        return kv

    def plan(self, kv: KVStore, plan: PlanContext) -> Rows:
        first, kv.frontier = kv.frontier, min(plan.start, plan.lo)
        return Rows(slice(max(min(first, plan.lo - plan.shift), 0), max(plan.end, plan.hi)))
