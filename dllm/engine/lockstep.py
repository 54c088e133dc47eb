"""Batches on a tensor-parallel model: every rank runs rank 0's batches in lockstep (spec `parallel_and_engine.md` A4,
SPMD). Rank 0's `Batch` shares itself with the other ranks (each builds its own on its shard of the model, see
`dllm.models.parallel`) and posts every call that changes it (rows added, removed, cancelled); a block starts on every
rank at once. After every step the ranks all-gather a hash of their canvases and whether rank 0 has calls for them
(`step_flags`): ranks that ever disagree fail at that step, and the calls rank 0's callback made (`dllm serve` reads
its inbox there, and may cancel rows) reach the others then, only when there are any. Nothing else is sent: plans,
samplers' decisions and commits follow on every rank from the same numbers."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from ..cache import PrefixBlocks
from ..core.errors import DllmError
from ..models.parallel import RankFailed, Ranks

if TYPE_CHECKING:
    from .loop import Batch


def share_batch(batch: Batch, make: Callable, *args) -> None:
    """Rank 0: the other ranks build their copy of `batch` by `make(*args)` (the model and the prefix cache as their
    own: a prefix cache is shared the first time)."""
    prefix = batch.prefix
    if prefix is not None and getattr(prefix, "_tp_key", None) is None:
        batch.ranks.share(prefix, PrefixBlocks, batch.model, prefix.capacity / 2**20)
    batch.ranks.share(batch, make, *args)


def lead_block(batch: Batch, run: Callable[[], None]) -> None:
    """Rank 0's block: the other ranks start it too. An error other than a `DllmError` (which every rank raises alike)
    leaves the ranks out of step: the group fails."""
    ranks, callback = batch.ranks, batch.callback
    ranks.send(_follow_block, batch)
    if callback is not None:
        batch.callback = lambda info: _lead_step(batch, callback, info)
    try:
        run()
    except DllmError:
        raise
    except BaseException as error:
        ranks.failure = ranks.failure or (f"rank 0 stopped inside a block ({type(error).__name__}); the model's ranks "
                                          f"are out of step, load it again")
        raise
    finally:
        batch.callback = callback


def _lead_step(batch: Batch, callback: Callable[[dict], None], info: dict) -> None:
    """Rank 0's callback; if it raises, the other ranks stop their block where they take the step's calls."""
    try:
        callback(info)
    except BaseException:
        if batch.ranks.failure is None:
            batch.ranks.post(_stop_block)
            step_flags(batch.ranks, batch.canvas.tokens)
            batch.ranks.send()
        raise


def _follow_block(batch: Batch) -> None:
    """The other ranks: run the block rank 0 runs. A `DllmError` stops the block here as it stops rank 0's (the ranks
    decide alike)."""
    try:
        batch.run_block()
    except RankFailed:
        raise
    except DllmError:
        pass


def _stop_block() -> None:
    raise DllmError("rank 0 stopped this block")


def step_flags(ranks: Ranks, tokens: Tensor) -> Tensor:
    """Every rank, after each step: device bools `[2]`, whether the ranks' canvases `tokens` `[B, L]` differ (their
    hashes, all-gathered, are not all equal) and whether rank 0 has calls for the others (`take_calls`), in one
    all-gather of two numbers."""
    flat = tokens.flatten()
    weights = torch.arange(1, len(flat) + 1, device=flat.device) * 2654435761  # Knuth's multiplicative constant
    digest = ((flat + 1) * weights).sum()  # int64, wrapping
    calls = torch.tensor(len(ranks.pending) if ranks.leader else 0, device=flat.device)
    gathered = ranks.all_gather(torch.stack((digest, calls)), "check")
    return torch.stack(((gathered[:, 0] != gathered[0, 0]).any(), gathered[0, 1] > 0))


def take_calls(ranks: Ranks) -> None:
    """After a step whose `step_flags` said rank 0 has calls (a callback's cancels): rank 0 sends them, the other
    ranks make them."""
    if ranks.leader:
        ranks.send()
    else:
        for fn, args in ranks.receive():
            fn(*args)
