"""dKV-Cache (Ma et al., arXiv 2505.15781; spec `dkv_elastic_cache.md` 3.3-3.4): delayed caching of decoded
tokens' keys and values.

A token's K/V enter the store one step after it is decoded, from the forward where its real token is first an
input (the one-step delay, paper Eq. 4). The computed rows are any subset of the canvas, gathered with their
original positions (RoPE) and written back in place; the reference's concat-and-reorder key layout is not
needed with the full-length store (spec section 2).

Deviations: ragged batches are supported (per-row rows padded, see `index_rows`; the reference requires equal
counts); dkv_greedy runs on Dream with the logit shift applied to its scheduled rows [R] (the reference is
LLaDA only); the window anchors are processed in position order (the reference follows the random order)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dllm.core.params import param
from dllm.models.transformer import Rows

from .base import Cache, index_rows, predicting_rows, register

DECODE_REFRESH = {"llada": 8, "dream": 4}  # paper Tables 1-3 (LLaDA-8B-Instruct / Dream-Base-7B)


@register("dkv")
@dataclass
class DkvDecode(Cache):
    """dKV-Cache-Decode: reuse decoded tokens' K/V, cached one step after they are decoded.

    Every masked row is recomputed each step, every row every `refresh_every` steps of a block."""

    refresh_every: int | None = param(None, "recompute every row every k steps of a block (None: 8 for LLaDA, "
                                      "4 for Dream, the papers' settings; 1 = no cache)", ge=1)

    def plan(self, kv, plan):
        """Step 0 and every `refresh_every`-th step of a block recompute everything (LLaDA's reference also
        step 1, whose step 0 writes no cache; Dream's does not). Otherwise the rows not yet decoded when the
        previous step was planned: the masks and the tokens decoded at the previous step. For Dream, row j is
        kept while token j + 1 is masked, its prediction (the reference's `shift_type='un'`)."""
        period = self.refresh_every or DECODE_REFRESH[plan.family]
        if plan.decoded is None or plan.step % period == 0 or (plan.step == 1 and plan.family == "llada"):
            return Rows(slice(0, plan.masked.shape[1]))
        return index_rows(predicting_rows(plan.masked | plan.decoded, plan.shift))


@register("dkv_greedy")
@dataclass
class DkvGreedy(Cache):
    """dKV-Cache-Greedy: recompute only the next commits, the last commits and a window of masked neighbours.

    Needs a sampler whose next commits are known before the forward (random)."""

    needs_next_commits: ClassVar[bool] = True

    refresh_every: int = param(2, "recompute every row every k steps of a block (paper: 2; 1 = no cache)", ge=1)
    window: int = param(4, "masked neighbours recomputed around each anchor, alternately left and right "
                        "(paper: 4, 2 for MBPP)", ge=0)
    window_anchor: str = param("next", "anchor the window on the tokens committed next (reference code) or "
                               "just committed (paper text)", choices=("next", "prev"))

    def plan(self, kv, plan):
        if plan.decoded is None or plan.step % self.refresh_every == 0:
            return Rows(slice(0, plan.masked.shape[1]))
        anchors = plan.next_commits if self.window_anchor == "next" else plan.decoded
        near = neighbours(anchors, plan.masked & ~plan.next_commits, self.window)
        return index_rows(plan.decoded | predicting_rows(plan.next_commits | near, plan.shift))


def neighbours(anchors: Tensor, free: Tensor, count: int) -> Tensor:
    """`[B, L]`: for each anchor in position order, the `count` nearest `free` positions not taken yet,
    scanning left and right alternately from distance 1 (left first), as dKV-Cache's `find_window_tokens`."""
    taken = torch.zeros_like(free)
    if count == 0:
        return taken
    canvas = torch.arange(free.shape[1], device=free.device)
    for row, anchor in anchors.nonzero().tolist():
        distance = 2 * (canvas - anchor).abs() - (canvas < anchor).long()  # left at d: 2d - 1, right: 2d
        candidates = (free[row] & ~taken[row]).nonzero()[:, 0]
        order = distance[candidates].argsort(stable=True)
        taken[row, candidates[order[:count]]] = True
    return taken
