"""Samplers: which masked positions to commit at a step, and with which tokens.

Every sampler is a small dataclass registered by name with one signature, `step(ctx) -> Commit`
(k-diffusion style). Add your own with `@samplers.register("name")` on a `Sampler` subclass."""
from __future__ import annotations

from dllm.core.params import Registry

from .base import Commit, Sampler, StepContext, stack_rows

SAMPLERS = Registry("sampler", Sampler)
register = SAMPLERS.register

from . import llada, fastdllm, dream, research, speculative, block_diffusion, indel, entropy_bound  # noqa: E402,F401,I001  (registers the built-in samplers, in order)

__all__ = ["SAMPLERS", "Commit", "Sampler", "StepContext", "register", "stack_rows"]
