"""Samplers: which masked positions to commit at a step, and with which tokens.

Every sampler is a small dataclass registered by name with one signature, `step(ctx) -> Commit`
(k-diffusion style). Add your own with `@samplers.register("name")` on a `Sampler` subclass."""
from __future__ import annotations

from .base import SAMPLERS, Commit, ExtraRows, Sampler, StepContext, register, stack_rows
from .daedal import Daedal

# registers the built-in samplers, in order
from . import (llada, fastdllm, dream, credit, localleap, prophet, adablock, hierarchy, speculative,  # noqa: F401,I001
               block_diffusion, indel, entropy_bound, eb_sampler, dus, klass, pc_sampler, wino,
               certainty_prior, wedlm)

__all__ = ["SAMPLERS", "Commit", "Daedal", "ExtraRows", "Sampler", "StepContext", "register", "stack_rows"]
