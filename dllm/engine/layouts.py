"""Canvas layouts: where each row's answer sits on the canvas and how it advances, a policy the one loop (`Batch`)
asks: `place` (a new row's answer), `window` (the columns of the next block), `logit_columns` (whose logits a
forward returns), `eligible` (which masks a step may commit), `block_end` (where the block ends, once its first
forward is read), `after_commit` (after each step's commit: the next step's columns) and `finish` (which rows are
done). `Blocks` decodes fixed blocks left to right; `GrowingCanvas` lets each answer choose its length (DAEDAL);
`SlidingWindow` slides a window every step, its committed front leaving for the K/V store (WeDLM, spec `wedlm.md`
section 2.7)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from ..core.errors import DllmError
from ..models import Rows
from ..samplers import Commit, Daedal, StepContext
from ..samplers.base import token_probability
from .canvas import Canvas
from .logprobs import TokenLogprob, token_logprobs

if TYPE_CHECKING:
    from ..samplers import Sampler


@dataclass(eq=False)  # a row is itself: compared and hashed by identity
class Row:
    """One prompt in a `Batch`: its tokens (prompt, then its answer canvas), its own random stream and its own
    sampler settings, so its tokens never depend on the rows beside it."""

    prompt: list[int]
    gen_length: int  # answer positions
    origin: int  # where its first block starts: the answer (len(prompt)), or on a block-causal model the
    # attention block the prompt ends in, so that decoded blocks are the model's blocks (SDAR's layout), or where the
    # sampler's `block_origin` puts it
    generator: torch.Generator
    sampler: Sampler  # the batch's sampler, or one that differs from it only in per-row parameters
    tokens: Tensor  # [len(prompt) + gen_length] as of the last layout
    decoded: int = 0  # positions from `origin` before the current block (whole blocks), as of the last layout
    finished: bool = False  # a stop token committed with nothing uncommitted before it
    logprobs: int | None = None  # alternatives per token to capture with its log-probability (None: not captured)
    captured: tuple[Tensor, Tensor] | None = None  # its `Captured` columns, as of the last layout
    given_up: Tensor | None = None  # [len(tokens)] bool: its masks a sampler gave up, as of the last layout
    max_gen_length: int | None = None  # the longest its answer may grow (`GrowingCanvas`, gen_length auto)

    def answer(self, stop_ids) -> list[int]:
        """Its answer so far (see `Batch.answer`)."""
        ids = self.tokens[len(self.prompt):len(self.tokens) if self.finished else self.origin + self.decoded].tolist()
        return ids[:next((i for i, t in enumerate(ids) if t in stop_ids), len(ids))]

    def token_logprobs(self, ids: list[int]) -> list[TokenLogprob]:
        """Its answer `ids` with their log-probabilities."""
        if self.logprobs is None:
            raise DllmError("this row was added without logprobs; add it with logprobs=k (0: no alternatives)")
        if self.captured is None:
            return []
        answer = slice(len(self.prompt), None)
        return token_logprobs((self.captured[0][answer], self.captured[1][answer]), ids, self.logprobs)


class Layout:
    """The interface, with what fixed blocks do where a layout has nothing of its own to say. Each method takes the
    `loop.Batch` it lays out (not imported here: the loop imports its layouts)."""

    joins_between_blocks: ClassVar[bool] = True  # rows may join and leave a running batch between blocks

    def place(self, batch, prompt: list[int], gen_length, sampler: Sampler) -> tuple[int, int, int | None]:
        """A new row's answer: where its first block starts, its answer positions and the most it may grow to."""
        raise NotImplementedError

    def answer_length(self, row: Row) -> int:
        """The positions of `row`'s answer canvas that are answer (the canvas may run past them)."""
        return row.gen_length

    def window(self, batch) -> tuple[int, int]:
        """The columns `[start, end)` of the next block (every row's current block sits at the same columns)."""
        return batch.start, min(batch.start + batch.block_length, batch.canvas.tokens.shape[1])

    def logit_columns(self, batch, lo: int, hi: int) -> tuple[int, int]:
        """The columns whose logits a step's forward returns (the loop reads `[lo, hi)` of them)."""
        return lo, hi

    def eligible(self, batch, ctx: StepContext) -> Tensor:
        """`[B, C]` the positions the step may commit: the block's masks (`ctx.eligible`)."""
        return ctx.eligible

    def block_end(self, batch, ctx: StepContext) -> int:
        """Where the block ends, chosen by the sampler with the block's first forward (AdaBlock's `block_end`); `ctx`
        follows it."""
        end, length = batch.stacked.block_end(ctx), batch.canvas.tokens.shape[1]
        if not ctx.block_start < end <= length:
            raise DllmError(f"sampler {batch.sampler.name!r} chose block end {end} outside ({ctx.block_start}, "
                            f"{length}]")
        ctx.block_end = end
        ctx.eligible = ctx.masked & (ctx.positions >= ctx.block_start) & (ctx.positions < end)
        return end

    def after_commit(self, batch, ctx: StepContext, out: Commit, commit: Tensor) -> tuple[int, int]:
        """After a step's commit (and its `finish`): the columns of the next step."""
        return ctx.block_start, ctx.block_end

    def finish(self, batch, start: int, block_over: bool) -> None:
        """Mark the rows whose answer is complete (stop_early), after a step of the block from `start` or once the
        block is over: a committed stop token with nothing uncommitted before it, and nothing a sampler that edits
        (`Sampler.edits`, WINO's re-masks) may still change before it (the block's tokens, until it is over)."""
        edits = batch.sampler.edits
        if edits or not block_over:
            final_before = start if edits and not block_over else None
            batch.set_finished(batch.canvas.finish_rows(batch.finished, batch.model.config, final_before))


def aligned(batch, prompt: list[int], gen_length: int, sampler: Sampler) -> tuple[int, int]:
    """A row's block origin and answer positions: from the sampler's `block_origin`, or on a block-causal model from
    the attention block the prompt ends in to the end of the answer's last block (SDAR's layout)."""
    model = batch.model
    Canvas.check(model, [prompt], gen_length)
    origin = sampler.block_origin(len(prompt), batch.block_length)
    if not 0 <= origin <= len(prompt):
        raise DllmError(f"sampler {sampler.name!r} starts the first block at {origin}, outside the prompt "
                        f"[0, {len(prompt)}]; return a position in it from block_origin")
    size = model.config.block_size
    if size:  # whole attention blocks, the answer from the prompt's end to the end of its last block
        origin = len(prompt) // size * size
        gen_length = -(-(len(prompt) + gen_length) // size) * size - len(prompt)
    return origin, gen_length


MIXED = "a batch decodes gen_length auto or fixed lengths, not both; give every row the batch's length policy"


class Blocks(Layout):
    """Fixed blocks of `block_length` columns from each row's origin, decoded left to right."""

    def place(self, batch, prompt: list[int], gen_length, sampler: Sampler) -> tuple[int, int, int | None]:
        if isinstance(gen_length, Daedal):
            raise DllmError(MIXED)
        if gen_length % batch.block_length:
            raise DllmError(f"gen_length ({gen_length}) must be a multiple of block_length ({batch.block_length}); "
                            f"e.g. gen_length {-(-gen_length // batch.block_length) * batch.block_length}")
        return (*aligned(batch, prompt, gen_length, sampler), None)


class GrowingCanvas(Layout):
    """gen_length auto (a `samplers.Daedal`, DAEDAL): each answer chooses its length, growing before the first block
    (`choose_lengths`) and inside blocks (`after_commit`), through one canvas operation (`insert`). Rows are added
    with the policy as their gen_length, and none joins a running batch. Its forwards return the logits of every
    answer column (for the EOS confidence)."""

    joins_between_blocks = False

    def __init__(self, length: Daedal):
        self.length = length

    def place(self, batch, prompt: list[int], gen_length, sampler: Sampler) -> tuple[int, int, int | None]:
        if gen_length is not self.length:
            raise DllmError(MIXED)
        limit = self.length.limit(len(prompt), batch.model.config.max_length)
        return (*aligned(batch, prompt, self.length.initial_gen_length, sampler), limit)

    def window(self, batch) -> tuple[int, int]:
        if batch.block == 0:
            self.choose_lengths(batch)
        return super().window(batch)

    def logit_columns(self, batch, lo: int, hi: int) -> tuple[int, int]:
        return batch.canvas.prompt_length, batch.canvas.tokens.shape[1]

    def choose_lengths(self, batch) -> None:
        """DAEDAL's stage 1 (`Daedal.growth`): each forward grows the rows whose EOS confidence is low by masks at
        their end; a row whose length is chosen leaves the later forwards (as it would alone). Then EOS tokens end
        each answer (`Daedal.tail`). Every forward is counted (at least one)."""
        growing, cfg, rows = [True] * len(batch.rows), batch.model.config, batch.rows
        while any(growing):
            first, width = batch.canvas.prompt_length, batch.canvas.tokens.shape[1]
            logits = batch.logits(first, width, Rows(slice(0, width)), growing, 0, (first, width))  # every row
            eos = self.length.eos_confidence(logits, batch.canvas.answer[:, first:], cfg.filler_id)
            grow = self.length.growth(eos, [row.gen_length for row in rows], [row.max_gen_length for row in rows])
            growing = [was and n > 0 for was, n in zip(growing, grow)]
            self.insert(batch, {b: (end_column(batch, b), n, cfg.mask_id) for b, n in enumerate(grow) if growing[b]})
        self.insert(batch, {b: (end_column(batch, b), self.length.tail(row.gen_length, row.max_gen_length),
                                cfg.filler_id) for b, row in enumerate(rows)})

    def after_commit(self, batch, ctx: StepContext, out: Commit, commit: Tensor) -> tuple[int, int]:
        """DAEDAL's stage 2 (`Daedal.expansion`): an unfinished row whose EOS confidence (from the step's logits of
        its whole answer) is low turns the least confident mask of the block that the step left into
        `expansion_factor` masks. The block keeps its columns."""
        canvas, cfg = batch.canvas, batch.model.config
        eos = self.length.eos_confidence(batch.forward_logits, canvas.answer[:, canvas.prompt_length:],
                                         cfg.filler_id)
        limits = torch.tensor([row.max_gen_length for row in batch.rows], device=canvas.gen_end.device)
        where = self.length.expansion(eos, token_probability(ctx.logits, out.tokens),
                                      ctx.eligible & ~commit & batch.unfinished[:, None],
                                      canvas.gen_end - canvas.gen_start < limits).tolist()
        self.insert(batch, {b: (int(ctx.positions[j]), self.length.expansion_factor - 1, cfg.mask_id)
                            for b, j in enumerate(where) if j >= 0})
        return ctx.block_start, ctx.block_end

    @staticmethod
    def insert(batch, inserts: dict[int, tuple[int, int, int]]) -> None:
        """The canvas operation: row b gets `count` tokens `token` before canvas column `column` (`inserts[b]`), its
        later tokens (and captured log-probabilities) moving right, its answer cut at its `max_gen_length`; then the
        rows are laid out anew, current blocks at the same columns, with a fresh store and sampler state (so only
        samplers that keep no state per position and caches that store nothing: `checks.check_auto_length`)."""
        if not any(count for _, count, _ in inserts.values()):
            return
        batch.saved = False  # the block's steps have written into the canvas since the rows were last saved
        batch.save()
        for b, (column, count, token) in inserts.items():
            row = batch.rows[b]
            at, keep = column - batch.firsts[b], len(row.prompt) + row.max_gen_length
            row.tokens = _spliced(row.tokens, at, count, token)[:keep]
            row.gen_length = len(row.tokens) - len(row.prompt)
            if row.captured is not None:
                row.captured = tuple(_spliced(t, at, count, fill)[:keep]
                                     for t, fill in zip(row.captured, (float("nan"), -1)))
        batch.lay_out()


def end_column(batch, b: int) -> int:
    """The canvas column after row b's last token."""
    return batch.firsts[b] + len(batch.rows[b].tokens)


def _spliced(t: Tensor, at: int, count: int, fill) -> Tensor:
    """`t` with `count` rows of `fill` inserted before row `at`."""
    return torch.cat((t[:at], t.new_full((count, *t.shape[1:]), fill), t[at:]))


class SlidingWindow(Layout):
    """WeDLM's streaming window (spec `wedlm.md` 2.7, 5), for a sampler that `slides`: a row's answer is
    `max_tokens + W - 1` slots (the window runs W - 1 past the last answer token) with a filled flag of their own
    (`Canvas.uncommitted`: a predicted mask id is a token); each step a row may fill the unfilled slots of
    `[f, f + W)`, f its first unfilled slot, and the leading filled run before f is final (its keys and values are a
    causal forward's: the `frontier` cache keeps them). A row ends, without another forward, once a stop token lies
    before f (stop_early) or f has passed `max_tokens` slots; its answer is cut there. A step is a block of the
    loop, over the columns of the open rows' windows, `[min f, max f + W)`; it ends at the first front, where rows
    may join (laid out anew, their fronts aligned, each running row's filled flags kept)."""

    def __init__(self):
        self.filled_before: tuple[list[Row], list[int], Canvas] | None = None  # the last canvas, its rows and
        # their first columns: its unfilled flags carry over to a canvas laid out anew

    def place(self, batch, prompt: list[int], gen_length, sampler: Sampler) -> tuple[int, int, int | None]:
        if isinstance(gen_length, Daedal):
            raise DllmError(f"sampler {sampler.name!r} decodes max_tokens (gen_length) in a sliding window, not "
                            f"gen_length auto; give gen_length a number")
        slots = gen_length + int(sampler.window_size) - 1
        Canvas.check(batch.model, [prompt], slots)
        return len(prompt), slots, None

    def answer_length(self, row: Row) -> int:
        return row.gen_length - int(row.sampler.window_size) + 1  # max_tokens: the window's W - 1 slack is not

    def window(self, batch) -> tuple[int, int]:
        canvas = batch.canvas
        if canvas.uncommitted is None:  # a fresh canvas: a new row's answer unfilled, a running row's as it was
            canvas.uncommitted = canvas.answer.clone()
            if self.filled_before is not None:
                rows, firsts, before = self.filled_before
                unfilled = before.uncommitted
                for b, row in enumerate(batch.rows):
                    if row in rows:
                        i, new = rows.index(row), batch.firsts[b]
                        canvas.uncommitted[b, new:new + len(row.tokens)] = \
                            unfilled[i, firsts[i]:firsts[i] + len(row.tokens)]
        self.filled_before = list(batch.rows), list(batch.firsts), canvas
        self.sizes = torch.tensor([int(row.sampler.window_size) for row in batch.rows], device=canvas.tokens.device)
        self.max_tokens = torch.tensor([row.gen_length for row in batch.rows], device=canvas.tokens.device
                                       ) - self.sizes + 1
        return self.columns(batch)

    def fronts(self, batch) -> Tensor:
        """[B] each row's first unfilled answer column (its answer's end when none)."""
        canvas = batch.canvas
        column = torch.arange(canvas.tokens.shape[1], device=canvas.tokens.device)
        return torch.where(canvas.uncommitted, column, canvas.gen_end[:, None]).amin(1)

    def columns(self, batch) -> tuple[int, int]:
        """The columns of the open rows' windows, `[min f, max f + W)` (one read of the device)."""
        fronts, open_rows, width = self.fronts(batch), batch.unfinished, batch.canvas.tokens.shape[1]
        lo, hi = torch.stack((torch.where(open_rows, fronts, width).min(),
                              torch.where(open_rows, fronts + self.sizes, 0).max())).tolist()
        if lo == width:  # no open row
            return batch.canvas.prompt_length, batch.canvas.prompt_length
        return lo, min(hi, width)

    def eligible(self, batch, ctx: StepContext) -> Tensor:
        """Each row's masks in its own window `[f, f + W)`: f is its first mask the step sees (`ctx.masked` starts
        at the batch's first front, so every open row's front is in it)."""
        first = torch.where(ctx.masked, ctx.positions, batch.canvas.tokens.shape[1]).amin(1, keepdim=True)
        return ctx.masked & (ctx.positions < first + self.sizes[:, None])

    def block_end(self, batch, ctx: StepContext) -> int:
        return ctx.block_end

    def after_commit(self, batch, ctx: StepContext, out: Commit, commit: Tensor) -> tuple[int, int]:
        """Rows whose front has passed `max_tokens` slots end there. Each step is a block of the loop: its tokens
        before the fronts are final (`dllm.stream` gives them, `dllm serve` streams them) and rows may join before
        the next (`window` finds its columns); the block ends at the first front."""
        canvas = batch.canvas
        cut = canvas.gen_start + self.max_tokens
        self.end(batch, batch.unfinished & (self.fronts(batch) >= cut), cut)
        first = self.columns(batch)[0]
        return first, first

    def finish(self, batch, start: int, block_over: bool) -> None:
        """A stop token before a row's front ends it after the stop (the authors' engine spends one more forward)."""
        canvas = batch.canvas
        column = torch.arange(canvas.tokens.shape[1], device=canvas.tokens.device)
        stops = torch.isin(canvas.tokens, canvas.stop_ids) & (column < self.fronts(batch)[:, None]) & canvas.answer
        first = torch.where(stops, column, canvas.tokens.shape[1]).amin(1)
        self.end(batch, batch.unfinished & stops.any(1), first + 1)

    @staticmethod
    def end(batch, done: Tensor, cut: Tensor) -> None:
        """End the rows `done` `[B]` at the columns `cut` `[B]`: the slots from there on become the filler, and their
        filled tokens leave the count of generated tokens."""
        canvas = batch.canvas
        column = torch.arange(canvas.tokens.shape[1], device=canvas.tokens.device)
        past = done[:, None] & (column >= cut[:, None]) & canvas.answer
        batch.stats.gen_tokens -= int((past & ~canvas.uncommitted).sum())
        canvas.tokens.masked_fill_(past, batch.model.config.filler_id)
        batch.set_finished(batch.finished | done)


def default_layout(sampler: Sampler) -> Layout:
    """The layout a sampler decodes on when none is given: its sliding window, else fixed blocks."""
    return SlidingWindow() if sampler.slides else Blocks()


def check_layout(sampler: Sampler, layout: Layout) -> None:
    """A sliding sampler runs on the sliding window only, and only it does (one line naming the fix)."""
    if sampler.slides and not isinstance(layout, SlidingWindow):
        raise DllmError(f"sampler {sampler.name!r} decodes in a sliding window; give it layouts.SlidingWindow() (or "
                        f"no layout)")
    if isinstance(layout, SlidingWindow) and not sampler.slides:
        raise DllmError(f"sampler {sampler.name!r} decodes blocks, not a sliding window; use sampler wedlm there")
