"""A batch for a model (`new_batch`: a `Lockstep` on a tensor-parallel model) and a fixed batch decoded to its end
(`decode`, `decoded`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ..samplers import Daedal
from .canvas import Canvas
from .checks import check_lengths
from .guidance import Guidance
from .layouts import GrowingCanvas, Layout
from .lockstep import Lockstep
from .logprobs import check_logprobs
from .loop import Batch
from .options import LoopOptions
from .stats import Stats

if TYPE_CHECKING:
    from ..cache import Cache, PrefixBlocks
    from ..models import DiffusionLM
    from ..samplers import Sampler


def new_batch(model: DiffusionLM, sampler: Sampler, cache: Cache, block_length: int, steps_per_block: int,
              options: LoopOptions | None = None, layout: Layout | None = None) -> Batch:
    """A `Batch`; on a tensor-parallel model (`model.tp`) a `Lockstep`, which every rank runs."""
    make = Batch if model.tp is None else Lockstep
    return make(model, sampler, cache, block_length, steps_per_block, options, layout)


@torch.no_grad()
def decode(model: DiffusionLM, prompts: list[list[int]], sampler: Sampler, cache: Cache,
           gen_length: int | Daedal, block_length: int, steps: int | None = None,
           seed: int | list[int] = 0, stop_early: bool = True,
           trace: bool = False, profile: bool = False, callback: Callable[[dict], None] | None = None,
           compile: bool = False, guidance: Guidance = Guidance()) -> tuple[Canvas, Stats, list[dict] | None]:
    """Decode token-id prompts as one fixed batch (every row seeded with `seed`, or row i with `seed[i]`; `gen_length`
    a `samplers.Daedal`: gen_length auto, each answer choosing its length); returns
    the final canvas, statistics and (optionally) a per-step trace. `profile` times every forward (synchronizing
    the device) into `stats.forward_seconds` by kind: `full` (every canvas row computed), `cached` (the other
    rows read from the cache), `verify` (draft batches). See `LoopOptions` for `callback`, `compile` and `guidance`."""
    batch = decoded(model, prompts, sampler, cache, gen_length, block_length, steps, seed, stop_early, trace, profile,
                    callback, compile, guidance=guidance)
    return batch.canvas, batch.finish(), batch.trace


@torch.no_grad()
def decoded(model: DiffusionLM, prompts: list[list[int]], sampler: Sampler, cache: Cache,
            gen_length: int | Daedal, block_length: int, steps: int | None = None,
            seed: int | list[int] = 0, stop_early: bool = True,
            trace: bool = False, profile: bool = False, callback: Callable[[dict], None] | None = None,
            compile: bool = False, logprobs: int | None = None, prefix_cache: PrefixBlocks | None = None,
            guidance: Guidance = Guidance()) -> Batch:
    """`decode`'s batch once decoded: its rows' answers and (`logprobs=k`) their log-probabilities; `prefix_cache`
    and `guidance` as `LoopOptions`'."""
    steps_per_block = check_lengths(gen_length, block_length, steps, uniform=model.config.mask_id is None)
    auto = isinstance(gen_length, Daedal)  # gen_length auto: the answers start at its initial length
    Canvas.check(model, prompts, gen_length.initial_gen_length if auto else gen_length)  # each error before any work
    check_logprobs(logprobs)
    options = LoopOptions(stop_early, trace, profile, callback, compile, guidance, prefix_cache)
    batch = new_batch(model, sampler, cache, block_length, steps_per_block, options,
                      GrowingCanvas(gen_length) if auto else None)
    for ids, row_seed in zip(prompts, seed if isinstance(seed, list) else [seed] * len(prompts)):
        batch.add(ids, gen_length, row_seed, logprobs=logprobs)
    while batch.running:
        batch.run_block()
    return batch
