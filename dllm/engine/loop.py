"""The one decode loop: `Batch` decodes its rows block by block, each step a forward of the rows the cache
chose, then the sampler's commits; `decode` runs a fixed batch to its end."""
from __future__ import annotations

from dataclasses import dataclass
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
from ..samplers.base import token_probability
from .canvas import Canvas
from .checks import (check_auto_length, check_block_layout, check_guidance, check_lengths, check_policies,
                     check_prefix_cache)
from .guidance import Guidance
from .lockstep import lead_block, share_batch, step_flags, take_calls
from .logprobs import Captured, TokenLogprob, check_logprobs, token_logprobs
from .runner import Runner, clock
from .stats import Stats, trace_step

if TYPE_CHECKING:
    from ..cache import Cache, PrefixBlocks
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
    max_gen_length: int | None = None  # gen_length auto: the longest its answer may grow (`Daedal.limit`)


class Batch:
    """Rows decoded together, block by block, all with the same sampler, cache and block layout: the one decode
    loop. `decode` runs a fixed batch to the end; `dllm serve` also adds and removes rows between blocks
    (continuous batching), which re-lays the canvas out so that every row's current block sits at the same
    columns: `[pad | prompt | decoded blocks | current block | later blocks | pad]`. That is exact when the cache
    recomputes every row at a block start (`Cache.block_fresh`) and the sampler looks only at the current block
    (`Sampler.block_local`); `joins_between_blocks` says so. A row may bring its own values of the sampler's per-row
    parameters (`add(..., sampler=...)`); the steps see them stacked into `[B]` tensors (`samplers.stack_rows`).

    `profile` times every forward into `stats.forward_seconds`; `callback` is called after every step with
    `{"block", "step", "committed"}`; `compile` runs the model compiled (`compiled_run`; caches none, prefix, dual).
    `prefix_cache` (a `cache.PrefixBlocks`; block-causal and causal-prefix models, cache `block`) fills each layout's
    store with the kept keys and values of the rows' finished blocks, and keeps the blocks each block start makes
    final. `guidance`: LLaDA's cfg_scale, logits_eos_inf, confidence_eos_eot_inf (`Guidance`). `length` (a
    `samplers.Daedal`; gen_length auto): each row's answer chooses its length, growing before the first block and
    inside blocks (`_choose_lengths`, `_expand`, the canvas operation `_insert`); rows are added with it as their
    gen_length, and none joins a running batch.
    The host waits for the device once per step (has the block any mask left?) and once per block.

    On a tensor-parallel model (`model.tp`) every rank runs the batch: rank 0's tells the others' every change
    (`lockstep`), and every step checks that their canvases agree."""

    def __init__(self, model: DiffusionLM, sampler: Sampler, cache: Cache, block_length: int, steps_per_block: int,
                 stop_early: bool = True, trace: bool = False, profile: bool = False,
                 callback: Callable[[dict], None] | None = None, compile: bool = False,
                 prefix_cache: PrefixBlocks | None = None, guidance: Guidance = Guidance(),
                 length: samplers_mod.Daedal | None = None):
        check_policies(model, sampler, cache, compile)
        if length is not None:
            check_auto_length(model, sampler, cache, compile, guidance)
            if model.tp is not None:
                raise DllmError("gen_length auto grows the canvas on one process only; give a fixed gen_length on a "
                                "tensor-parallel model")
        check_guidance(model, sampler, cache, guidance)
        check_block_layout(model, block_length)
        check_prefix_cache(model, cache, prefix_cache, guidance)
        self.model, self.sampler, self.cache, self.guidance = model, sampler, cache, guidance
        self.block_length, self.steps_per_block = block_length, steps_per_block
        self.stop_early, self.profile, self.callback, self.compile = stop_early, profile, callback, compile
        self.prefix, self.length = prefix_cache, length
        self.joins_between_blocks = sampler.block_local and cache.block_fresh and length is None
        self.family = "dream" if model.config.logit_shift else "llada"  # for the defaults papers set per family
        self.rows: list[Row] = []
        self.stats, self.trace = Stats(batch=0, rows_per_layer=[0] * model.config.n_layers), [] if trace else None
        self.canvas: Canvas | None = None  # None: rows changed since the last layout
        self.runner: Runner | None = None
        self.captured: Captured | None = None  # the rows' log-probabilities, when a row asked for them
        self._saved = True  # the rows hold what the canvas holds
        self.block = 0  # blocks run
        self.ranks = None if model.tp is None else model.tp.ranks  # tensor parallel: every rank runs this batch
        if self.ranks is not None and self.ranks.leader:
            share_batch(self, Batch, model, sampler, cache, block_length, steps_per_block, stop_early, trace, profile,
                        None, compile, prefix_cache, guidance, length)

    def add(self, prompt: list[int], gen_length: int | samplers_mod.Daedal, seed: int = 0,
            sampler: Sampler | None = None, logprobs: int | None = None) -> Row:
        """A row for `prompt` with `gen_length` answer tokens (whole blocks; or the batch's `length`, gen_length
        auto: its initial masks, grown as it decodes), decoded from the next block on, with
        `sampler`'s settings (default: the batch's): the batch's sampler class with other values of its per-row
        parameters (`Sampler.row_params`: temperature, thresholds, ...), stacked into `[B]` tensors per layout;
        `logprobs=k` captures each token's log-probability with k alternatives (`Batch.logprobs`)."""
        asked = (prompt, gen_length, seed, sampler, logprobs)  # the other ranks' call (tensor parallel)
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
        model, size, limit = self.model, self.model.config.block_size, None
        if isinstance(gen_length, samplers_mod.Daedal) or self.length is not None:
            if gen_length is not self.length:
                raise DllmError("a batch decodes gen_length auto or fixed lengths, not both; give every row the "
                                "batch's length policy")
            limit = self.length.limit(len(prompt), model.config.max_length)
            gen_length = self.length.initial_gen_length
        elif gen_length % self.block_length:
            raise DllmError(f"gen_length ({gen_length}) must be a multiple of block_length ({self.block_length})")
        Canvas.check(model, [prompt], gen_length)
        origin = sampler.block_origin(len(prompt), self.block_length)
        if not 0 <= origin <= len(prompt):
            raise DllmError(f"sampler {sampler.name!r} starts the first block at {origin}, outside the prompt "
                            f"[0, {len(prompt)}]; return a position in it from block_origin")
        if size:  # whole attention blocks, the answer from the prompt's end to the end of its last block
            origin = len(prompt) // size * size
            gen_length = -(-(len(prompt) + gen_length) // size) * size - len(prompt)
        tokens = torch.tensor(list(prompt) + [model.config.placeholder_id] * gen_length, dtype=torch.long)
        row = Row(list(prompt), gen_length, origin, torch.Generator(device=model.device).manual_seed(seed), sampler,
                  tokens, logprobs=logprobs, max_gen_length=limit)
        self._save()
        self.rows.append(row)
        self.canvas = None
        self._tell(Batch.add, *asked)
        return row

    def remove(self, row: Row) -> None:
        """Take `row` out between blocks (finished, out of blocks, or cancelled)."""
        if not self.joins_between_blocks and self.block:
            raise DllmError(f"sampler {self.sampler.name!r} with cache {self.cache.name!r} cannot drop rows from a "
                            f"running batch; let it finish")
        self._save()
        self._tell(_remove_row, self.rows.index(row))
        self.rows.remove(row)
        self.canvas = None

    def cancel(self, row: Row) -> None:
        """Stop decoding `row` from the next step on (take it out between blocks with `remove`)."""
        self._tell(_cancel_row, self.rows.index(row))
        if self.canvas is None:
            row.finished = True
        else:
            self.finished[self.rows.index(row)] = True
            self.unfinished[self.rows.index(row)] = False
            self._saved = False

    def answer(self, row: Row) -> list[int]:
        """`row`'s answer so far: the tokens of its decoded blocks (of all of them once it has finished: a sampler
        such as Prophet may fill later blocks early), cut before the first stop token. A mask a sampler gave up
        (`Commit.given_up`, DUS) stays the mask id here; texts leave it out (a special token)."""
        self._save()
        ids = row.tokens[len(row.prompt):len(row.tokens) if row.finished else row.origin + row.decoded].tolist()
        stops = self.model.config.stop_ids
        return ids[:next((i for i, t in enumerate(ids) if t in stops), len(ids))]

    def logprobs(self, row: Row) -> list[TokenLogprob]:
        """The tokens of `row`'s `answer` with their log-probabilities (a row added with `logprobs`)."""
        ids = self.answer(row)
        if row.logprobs is None:
            raise DllmError("this row was added without logprobs; add it with logprobs=k (0: no alternatives)")
        if row.captured is None:
            return []
        answer = slice(len(row.prompt), None)
        return token_logprobs((row.captured[0][answer], row.captured[1][answer]), ids, row.logprobs)

    def done(self, row: Row) -> bool:
        """Nothing left to decode: a stop committed, or every block of the row decoded."""
        self._save()
        return row.finished or row.origin + row.decoded >= len(row.prompt) + row.gen_length

    @property
    def running(self) -> bool:
        return any(not self.done(row) for row in self.rows)

    def _save(self) -> None:
        """Copy the canvas back into the rows (their tokens, decoded blocks and finished flags)."""
        canvas = self.canvas
        if canvas is None or self._saved:
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
        self._saved = True

    def _layout(self) -> None:
        """Lay the rows out on a fresh canvas, current blocks aligned, with a fresh store and sampler state."""
        model, rows = self.model, self.rows
        before = [row.origin + row.decoded for row in rows]  # tokens left of the current block
        self.canvas = Canvas.lay_out(model, [row.tokens for row in rows], before, [len(row.prompt) for row in rows],
                                     self.block_length)
        self.start, self._saved = max(before), False
        self.firsts = [self.start - n for n in before]  # the column of each row's first token
        if any(row.given_up is not None for row in rows):  # masks given up stay given up
            self.canvas.given_up = torch.zeros_like(self.canvas.tokens, dtype=torch.bool)
            for b, (row, first) in enumerate(zip(rows, self.firsts)):
                if row.given_up is not None:
                    self.canvas.given_up[b, first:first + len(row.tokens)] = row.given_up
        wanted = [row.logprobs for row in rows if row.logprobs is not None]
        self.captured = None if not wanted else Captured.lay_out(
            [row.captured for row in rows], self.firsts, self.canvas.tokens.shape[1], max(wanted), model.device)
        self._count_store()
        self.runner = Runner(model, self.canvas, self.cache, self.stats, self.profile, self.compile, self.guidance)
        if self.prefix is not None:
            self.prefix.load(self.runner.kv, [row.tokens[:n].tolist() for row, n in zip(rows, before)], self.firsts)
        self.stats.batch = max(self.stats.batch, len(rows))
        self.state = SimpleNamespace()  # the sampler's per-run state
        self.generators = [row.generator for row in rows]
        self.stacked = samplers_mod.stack_rows([row.sampler for row in rows])  # the rows' settings, for the steps
        self.unscored = self.guidance.unscored(model.config, self.stacked.temperature, model.device)
        self._set_finished(torch.tensor([row.finished for row in rows], dtype=torch.bool, device=model.device))
        self.window = None  # (lo, hi, start, end), positions, in the block: of the last step (`_window`)
        self.never = torch.zeros((), dtype=torch.bool, device=model.device)  # the stall check of a sampler that may
        # commit nothing
        self.masked_at_plan = None  # the canvas's masks when the last forward was planned
        longest = int((self.canvas.gen_end - self.canvas.gen_start).max())
        self.total_steps = self.steps_per_block * -(-longest // self.block_length)  # of the longest row

    def _set_finished(self, finished: Tensor) -> None:
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
        self._tell(Batch.finish)
        self._count_store()
        return self.stats

    def _tell(self, method: Callable, *args) -> None:
        """Rank 0 of a tensor-parallel model: the other ranks make this call on their copy of the batch."""
        if self.ranks is not None and self.ranks.leader:
            self.ranks.post(method, self, *args)

    @torch.no_grad()
    def run_block(self) -> None:
        """Decode the next block of every row: a step per forward until no row has a position left in the block that
        is not yet committed (a mask, or a uniform-state model's random token)."""
        if self.ranks is not None and self.ranks.leader:
            lead_block(self, self._run_block)
        else:
            self._run_block()

    def _run_block(self) -> None:
        if not self.rows:
            raise DllmError("the batch has no rows; add a prompt first")
        if self.canvas is None:
            self._layout()
        began = clock(self.model.device)
        if self.length is not None and self.block == 0:  # gen_length auto: DAEDAL's stage 1
            self._choose_lengths()
        start = self.start
        end = min(start + self.block_length, self.canvas.tokens.shape[1])
        committed = torch.zeros((), dtype=torch.long, device=self.model.device)
        step, reused = 0, None  # reused: (window, logits) of a verified draft the sampler committed
        open_now = self._open_rows(start, end).tolist()
        if any(open_now):
            self._fill_block(start, end, open_now)
        while any(open_now):
            counted = list(self.runner.kv.rows_per_layer) if self.trace is not None else None
            lo, hi, rows = self._plan(step, start, end)
            logits = reused[1] if reused is not None and reused[0] == (lo, hi) else self._forward(
                lo, hi, rows, open_now, step, (start, end))
            ctx = self._context(logits, step, start, end, lo, hi, open_now)
            if step == 0:  # the block-start forward may move the block end (AdaBlock)
                end = self._move_block_end(ctx)
            out = self.stacked.step(ctx)
            commit, added, checks, reused = self._write(ctx, out, lo, hi)
            committed += added
            self._after_step(ctx, out, commit, counted)
            if self.length is not None:  # gen_length auto: DAEDAL's stage 2 (a fresh layout when a row grows)
                self._expand(ctx, out, commit)
            open_now = self._open_rows_checked(ctx, out, checks)  # the step's one wait for the device
            step += 1
        if self.stop_early and self.sampler.edits:  # the block's tokens are final now
            self._set_finished(self.canvas.finish_rows(self.finished, self.model.config))
        if self.prefix is not None:
            self._keep_final_blocks()
        self.start, self.block, self._saved = end, self.block + 1, False
        self.stats.seconds += clock(self.model.device) - began
        self.stats.gen_tokens += int(committed)

    def _choose_lengths(self) -> None:
        """gen_length auto, DAEDAL's stage 1 (`samplers.Daedal.growth`): each forward grows the rows whose EOS
        confidence is low by masks at their end; a row whose length is chosen leaves the later forwards (as it
        would alone). Then EOS tokens end each answer (`Daedal.tail`). Every forward is counted (at least one)."""
        growing, cfg = [True] * len(self.rows), self.model.config
        while any(growing):
            first, width = self.canvas.prompt_length, self.canvas.tokens.shape[1]
            self._forward(first, width, Rows(slice(0, width)), growing, 0, (first, width))  # cache none: every row
            eos = self.length.eos_confidence(self.answer_logits, self.canvas.answer[:, first:], cfg.filler_id)
            grow = self.length.growth(eos, [row.gen_length for row in self.rows],
                                      [row.max_gen_length for row in self.rows])
            growing = [was and n > 0 for was, n in zip(growing, grow)]
            self._insert({b: (self._end_column(b), n, cfg.mask_id) for b, n in enumerate(grow) if growing[b]})
        self._insert({b: (self._end_column(b), self.length.tail(row.gen_length, row.max_gen_length), cfg.filler_id)
                      for b, row in enumerate(self.rows)})

    def _expand(self, ctx: samplers_mod.StepContext, out: samplers_mod.Commit, commit: Tensor) -> None:
        """gen_length auto, DAEDAL's stage 2 (`samplers.Daedal.expansion`): after a step, an unfinished row whose EOS
        confidence (from the step's logits of its whole answer) is low turns the least confident mask of the block
        that the step left into `expansion_factor` masks."""
        canvas, cfg = self.canvas, self.model.config
        eos = self.length.eos_confidence(self.answer_logits, canvas.answer[:, canvas.prompt_length:], cfg.filler_id)
        limits = torch.tensor([row.max_gen_length for row in self.rows], device=canvas.gen_end.device)
        where = self.length.expansion(eos, token_probability(ctx.logits, out.tokens),
                                      ctx.eligible & ~commit & self.unfinished[:, None],
                                      canvas.gen_end - canvas.gen_start < limits).tolist()
        self._insert({b: (int(ctx.positions[j]), self.length.expansion_factor - 1, cfg.mask_id)
                      for b, j in enumerate(where) if j >= 0})

    def _end_column(self, b: int) -> int:
        """The canvas column after row b's last token."""
        return self.firsts[b] + len(self.rows[b].tokens)

    def _insert(self, inserts: dict[int, tuple[int, int, int]]) -> None:
        """The canvas operation of gen_length auto: row b gets `count` tokens `token` before canvas column `column`
        (`inserts[b]`), its later tokens (and captured log-probabilities) moving right, its answer cut at its
        `max_gen_length`; then the rows are laid out anew, current blocks at the same columns, with a fresh store
        and sampler state (so only samplers that keep no state per position and caches that store nothing:
        `checks.check_auto_length`)."""
        if not any(count for _, count, _ in inserts.values()):
            return
        self._saved = False  # the block's steps have written into the canvas since the rows were last saved
        self._save()
        for b, (column, count, token) in inserts.items():
            row = self.rows[b]
            at, keep = column - self.firsts[b], len(row.prompt) + row.max_gen_length
            row.tokens = _spliced(row.tokens, at, count, token)[:keep]
            row.gen_length = len(row.tokens) - len(row.prompt)
            if row.captured is not None:
                row.captured = tuple(_spliced(t, at, count, fill)[:keep]
                                     for t, fill in zip(row.captured, (float("nan"), -1)))
        self._layout()

    def _fill_block(self, start: int, end: int, open_now: list[bool]) -> None:
        """The sampler's first tokens for the block's uncommitted positions (a uniform-state model's random canvas),
        each open row's drawn from its own generator."""
        generators = [g if o else None for g, o in zip(self.generators, open_now)]
        tokens = self.sampler.fill_block((len(open_now), end - start), generators, self.model.config)
        if tokens is not None:
            block = self.canvas.tokens[:, start:end]
            block.copy_(torch.where(self.canvas.pending(slice(start, end)) & self.unfinished[:, None], tokens, block))

    def _keep_final_blocks(self) -> None:
        """Offer the prefix cache every row's blocks whose keys and values the store holds final (those before the
        block, made final by its first forward)."""
        final = self.runner.kv.final
        tokens = self.canvas.tokens[:, :final].tolist()
        self.prefix.save(self.runner.kv, [row[first:] for row, first in zip(tokens, self.firsts)], self.firsts)

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

    def _forward(self, lo: int, hi: int, rows: Rows, open_now: list[bool], step: int, block: tuple[int, int]
                 ) -> Tensor:
        """The step's logits. Rows with nothing left to decode in the block (finished, or done with the block while
        others are not) are left out of the forward where the cache recomputes every row at the next block start;
        their logits are zero, and the sampler commits nothing there."""
        inputs = self.sampler.model_inputs(self.state, step)
        extra = self.stacked.extra_rows(self.canvas.tokens, *block, self.model.config)  # after the window's logits
        # gen_length auto: DAEDAL's EOS confidence reads the logits of every answer position (`answer_logits`)
        first, last = (self.canvas.prompt_length, self.canvas.tokens.shape[1]) if self.length is not None else (lo, hi)
        if all(open_now) or not self.cache.block_fresh or self.compile or self.sampler.drafts:
            logits = self.runner.forward(first, last, rows, inputs=inputs, block=block, extra=extra)
        else:
            logits = self.runner.forward_open(first, last, rows, open_now, inputs, block, extra)
        if self.length is None:
            return logits
        self.answer_logits = logits
        return logits[:, lo - first:hi - first]

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
        return samplers_mod.StepContext(
            logits=logits, eligible=masked & in_block, masked=masked, positions=positions, canvas=canvas.tokens,
            step=step, steps=self.steps_per_block, block=self.block,
            # a row draws random numbers only at its own steps (when it has masks left), as it does alone
            generators=[g if o else None for g, o in zip(self.generators, open_now)],
            nfe=self.stats.nfe - 1, total_steps=self.total_steps, block_start=start, block_end=end,
            prompt_length=canvas.prompt_length, state=self.state, editable=editable, family=self.family,
            config=self.model.config, extra_logits=extra_logits,
            unscored=self.unscored,
            forward=partial(self._verify, step, start, end, lo, hi) if sampler.drafts else None)

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

    def _move_block_end(self, ctx: samplers_mod.StepContext) -> int:
        """The block end the sampler chooses at the block's first step (AdaBlock); `ctx` follows it."""
        end, length = self.stacked.block_end(ctx), self.canvas.tokens.shape[1]
        if not ctx.block_start < end <= length:
            raise DllmError(f"sampler {self.sampler.name!r} chose block end {end} outside ({ctx.block_start}, "
                            f"{length}]")
        ctx.block_end = end
        ctx.eligible = ctx.masked & (ctx.positions >= ctx.block_start) & (ctx.positions < end)
        return end

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
        tokens = canvas.tokens
        commit = out.mask & ctx.masked
        decided = commit if out.given_up is None else commit | self._give_up(ctx, out, commit, lo)
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
        tokens[:, lo:hi] = torch.where(written, new, tokens[:, lo:hi])
        if canvas.uncommitted is not None:  # a fresh tensor: the last plan's copy stays as it was
            canvas.uncommitted = canvas.uncommitted.clone()
            canvas.uncommitted[:, lo:hi] &= ~commit
        if out.verified is None:
            return commit, added, [stalled], None
        draft, draft_logits = self.runner.adopt(out.verified)
        return commit, added, [stalled, (draft != tokens[:, lo:hi]).any()], ((lo, hi), draft_logits)

    def _give_up(self, ctx: samplers_mod.StepContext, out: samplers_mod.Commit, commit: Tensor, lo: int) -> Tensor:
        """Mark the eligible positions the sampler gave up (and did not commit): they stay masked, no longer
        pending. Returns them."""
        given_up = out.given_up & ctx.eligible & ~commit
        canvas = self.canvas
        if canvas.given_up is None:
            canvas.given_up = torch.zeros_like(canvas.tokens, dtype=torch.bool)
        canvas.given_up[:, lo:lo + given_up.shape[1]] |= given_up
        return given_up

    def _after_step(self, ctx: samplers_mod.StepContext, out: samplers_mod.Commit, commit: Tensor,
                    counted: list[int] | None) -> None:
        """The step's trace, finished rows (a stop token with nothing uncommitted before it) and callback."""
        if self.trace is not None:
            rows_per_layer = [now - before for now, before in zip(self.runner.kv.rows_per_layer, counted)]
            edited = None if ctx.editable is None or out.edit is None else out.edit & ctx.editable
            given_up = None if out.given_up is None else out.given_up & ctx.eligible & ~commit
            self.trace.append(trace_step(self.block, ctx.step, rows_per_layer, ctx.positions, commit, out,
                                         full_logits(ctx.logits), edited, given_up))
        if self.stop_early:  # a sampler that edits may still change the block's tokens before a stop in it
            final_before = ctx.block_start if self.sampler.edits else None
            self._set_finished(self.canvas.finish_rows(self.finished, self.model.config, final_before))
        if self.callback is not None:
            self.callback({"block": self.block, "step": ctx.step, "committed": int(commit.sum())})

    def _open_rows_checked(self, ctx: samplers_mod.StepContext, out: samplers_mod.Commit,
                           checks: list[Tensor]) -> list[bool]:
        """The rows still open in the block, read with the step's checks in one wait for the device; a sampler
        that stalled or committed other tokens than its verified draft is an error."""
        if self.ranks is not None:  # every rank holds the same canvas; rank 0's callback may have calls for the others
            checks = [*checks, *step_flags(self.ranks, self.canvas.tokens)]
        flags = torch.cat([self._open_rows(ctx.block_start, ctx.block_end, out.again), torch.stack(checks)]).tolist()
        batch = len(self.rows)
        open_now, (stalled, *diverged) = flags[:batch], flags[batch:]
        if self.ranks is not None:
            ranks_differ, calls = diverged[-2:]
            del diverged[-2:]
            if calls:  # the other ranks make them now (a cancel closes a row): their open rows read again
                take_calls(self.ranks)
                open_now = self._open_rows(ctx.block_start, ctx.block_end, out.again).tolist()
            if ranks_differ:
                raise DllmError(f"the tensor-parallel ranks hold different tokens after block {self.block} step "
                                f"{ctx.step}; their decisions diverged (a nondeterministic kernel?)")
        if stalled:
            raise DllmError(f"sampler {self.sampler.name!r} committed nothing for an unfinished row at block "
                            f"{self.block} step {ctx.step}; a sampler must commit at least one position per row")
        if any(diverged):
            raise DllmError("a sampler returned a verified draft that differs from its commits; commit exactly the "
                            "chosen draft")
        return open_now


def _spliced(t: Tensor, at: int, count: int, fill) -> Tensor:
    """`t` with `count` rows of `fill` inserted before row `at`."""
    return torch.cat((t[:at], t.new_full((count, *t.shape[1:]), fill), t[at:]))


@torch.no_grad()
def decode(model: DiffusionLM, prompts: list[list[int]], sampler: Sampler, cache: Cache,
           gen_length: int | samplers_mod.Daedal, block_length: int, steps: int | None = None,
           seed: int | list[int] = 0, stop_early: bool = True,
           trace: bool = False, profile: bool = False, callback: Callable[[dict], None] | None = None,
           compile: bool = False, guidance: Guidance = Guidance()) -> tuple[Canvas, Stats, list[dict] | None]:
    """Decode token-id prompts as one fixed batch (every row seeded with `seed`, or row i with `seed[i]`; `gen_length`
    a `samplers.Daedal`: gen_length auto, each answer choosing its length); returns
    the final canvas, statistics and (optionally) a per-step trace. `profile` times every forward (synchronizing
    the device) into `stats.forward_seconds` by kind: `full` (every canvas row computed), `cached` (the other
    rows read from the cache), `verify` (draft batches). See `Batch` for `callback`, `compile` and `guidance`."""
    batch = decoded(model, prompts, sampler, cache, gen_length, block_length, steps, seed, stop_early, trace, profile,
                    callback, compile, guidance=guidance)
    return batch.canvas, batch.finish(), batch.trace


@torch.no_grad()
def decoded(model: DiffusionLM, prompts: list[list[int]], sampler: Sampler, cache: Cache,
            gen_length: int | samplers_mod.Daedal, block_length: int, steps: int | None = None,
            seed: int | list[int] = 0, stop_early: bool = True,
            trace: bool = False, profile: bool = False, callback: Callable[[dict], None] | None = None,
            compile: bool = False, logprobs: int | None = None, prefix_cache: PrefixBlocks | None = None,
            guidance: Guidance = Guidance()) -> Batch:
    """`decode`'s batch once decoded: its rows' answers and (`logprobs=k`) their log-probabilities; `prefix_cache`
    and `guidance` as `Batch`'s."""
    steps_per_block = check_lengths(gen_length, block_length, steps, uniform=model.config.mask_id is None)
    auto = isinstance(gen_length, samplers_mod.Daedal)  # gen_length auto: the answers start at its initial length
    Canvas.check(model, prompts, gen_length.initial_gen_length if auto else gen_length)  # each error before any work
    check_logprobs(logprobs)
    batch = Batch(model, sampler, cache, block_length, steps_per_block, stop_early, trace, profile, callback, compile,
                  prefix_cache, guidance, gen_length if auto else None)
    for ids, row_seed in zip(prompts, seed if isinstance(seed, list) else [seed] * len(prompts)):
        batch.add(ids, gen_length, row_seed, logprobs=logprobs)
    while batch.running:
        batch.run_block()
    return batch


def _remove_row(batch: Batch, index: int) -> None:
    batch.remove(batch.rows[index])


def _cancel_row(batch: Batch, index: int) -> None:
    batch.cancel(batch.rows[index])
