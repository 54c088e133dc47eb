"""Batches on a tensor-parallel model: every rank runs rank 0's batches in lockstep (spec `parallel_and_engine.md` A4,
SPMD). Rank 0's `Batch` shares itself with the other ranks (each builds its own on its shard of the model, see
`dllm.models.parallel`) and posts every call that changes it (rows added, removed, cancelled); a block starts on every
rank at once, and where rank 0 runs a callback after each step (`dllm serve` reads its inbox there, and may cancel
rows) the other ranks take rank 0's calls of that step at the same point. Nothing else is sent: plans, samplers'
decisions and commits follow on every rank from the same numbers. After every step each rank's canvas is hashed and
the hashes compared (`ranks_differ`), so ranks that ever disagree fail at that step."""
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
    """Rank 0's block: the other ranks start it too; a callback after each step sends that step's calls (and on an
    error stops theirs). An error other than a `DllmError` (which every rank raises alike) leaves the ranks out of
    step: the group fails."""
    ranks, callback = batch.ranks, batch.callback
    ranks.send(_follow_block, batch, callback is not None)
    if callback is not None:
        batch.callback = lambda info: _lead_step(ranks, callback, info)
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


def _lead_step(ranks: Ranks, callback: Callable[[dict], None], info: dict) -> None:
    try:
        callback(info)
    except BaseException:
        if ranks.failure is None:
            ranks.send(_stop_block)
        raise
    ranks.send()


def _follow_block(batch: Batch, synced: bool) -> None:
    """The other ranks: run the block rank 0 runs, taking rank 0's calls after each step where it has a callback. A
    `DllmError` stops the block here as it stops rank 0's (the ranks decide alike)."""
    batch.callback = (lambda info: _follow_step(batch.ranks)) if synced else None
    try:
        batch.run_block()
    except RankFailed:
        raise
    except DllmError:
        pass
    finally:
        batch.callback = None


def _follow_step(ranks: Ranks) -> None:
    for fn, args in ranks.receive():
        fn(*args)


def _stop_block() -> None:
    raise DllmError("rank 0 stopped this block")


def ranks_differ(ranks: Ranks, tokens: Tensor) -> Tensor:
    """A device bool: the ranks' canvases `tokens` `[B, L]` differ (their hashes, all-gathered, are not all equal)."""
    flat = tokens.flatten()
    weights = torch.arange(1, len(flat) + 1, device=flat.device) * 2654435761  # Knuth's multiplicative constant
    digest = ((flat + 1) * weights).sum()[None]  # int64, wrapping
    gathered = ranks.all_gather(digest, "check")
    return (gathered != gathered[0]).any()
