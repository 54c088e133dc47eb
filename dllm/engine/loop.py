"""The one decode loop: `Batch` decodes its rows block by block, each step a forward of the rows the cache
chose, then the sampler's commits, where its canvas layout (`layouts`) puts the blocks."""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from .. import cache as caches
from .. import samplers as samplers_mod
from ..core.errors import DllmError
from ..models import DiffusionLM, Rows
from ..models.sharded_logits import full_logits
from .canvas import Canvas
from .checks import check_batch
from .layouts import Layout, Row, default_layout
from .logprobs import Captured, TokenLogprob, check_logprobs
from .options import LoopOptions
from .runner import Runner, clock
from .stats import Stats, trace_step

if TYPE_CHECKING:
    from ..cache import Cache
    from ..samplers import Sampler


class Batch:
    """Rows decoded together, block by block, all with the same sampler, cache, canvas layout and options: the one
    decode loop. `decoding.decode` runs a fixed batch to the end; `dllm serve` also adds and removes rows between
    blocks (continuous batching), which re-lays the canvas out so that every row's current block sits at the same
    columns: `[pad | prompt | decoded blocks | current block | later blocks | pad]`. That is exact when the cache
    recomputes every row at a block start (`Cache.block_fresh`) and the sampler looks only at the current block
    (`Sampler.block_local`); `joins_between_blocks` says so. A row may bring its own values of the sampler's per-row
    parameters (`add(..., sampler=...)`); the steps see them stacked into `[B]` tensors (`samplers.stack_rows`).
    `layout` (default: `layouts.default_layout`, fixed blocks or the sampler's sliding window) places the rows'
    blocks and ends rows; `options`: the switches (`LoopOptions`).
    The host waits for the device once per step and once per block. Tensor parallel: `lockstep.Lockstep`."""

    def __init__(self, model: DiffusionLM, sampler: Sampler, cache: Cache, block_length: int, steps_per_block: int,
                 options: LoopOptions | None = None, layout: Layout | None = None):
        options, layout = options or LoopOptions(), layout or default_layout(sampler)
        check_batch(model, sampler, cache, block_length, options, layout)
        self.model, self.sampler, self.cache, self.options, self.layout = model, sampler, cache, options, layout
        self.block_length, self.steps_per_block = block_length, steps_per_block
        self.guidance, self.prefix = options.guidance, options.prefix_cache
        self.joins_between_blocks = sampler.block_local and cache.block_fresh and layout.joins_between_blocks
        self.family = "dream" if model.config.logit_shift else "llada"  # for the defaults papers set per family
        self.rows: list[Row] = []
        self.stats = Stats(batch=0, rows_per_layer=[0] * model.config.n_layers)
        self.trace = [] if options.trace else None
        self.canvas: Canvas | None = None  # None: rows changed since the last layout
        self.runner: Runner | None = None
        self.captured: Captured | None = None  # the rows' log-probabilities, when a row asked for them
        self.saved = True  # the rows hold what the canvas holds
        self.block = 0  # blocks run

    def add(self, prompt: list[int], gen_length: int | samplers_mod.Daedal, seed: int = 0,
            sampler: Sampler | None = None, logprobs: int | None = None) -> Row:
        """A row for `prompt` with `gen_length` answer tokens (whole blocks; or gen_length auto's `samplers.Daedal`,
        the batch's `GrowingCanvas`: its initial masks, grown as it decodes), decoded from the next block on, with
        `sampler`'s settings (default: the batch's): the batch's sampler class with other values of its per-row
        parameters (`Sampler.row_params`: temperature, thresholds, ...), stacked into `[B]` tensors per layout;
        `logprobs=k` captures each token's log-probability with k alternatives (`Batch.logprobs`)."""
        sampler = self.sampler if sampler is None else sampler
        if sampler is not self.sampler and sampler.batch_key() != self.sampler.batch_key():
            raise DllmError(f"a row's sampler {sampler.name!r} {sampler.batch_key()[1:]} differs from the batch's "
                            f"{self.sampler.name!r} {self.sampler.batch_key()[1:]} in more than its per-row "
                            f"parameters ({', '.join(self.sampler.row_params()) or 'none'}); decode it in another batch")
        logprobs = check_logprobs(logprobs, sampler)
        if self.rows and not self.joins_between_blocks and self.block:
            raise DllmError(f"sampler {self.sampler.name!r} with cache {self.cache.name!r} cannot take rows into a "
                            f"running batch (the sampler must look only at the current block and the cache "
                            f"recompute every row at each block start); start a new batch")
        model = self.model
        origin, gen_length, limit = self.layout.place(self, prompt, gen_length, sampler)
        tokens = torch.tensor(list(prompt) + [model.config.placeholder_id] * gen_length, dtype=torch.long)
        row = Row(list(prompt), gen_length, origin, torch.Generator(device=model.device).manual_seed(seed), sampler,
                  tokens, logprobs=logprobs, max_gen_length=limit)
        self.save()
        self.rows.append(row)
        self.canvas = None
        return row

    def remove(self, row: Row) -> None:
        """Take `row` out between blocks (finished, out of blocks, or cancelled)."""
        if not self.joins_between_blocks and self.block:
            raise DllmError(f"sampler {self.sampler.name!r} with cache {self.cache.name!r} cannot drop rows from a "
                            f"running batch; let it finish")
        self.save()
        self.rows.remove(row)
        self.canvas = None

    def cancel(self, row: Row) -> None:
        """Stop decoding `row` from the next step on (take it out between blocks with `remove`)."""
        if self.canvas is None:
            row.finished = True
        else:
            self.finished[self.rows.index(row)] = True
            self.unfinished[self.rows.index(row)] = False
            self.saved = False

    def answer(self, row: Row) -> list[int]:
        """`row`'s answer so far: the tokens of its decoded blocks (of all of them once it has finished: a sampler
        such as Prophet may fill later blocks early), cut before the first stop token. A mask a sampler gave up
        (`Commit.given_up`, DUS) stays the mask id here; texts leave it out (a special token)."""
        self.save()
        return row.answer(self.model.config.stop_ids)

    def logprobs(self, row: Row) -> list[TokenLogprob]:
        """The tokens of `row`'s `answer` with their log-probabilities (a row added with `logprobs`)."""
        return row.token_logprobs(self.answer(row))

    def done(self, row: Row) -> bool:
        """Nothing left to decode: a stop committed, or every block of the row decoded."""
        self.save()
        return row.finished or row.origin + row.decoded >= len(row.prompt) + row.gen_length

    @property
    def running(self) -> bool:
        return any(not self.done(row) for row in self.rows)

    def save(self) -> None:
        """Copy the canvas back into the rows (their tokens, decoded blocks and finished flags)."""
        canvas = self.canvas
        if canvas is None or self.saved:
            return
        finished = self.finished.tolist()
        for b, row in enumerate(self.rows):
            first = int(canvas.gen_start[b]) - len(row.prompt)
            row.tokens = canvas.tokens[b, first:first + len(row.tokens)].clone()
            row.decoded = min(self.start - first - row.origin, len(row.tokens) - row.origin)
            row.finished = finished[b]
            if self.captured is not None:
                row.captured = self.captured.cut(b, first, len(row.tokens))
            if canvas.given_up is not None:
                row.given_up = canvas.given_up[b, first:first + len(row.tokens)].clone()
        self.saved = True

    def lay_out(self) -> None:
        """Lay the rows out on a fresh canvas, current blocks aligned, with a fresh store and sampler state."""
        model, rows = self.model, self.rows
        before = [row.origin + row.decoded for row in rows]  # tokens left of the current block
        self.canvas = Canvas.lay_out(model, [row.tokens for row in rows], before, [len(row.prompt) for row in rows],
                                     self.block_length, [row.given_up for row in rows])
        self.start, self.saved = max(before), False
        self.firsts = [self.start - n for n in before]  # the column of each row's first token
        wanted = [row.logprobs for row in rows if row.logprobs is not None]
        self.captured = None if not wanted else Captured.lay_out(
            [row.captured for row in rows], self.firsts, self.canvas.tokens.shape[1], max(wanted), model.device)
        self._count_store()
        self.runner = Runner(model, self.canvas, self.cache, self.stats, self.options.profile, self.options.compile,
                             self.guidance)
        if self.prefix is not None:
            self.prefix.load(self.runner.kv, [row.tokens[:n].tolist() for row, n in zip(rows, before)], self.firsts)
        self.stats.batch = max(self.stats.batch, len(rows))
        self.state = SimpleNamespace()  # the sampler's per-run state
        self.generators = [row.generator for row in rows]
        self.stacked = samplers_mod.stack_rows([row.sampler for row in rows])  # the rows' settings, for the steps
        self.unscored = self.guidance.unscored(model.config, self.stacked.temperature, model.device)
        self.set_finished(torch.tensor([row.finished for row in rows], dtype=torch.bool, device=model.device))
        self.window = None  # (lo, hi, start, end), positions, in the block: of the last step (`_window`)
        self.never = torch.zeros((), dtype=torch.bool, device=model.device)  # the stall check of a sampler that may
        # commit nothing
        self.masked_at_plan = None  # the canvas's masks when the last forward was planned
        longest = int((self.canvas.gen_end - self.canvas.gen_start).max())
        self.total_steps = self.steps_per_block * -(-longest // self.block_length)  # of the longest row

    def set_finished(self, finished: Tensor) -> None:
        self.finished, self.unfinished = finished, ~finished  # [B] bool, both read at every step

    def _count_store(self) -> None:
        """Add the retiring store's row counts to the statistics."""
        if self.runner is not None:
            kv = self.runner.kv
            self.stats.rows_per_layer = [a + b for a, b in zip(kv.rows_per_layer, self.stats.rows_per_layer)]
            self.stats.cache_bytes = max(self.stats.cache_bytes, kv.nbytes)
            self.runner.retire()
            self.runner = None

    def finish(self) -> Stats:
        """The statistics of everything decoded (call after the last block)."""
        self._count_store()
        return self.stats

    @torch.no_grad()
    def run_block(self) -> None:
        """Decode the next block of every row: a step per forward until no row has a position left in the block that
        is not yet committed (a mask, or a uniform-state model's random token)."""
        if not self.rows:
            raise DllmError("the batch has no rows; add a prompt first")
        if self.canvas is None:
            self.lay_out()
        began = clock(self.model.device)
        start, end = self.layout.window(self)
        committed = torch.zeros((), dtype=torch.long, device=self.model.device)
        step, reused = 0, None  # reused: (window, logits) of a verified draft the sampler committed
        open_now = self._open_rows(start, end).tolist()
        if any(open_now):
            self._fill_block(start, end, open_now)
        while any(open_now):
            counted = list(self.runner.kv.rows_per_layer) if self.trace is not None else None
            lo, hi, rows = self._plan(step, start, end)
            logits = reused[1] if reused is not None and reused[0] == (lo, hi) else self.logits(
                lo, hi, rows, open_now, step, (start, end))
            ctx = self._context(logits, step, start, end, lo, hi, open_now)
            if step == 0:  # the block-start forward may move the block end (AdaBlock)
                end = self.layout.block_end(self, ctx)
            out = self.stacked.step(ctx)
            commit, added, checks, reused = self._write(ctx, out, lo, hi)
            committed += added
            self._after_step(ctx, out, commit, counted)
            start, end = self.layout.after_commit(self, ctx, out, commit)
            open_now = self._open_rows_checked(ctx, out, checks, (start, end))  # the step's one wait for the device
            step += 1
        if self.options.stop_early:  # the block's tokens are final now
            self.layout.finish(self, start, block_over=True)
        if self.prefix is not None:  # offer it the rows' blocks the store holds final (made so by the block's start)
            tokens = self.canvas.tokens[:, :self.runner.kv.final].tolist()
            self.prefix.save(self.runner.kv, [row[first:] for row, first in zip(tokens, self.firsts)], self.firsts)
        self.start, self.block, self.saved = end, self.block + 1, False
        self.stats.seconds += clock(self.model.device) - began
        self.stats.gen_tokens += int(committed)

    def _fill_block(self, start: int, end: int, open_now: list[bool]) -> None:
        """The sampler's first tokens for the block's uncommitted positions (a uniform-state model's random canvas),
        each open row's drawn from its own generator."""
        generators = [g if o else None for g, o in zip(self.generators, open_now)]
        tokens = self.sampler.fill_block((len(open_now), end - start), generators, self.model.config)
        if tokens is not None:
            block = self.canvas.tokens[:, start:end]
            block.copy_(torch.where(self.canvas.pending(slice(start, end)) & self.unfinished[:, None], tokens, block))

    @property
    def rows_computed(self) -> int:
        """Token rows the network computed so far, summed over layers (retired stores' counts and the live one's)."""
        live = self.runner.kv.rows_per_layer if self.runner is not None else []
        return sum(self.stats.rows_per_layer) + sum(live)

    def _plan(self, step: int, start: int, end: int) -> tuple[int, int, Rows]:
        """The candidate window `[lo, hi)` of a step (the sampler's `logit_window` and the block) and the rows the
        cache computes for the logits the sampler asked for."""
        canvas, cfg, sampler = self.canvas, self.model.config, self.stacked
        lo, hi = sampler.logit_window(canvas.prompt_length, canvas.tokens.shape[1], start, end, step)
        masked, before = canvas.pending(), self.masked_at_plan
        self.masked_at_plan = masked
        next_commits = sampler.next_commits(self.state) if self.cache.needs_next_commits else None
        return min(lo, start), max(hi, end), self.cache.plan(self.runner.kv, caches.PlanContext(
            canvas=canvas, masked=masked, masked_before=before, next_commits=next_commits, step=step, start=start,
            end=end, lo=lo, hi=hi, shift=cfg.logit_shift, family=self.family))

    def logits(self, lo: int, hi: int, rows: Rows, open_now: list[bool], step: int, block: tuple[int, int]
               ) -> Tensor:
        """The step's logits of the window `[lo, hi)`; `forward_logits` keeps those of the columns the layout asked
        for (`Layout.logit_columns`). Rows with nothing left to decode in the block (finished, or done with the block
        while others are not) are left out of the forward where the cache recomputes every row at the next block
        start; their logits are zero, and the sampler commits nothing there."""
        inputs = self.sampler.model_inputs(self.state, step)
        extra = self.stacked.extra_rows(self.canvas.tokens, *block, self.model.config)  # after the window's logits
        first, last = self.layout.logit_columns(self, lo, hi)
        if all(open_now) or not self.cache.block_fresh or self.options.compile or self.sampler.drafts:
            logits = self.runner.forward(first, last, rows, inputs=inputs, block=block, extra=extra)
        else:
            logits = self.runner.forward_open(first, last, rows, open_now, inputs, block, extra)
        self.forward_logits = logits
        return logits if (first, last) == (lo, hi) else logits[:, lo - first:hi - first]

    def _open_rows(self, start: int, end: int, again: Tensor | None = None) -> Tensor:
        """[B] rows with an uncommitted position left in the block, or (token editing) asking for another step."""
        masks_left = self.canvas.pending(slice(start, end)).any(1) & self.unfinished
        return masks_left if again is None else masks_left | (again & self.unfinished)

    def _context(self, logits: Tensor, step: int, start: int, end: int, lo: int, hi: int,
                 open_now: list[bool]) -> samplers_mod.StepContext:
        """What the sampler sees at this step: the window's logits, which positions it may commit (not yet
        committed, in the block, of an unfinished row) or rewrite (`edits`), and the progress of the block and the
        generation."""
        canvas, sampler = self.canvas, self.sampler
        masked = self.masked_at_plan[:, lo:hi] & self.unfinished[:, None]  # the forward left the tokens as planned
        positions, in_block = self._window(lo, hi, start, end)
        editable = None
        if sampler.edits:  # decoded answer tokens of this block; never the prompt (its tail shares the block)
            decoded = ~self.masked_at_plan[:, lo:hi] & self.unfinished[:, None]
            editable = decoded & in_block & (positions >= canvas.gen_start[:, None])
        logits, extra_logits = logits[:, :hi - lo], logits[:, hi - lo:] if logits.shape[1] > hi - lo else None
        logits = self.runner.readable(logits, sampler.reads_shards)
        extra_logits = None if extra_logits is None else self.runner.readable(extra_logits, sampler.reads_shards)
        ctx = samplers_mod.StepContext(
            logits=logits, eligible=masked & in_block, masked=masked, positions=positions, canvas=canvas.tokens,
            step=step, steps=self.steps_per_block, block=self.block,
            # a row draws random numbers only at its own steps (when it has masks left), as it does alone
            generators=[g if o else None for g, o in zip(self.generators, open_now)],
            nfe=self.stats.nfe - 1, total_steps=self.total_steps, block_start=start, block_end=end,
            prompt_length=canvas.prompt_length, state=self.state, editable=editable, family=self.family,
            config=self.model.config, extra_logits=extra_logits,
            unscored=self.unscored,
            forward=partial(self._verify, step, start, end, lo, hi) if sampler.drafts else None)
        ctx.eligible = self.layout.eligible(self, ctx)
        return ctx

    def _window(self, lo: int, hi: int, start: int, end: int) -> tuple[Tensor, Tensor]:
        """The canvas positions `[lo, hi)` and which of them lie in the block `[start, end)`, made once per window."""
        if self.window is None or self.window[0] != (lo, hi, start, end):
            positions = torch.arange(lo, hi, device=self.model.device)
            self.window = ((lo, hi, start, end), positions, (positions >= start) & (positions < end))
        return self.window[1:]

    def _verify(self, step: int, start: int, end: int, lo: int, hi: int, drafts: Tensor, tree: bool = False
                ) -> Tensor:
        """The sampler's `forward`: the next step's logits on each of its drafts (self-speculative decoding), by
        batch expansion or (`tree`) tree attention (`Runner.verify`)."""
        next_lo, next_hi, next_rows = self._plan(step + 1, start, end)  # refreshes mid-block: refused up front
        if (next_lo, next_hi) != (lo, hi):
            raise DllmError(f"sampler {self.sampler.name!r} verifies drafts with the logits of the next step, so its "
                            f"logit_window must not change inside a block")
        logits = self.runner.verify(drafts, lo, hi, next_rows, block=(start, end), tree=tree)
        return self.runner.readable(logits, self.sampler.reads_shards)

    def _write(self, ctx: samplers_mod.StepContext, out: samplers_mod.Commit, lo: int, hi: int
               ) -> tuple[Tensor, Tensor, list[Tensor], tuple | None]:
        """Write the sampler's commits (and edits) into the canvas and adopt a verified draft's store. Returns the
        committed positions, the tokens the step added (commits less re-masks; a device scalar), the step's checks
        (stalled, draft differs; device scalars, read with the step's one wait) and the window and logits a
        verified draft already computed for the next step."""
        if not isinstance(out, samplers_mod.Commit):
            raise DllmError(f"sampler {self.sampler.name!r} returned {type(out).__name__} from step; return a "
                            f"Commit(mask, tokens, confidence)")
        canvas = self.canvas
        commit = out.mask & ctx.masked
        decided = commit
        if out.given_up is not None:  # eligible positions it gave up (and did not commit): masked, no longer pending
            decided = commit | canvas.give_up(out.given_up & ctx.eligible & ~commit, lo)
        # a row with eligible positions and none of them committed (or given up); a scalar, read with the step's one
        # device wait
        stalled = ((ctx.eligible.any(1) > (decided & ctx.eligible).any(1)).any()
                   if not self.sampler.may_commit_nothing else self.never)
        written, added = commit, commit.sum()
        if ctx.editable is not None and out.edit is not None:
            written = commit | (out.edit & ctx.editable)
            added = added - (written & ~commit & (out.tokens == canvas.mask_id)).sum()  # re-masked: uncommitted
        if self.captured is not None:  # the committed (and edited) tokens, not a renoised canvas's drafts (a re-masked
            # position's is rewritten when it is committed again)
            drawn_from = ctx.logits if out.logits is None else out.logits  # a tensor-parallel rank's columns
            # where the sampler reads them so (the captured values merged over the ranks)
            self.captured.write(written, lo, hi, self.stacked.log_distribution(drawn_from), out.tokens)
        new = out.tokens
        if out.draft is not None:  # positions that stay uncommitted take the draft (a uniform-state canvas renoised)
            written, new = ctx.masked, torch.where(commit, out.tokens, out.draft)
        canvas.write(written, new, commit, lo, hi)
        if out.verified is None:
            return commit, added, [stalled], None
        draft, draft_logits = self.runner.adopt(out.verified)
        return commit, added, [stalled, (draft != canvas.tokens[:, lo:hi]).any()], ((lo, hi), draft_logits)

    def _after_step(self, ctx: samplers_mod.StepContext, out: samplers_mod.Commit, commit: Tensor,
                    counted: list[int] | None) -> None:
        """The step's trace, finished rows (a stop token with nothing uncommitted before it) and callback."""
        if self.trace is not None:
            rows_per_layer = [now - before for now, before in zip(self.runner.kv.rows_per_layer, counted)]
            edited = None if ctx.editable is None or out.edit is None else out.edit & ctx.editable
            given_up = None if out.given_up is None else out.given_up & ctx.eligible & ~commit
            self.trace.append(trace_step(self.block, ctx.step, rows_per_layer, ctx.positions, commit, out,
                                         full_logits(ctx.logits), edited, given_up))
        if self.options.stop_early:
            self.layout.finish(self, ctx.block_start, block_over=False)
        if self.options.callback is not None:
            self.options.callback({"block": self.block, "step": ctx.step, "committed": int(commit.sum())})

    def _open_rows_checked(self, ctx: samplers_mod.StepContext, out: samplers_mod.Commit, checks: list[Tensor],
                           columns: tuple[int, int]) -> list[bool]:
        """The rows still open in the next step's `columns`, read with the step's checks in one wait for the device; a
        sampler that stalled or committed other tokens than its verified draft is an error."""
        watched = self._watch()
        flags = torch.cat([self._open_rows(*columns, out.again), torch.stack([*checks, *watched])]).tolist()
        batch, ours = len(self.rows), len(flags) - len(watched)
        open_now, (stalled, *diverged) = flags[:batch], flags[batch:ours]
        open_now = self._watched(flags[ours:], ctx, lambda: self._open_rows(*columns, out.again).tolist(), open_now)
        if stalled:
            raise DllmError(f"sampler {self.sampler.name!r} committed nothing for an unfinished row at block "
                            f"{self.block} step {ctx.step}; a sampler must commit at least one position per row")
        if any(diverged):
            raise DllmError("a sampler returned a verified draft that differs from its commits; commit exactly the "
                            "chosen draft")
        return open_now

    def _watch(self) -> list[Tensor]:
        """Device flags read with the step's one wait, for a batch that checks more at each step (`Lockstep`)."""
        return []

    def _watched(self, flags: list, ctx: samplers_mod.StepContext, open_rows: Callable[[], list[bool]],
                 open_now: list[bool]) -> list[bool]:
        """What `_watch`'s flags say, once read: the rows still open (`open_rows()` reads them again)."""
        return open_now

