"""Cache policies: which canvas rows go through the network each step, and where the other rows' keys and
values come from. Every policy stores K/V after RoPE in one full-length store (spec `dkv_elastic_cache.md`
section 2) and counts the rows it computed per layer, so cost is counted, never estimated."""
from __future__ import annotations

from .base import CACHES, Cache, KVStore, PassThrough, PlanContext, gather_rows, register, row_slots, zeros
from . import blockwise, dkv, elastic, d2cache, dllm_cache  # noqa: F401,I001  (registers the built-in caches)
from .prefix_blocks import PrefixBlocks

__all__ = ["CACHES", "Cache", "KVStore", "PassThrough", "PlanContext", "PrefixBlocks", "gather_rows", "register",
           "row_slots", "zeros"]
