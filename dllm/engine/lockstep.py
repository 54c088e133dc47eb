"""Batches on a tensor-parallel model: every rank runs rank 0's batches in lockstep (spec `parallel_and_engine.md` A4,
SPMD). `Lockstep` is the `Batch` of a tensor-parallel model: rank 0's shares itself with the other ranks (each builds
its own on its shard of the model, see `dllm.models.parallel`) and posts every call that changes it (rows added,
removed, cancelled); a block starts on every rank at once. After every step the ranks all-gather a hash of their
canvases and whether rank 0 has calls for them (`step_flags`): ranks that ever disagree fail at that step, and the
calls rank 0's callback made (`dllm serve` reads its inbox there, and may cancel rows) reach the others then, only when
there are any. Nothing else is sent: plans, samplers' decisions and commits follow on every rank from the same
numbers."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import Tensor

from ..cache import PrefixBlocks
from ..core.errors import DllmError
from ..models.parallel import RankFailed, Ranks
from .layouts import GrowingCanvas, Row
from .loop import Batch


class Lockstep(Batch):
    """A `Batch` that every rank of a tensor-parallel model (`model.tp`) runs: rank 0's tells the others' every
    change, and every step checks that their canvases agree."""

    def __init__(self, model, sampler, cache, block_length: int, steps_per_block: int, options=None, layout=None):
        if isinstance(layout, GrowingCanvas):
            raise DllmError("gen_length auto grows the canvas on one process only; give a fixed gen_length on a "
                            "tensor-parallel model")
        super().__init__(model, sampler, cache, block_length, steps_per_block, options, layout)
        self.ranks: Ranks = model.tp.ranks
        if self.ranks.leader:  # the others build theirs (the prefix cache shared the first time), without the callback
            prefix = self.prefix
            if prefix is not None and getattr(prefix, "_tp_key", None) is None:
                self.ranks.share(prefix, PrefixBlocks, model, prefix.capacity / 2**20)
            self.ranks.share(self, Lockstep, model, sampler, cache, block_length, steps_per_block,
                             replace(self.options, callback=None), layout)

    def _tell(self, method: Callable, *args) -> None:
        """Rank 0: the other ranks make this call on their copy of the batch."""
        if self.ranks.leader:
            self.ranks.post(method, self, *args)

    def add(self, prompt: list[int], gen_length, seed: int = 0, sampler=None, logprobs: int | None = None) -> Row:
        row = super().add(prompt, gen_length, seed, sampler, logprobs)
        self._tell(Lockstep.add, prompt, gen_length, seed, sampler, logprobs)
        return row

    def remove(self, row: Row) -> None:
        index = self.rows.index(row)
        super().remove(row)
        self._tell(_remove_row, index)

    def cancel(self, row: Row) -> None:
        self._tell(_cancel_row, self.rows.index(row))
        super().cancel(row)

    def finish(self):
        self._tell(Lockstep.finish)
        return super().finish()

    @torch.no_grad()
    def run_block(self) -> None:
        """Rank 0's block: the other ranks start it too. An error other than a `DllmError` (which every rank raises
        alike) leaves the ranks out of step: the group fails."""
        if not self.ranks.leader:
            return super().run_block()
        ranks, options = self.ranks, self.options
        ranks.send(_follow_block, self)
        if options.callback is not None:
            self.options = replace(options, callback=lambda info: self._lead_step(options.callback, info))
        try:
            super().run_block()
        except DllmError:
            raise
        except BaseException as error:
            ranks.failure = ranks.failure or (f"rank 0 stopped inside a block ({type(error).__name__}); the model's "
                                              f"ranks are out of step, load it again")
            raise
        finally:
            self.options = options

    def _lead_step(self, callback: Callable[[dict], None], info: dict) -> None:
        """Rank 0's callback; if it raises, the other ranks stop their block where they take the step's calls."""
        try:
            callback(info)
        except BaseException:
            if self.ranks.failure is None:
                self.ranks.post(_stop_block)
                step_flags(self.ranks, self.canvas.tokens)
                self.ranks.send()
            raise

    def _watch(self) -> list[Tensor]:
        """Every rank holds the same canvas; rank 0's callback may have calls for the others."""
        return list(step_flags(self.ranks, self.canvas.tokens))

    def _watched(self, flags: list, ctx, out, open_now: list[bool], columns: tuple[int, int]) -> list[bool]:
        ranks_differ, calls = flags
        if calls:  # the other ranks make them now (a cancel closes a row): their open rows read again
            take_calls(self.ranks)
            open_now = self._open_rows(*columns, out.again).tolist()
        if ranks_differ:
            raise DllmError(f"the tensor-parallel ranks hold different tokens after block {self.block} step "
                            f"{ctx.step}; their decisions diverged (a nondeterministic kernel?)")
        return open_now


def _follow_block(batch: Lockstep) -> None:
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


def _remove_row(batch: Lockstep, index: int) -> None:
    batch.remove(batch.rows[index])


def _cancel_row(batch: Lockstep, index: int) -> None:
    batch.cancel(batch.rows[index])


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
