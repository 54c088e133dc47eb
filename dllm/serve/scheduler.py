"""The engine: requests (`messages.Add`) join a running batch of their kind between blocks (continuous batching),
batches of different kinds take blocks in turn, and after each block every request's newly final tokens go out as a
`messages.Delta`. It runs in the engine process (`engine_process`) and speaks only in messages."""
from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..cache import CACHES, PrefixBlocks
from ..core.checks import check_int
from ..core.errors import DllmError
from ..engine.decoding import new_batch
from ..engine.guidance import Guidance
from ..engine.layouts import Row
from ..engine.loop import Batch
from ..engine.options import LoopOptions
from ..models.parallel import RankFailed
from ..samplers import SAMPLERS
from .messages import Add, Delta, PrefixStats, Stats, StepEvent
from .requests import PreparedSamplers


@dataclass(eq=False)
class Task:
    """A request inside the engine: its message, the sampler, cache and LLaDA options built from it, the batch it
    may share (`key`), and how much of its answer has gone out."""

    add: Add
    sampler: Any
    cache: Any
    guidance: Guidance
    key: tuple
    sent: int = 0  # answer tokens sent
    cancelled: bool = False  # aborted: its row stops at the next step
    delivered: bool = False  # its last delta has gone out (or it was cancelled): it leaves at the next block
    steps: int = 0  # steps of its batch since it joined (step events)
    forwards_before: int = 0  # its batch's forwards when it joined
    shown: tuple[list[int], list[bool]] | None = None  # its answer's tokens and blanks as the last step event left them


def batch_key(sampler, cache, add: Add, guidance: Guidance) -> tuple:
    """What requests must share to decode as rows of one batch: the sampler's batch-wide settings (`batch_key`), the
    cache, the block layout and LLaDA's options; their rows differ in per-row sampler settings, seeds, lengths."""
    key = (sampler.batch_key(), tuple(cache.config().items()), add.block_length, add.steps_per_block,
           add.stop_early, guidance)
    if not (sampler.block_local and cache.block_fresh):
        key += (add.gen_length,)  # a batch that runs to its end decodes one layout
    if cache.rows_coupled:
        key += (add.req_id,)  # decoded alone, so the answer is the prompt's alone
    return key


@dataclass(eq=False)
class Group:
    """A running batch and its tasks, which share a key."""

    key: tuple
    batch: Batch
    tasks: dict[Row, Task] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        """Takes rows now: before its first block, or between blocks where rows may join a running batch."""
        return self.batch.joins_between_blocks or not self.batch.block


def _changes(task: Task, tokens: list[int], blank: list[bool], uniform: bool) -> tuple | None:
    """What changed in `task`'s answer since its last step event (None: nothing): positions committed or rewritten
    (with their tokens), re-masked, and on a uniform-state model (`uniform`) not yet committed but redrawn."""
    before_tokens, before_blank = task.shown if task.shown is not None and len(task.shown[0]) == len(tokens) else \
        ([None] * len(tokens), [True] * len(tokens))
    task.shown = (tokens, blank)
    changed = [p for p, (t, b) in enumerate(zip(tokens, blank)) if t != before_tokens[p] or b != before_blank[p]]
    committed = [(p, tokens[p]) for p in changed if not blank[p]]
    remasked = [p for p in changed if blank[p] and not before_blank[p]]
    drafts = [(p, tokens[p]) for p in changed if blank[p]] if uniform else []
    return (committed, remasked, drafts) if committed or remasked or drafts else None


def _error(add: Add, error: Exception) -> Delta:
    """The delta of a request that `error` ended: 400 with the one-line reason, or 500 (in the engine's log too,
    under the request's X-Request-ID)."""
    if isinstance(error, DllmError):
        return Delta(add.req_id, status=400, message=str(error))
    message = f"{type(error).__name__}: {error}"
    print(f"dllm engine: request {add.request_id or add.req_id} failed: {message}", file=sys.stderr, flush=True)
    return Delta(add.req_id, status=500, message=message)


HOLD_SHARE = 0.25  # the longest wait for returning clients before a block, as a share of the block that ended
GATHER_SECONDS = 0.005  # an idle engine's first requests: the longest gap between two of one burst


class Engine:
    """The decode loop's driver. Between blocks it admits waiting tasks, oldest first, into a batch of their key (a
    new one where none can take them), up to `max_batch` rows in all; then the next batch in turn runs a block, so
    no kind of request waits behind another unless the engine is full. After every step `poll` (the engine process's
    inbox) may abort rows; after each block every row's newly final tokens join `outputs`.

    Rows join only between blocks. Where every row ended at a block and its answer went out, the clients' next
    requests are on their way back; a block started at once would decode a part batch and keep them waiting a whole
    block, and with as many clients as `max_batch` the batch would split for good into two halves taking blocks in
    turn, each step computing half the rows for more than half a full step's cost. So then the next block waits
    (`wait`: the engine process's inbox) until those clients are back or a quarter of the ended block's time has
    passed (`HOLD_SHARE`); rows still decoding never wait, nor does a block whose free slots the waiting requests
    fill. Likewise an idle engine's first request waits for the rest of its burst (`_gather`)."""

    def __init__(self, model, tokenizer, max_batch: int = 8, compile: bool = False, prefix_cache_mb: float = 0):
        check_int("max_batch", max_batch, 1)
        # kept blocks' keys and values, reused by every request that starts with them (block-causal and causal-prefix
        # models)
        self.prefix = PrefixBlocks(model, prefix_cache_mb) if prefix_cache_mb else None
        self.model, self.tokenizer, self.max_batch, self.compile = model, tokenizer, max_batch, compile
        self.prepared = PreparedSamplers(tokenizer)
        self.waiting: deque[Task] = deque()
        self.tasks: dict[str, Task] = {}  # every task not yet delivered, by request id
        self.groups: list[Group] = []  # running batches, in the order they take blocks
        self.outputs: list[Delta] = []
        self.step_events: list[StepEvent] = []  # since the last `take_steps`
        self.poll: Callable[[], None] = lambda: None  # called after every step
        self.wait: Callable[[float], None] | None = None  # reads the inbox for at most so many seconds (None: no hold)
        self.returning, self.hold_seconds = 0, 0.0  # answers the last block ended; the longest wait for their clients
        self.closing = False  # shutting down: new requests are refused
        self.forwards = self.committed = self.rows_computed = self.steps = 0
        self.rows_per_step = [0] * (max_batch + 1)  # steps run, by the rows of their batch
        self.busy_seconds, self.started = 0.0, time.perf_counter()
        self.held_seconds, self._held_since = 0.0, None  # wall time holding a request; since when it holds one
        self._window, self._rates = (self.started, 0.0, 0), (0.0, 0.0)  # (since, busy, steps), (busy, steps/s)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.groups)

    # -- messages ---------------------------------------------------------------------------------------------
    def add(self, add: Add) -> None:
        """Queue a request (one that cannot decode is answered with its error at once)."""
        if self.closing:
            self.outputs.append(Delta(add.req_id, status=503, message="the server is shutting down; send the "
                                                                          "request to another instance"))
            return
        try:
            task = self._task(add)
        except Exception as error:  # checked in the HTTP process already; a mismatch of the two is answered
            self.outputs.append(_error(add, error))
            return
        if not self.tasks:
            self._held_since = time.perf_counter()
        self.waiting.append(task)
        self.tasks[add.req_id] = task

    def abort(self, req_ids: list[str]) -> None:
        """Stop these requests: a waiting one is dropped at admission, a running row at the next step."""
        for req_id in req_ids:
            task = self.tasks.get(req_id)
            if task is not None:
                task.cancelled = True

    def end_all(self, status: int, message: str) -> None:
        """Answer every task not yet delivered with an error; running rows stop at the next step (a deadline
        passed)."""
        for group in self.groups:
            for row, task in group.tasks.items():
                if not task.delivered:
                    group.batch.cancel(row)
        for task in list(self.tasks.values()):
            self.outputs.append(Delta(task.add.req_id, status=status, message=message))
            self._finish(task)
        self.waiting.clear()

    def take(self) -> list[Delta]:
        out, self.outputs = self.outputs, []
        return out

    def take_steps(self) -> list[StepEvent]:
        out, self.step_events = self.step_events, []
        return out

    def _task(self, add: Add) -> Task:
        sampler_config, cache_config = dict(add.sampler), dict(add.cache)
        sampler = self.prepared(SAMPLERS.create(sampler_config.pop("name"), **sampler_config))
        cache = CACHES.create(cache_config.pop("name"), **cache_config)
        guidance = Guidance(**add.guidance)
        return Task(add, sampler, cache, guidance, batch_key(sampler, cache, add, guidance))

    # -- the loop body ----------------------------------------------------------------------------------------
    def step(self) -> None:
        """Admit waiting tasks, then run one block of the next batch in turn."""
        self._admit()
        if not self.groups:
            return
        group = self.groups[0]
        try:
            self._block(group)
        except RankFailed:  # the model's ranks cannot go on: the engine process fails (its requests get 5xx)
            raise
        except Exception as error:  # every request of the batch gets the message, once; the engine goes on
            for task in group.tasks.values():
                self._fail(task, error)
            group.tasks = {}
        self.groups.remove(group)
        if group.tasks:
            self.groups.append(group)  # its next block after every other batch's

    def _fail(self, task: Task, error: Exception) -> None:
        self.outputs.append(_error(task.add, error))
        self._finish(task)

    def _finish(self, task: Task) -> None:
        task.delivered = True
        if self.tasks.pop(task.add.req_id, None) is not None and not self.tasks:
            self.held_seconds += time.perf_counter() - self._held_since

    def _admit(self) -> None:
        """Between blocks: drop finished and cancelled rows, then fill free slots from the queue, oldest first; a
        task waits only while the engine is full."""
        for group in list(self.groups):
            self._retire(group)
        free = self.max_batch - sum(len(group.tasks) for group in self.groups)
        if self.wait is not None and not self.groups:
            if self.returning:
                self._hold(min(len(self.waiting) + self.returning, free))
            else:
                self._gather(free)
        self.returning = 0
        while self.waiting and free > 0:
            task = self.waiting.popleft()
            if task.cancelled:
                self._finish(task)
                continue
            group = next((g for g in self.groups if g.key == task.key and g.open), None)
            try:
                if group is None:
                    group = self._group(task)
                add = task.add
                row = group.batch.add(add.prompt, add.gen_length, add.seed, task.sampler, add.logprobs)
            except Exception as error:  # this request alone gets the error
                self._fail(task, error)
                continue
            if not group.tasks:
                self.groups.append(group)
            group.tasks[row] = task
            task.forwards_before = group.batch.stats.nfe
            free -= 1

    def _hold(self, expected: int) -> None:
        """Read the inbox until `expected` requests wait or `hold_seconds` have passed (or a shutdown began)."""
        until = time.perf_counter() + self.hold_seconds
        while len(self.waiting) < expected and not self.closing and (left := until - time.perf_counter()) > 0:
            self.wait(left)

    def _gather(self, free: int) -> None:
        """An idle engine's first requests: read the inbox while they keep coming, each within GATHER_SECONDS of the
        last, until `free` wait (a burst of clients starts as one batch, not as its first request's row alone while
        the others wait a whole block)."""
        while 0 < len(self.waiting) < free and not self.closing:
            waiting = len(self.waiting)
            self.wait(GATHER_SECONDS)
            if len(self.waiting) == waiting:
                return

    def _group(self, task: Task) -> Group:
        """A new batch for `task`'s kind."""
        add = task.add
        options = LoopOptions(stop_early=add.stop_early, compile=self.compile, guidance=task.guidance,
                              prefix_cache=self.prefix if task.cache.keeps_final_blocks else None)
        batch = new_batch(self.model, task.sampler, task.cache, add.block_length, add.steps_per_block, options)
        group = Group(task.key, batch)
        options.callback = lambda info: self._step(group)
        return group

    def _retire(self, group: Group) -> None:
        """Take delivered and cancelled rows out of `group` (all at once where rows cannot leave a running batch);
        an empty group ends."""
        batch = group.batch
        leaving = [row for row, task in group.tasks.items() if task.delivered or task.cancelled]
        if batch.joins_between_blocks:
            for row in leaving:
                batch.remove(row)
                del group.tasks[row]
        elif len(leaving) == len(group.tasks):
            group.tasks = {}
        if not group.tasks:
            self.groups.remove(group)

    def _step(self, group: Group) -> None:
        """After every step: read the inbox (`poll`); an aborted request's row stops decoding (it leaves at the
        block's end)."""
        self.steps += 1
        self._step_events(group)
        self.rows_per_step[len(group.batch.rows)] += 1
        self.poll()
        for row, task in group.tasks.items():
            if task.cancelled and not task.delivered:
                group.batch.cancel(row)
                self._finish(task)

    def _step_events(self, group: Group) -> None:
        """The step's events of the rows that asked (`Add.step_events`): what changed in each answer since its last
        event, read from the device in one copy of those rows only."""
        batch, canvas = group.batch, group.batch.canvas
        asked = [(i, task) for i, row in enumerate(batch.rows)
                 if (task := group.tasks.get(row)) is not None and task.add.step_events and not task.delivered]
        if not asked:
            return
        index = torch.tensor([i for i, _ in asked], device=canvas.tokens.device)
        tokens = canvas.tokens[index]
        blank = (canvas.uncommitted[index] if canvas.uncommitted is not None else tokens == canvas.mask_id)
        spans = torch.stack([canvas.gen_start[index], canvas.gen_end[index]], 1)
        width = tokens.shape[1]
        for (_, task), row in zip(asked, torch.cat([tokens, blank.to(tokens.dtype), spans.to(tokens.dtype)],
                                                   1).tolist()):
            task.steps += 1
            start, end = row[2 * width:]
            event = _changes(task, row[start:end], [bool(b) for b in row[width + start:width + end]],
                             uniform=canvas.mask_id is None)
            if event is not None:
                self.step_events.append(StepEvent(task.add.req_id, task.steps, batch.block,
                                                  batch.stats.nfe - task.forwards_before, *event))

    def _block(self, group: Group) -> None:
        batch = group.batch
        nfe, committed, rows, began = batch.stats.nfe, batch.stats.gen_tokens, batch.rows_computed, time.perf_counter()
        try:
            batch.run_block()  # (it waits for the device at its end)
        finally:
            self.busy_seconds += time.perf_counter() - began
        self.hold_seconds = HOLD_SHARE * (time.perf_counter() - began)
        self.rows_computed += batch.rows_computed - rows
        self.forwards += batch.stats.nfe - nfe
        self.committed += batch.stats.gen_tokens - committed
        for row, task in group.tasks.items():
            if not task.delivered:
                self._deliver(batch, row, task)

    def _deliver(self, batch: Batch, row: Row, task: Task) -> None:
        """Send `row`'s answer tokens not sent yet (its decoded blocks, cut at max_tokens); at its end the finish
        reason, and the row stops decoding."""
        answer, finished, limit = batch.answer(row), batch.done(row), task.add.max_tokens
        over = limit is not None and len(answer) > limit
        ids = answer[:limit] if limit is not None else answer
        done = finished or limit is not None and len(ids) >= limit
        if done and not finished:
            batch.cancel(row)  # complete at max_tokens: the row stops decoding
        start = min(task.sent, len(ids))
        logprobs = None if task.add.logprobs is None else batch.logprobs(row)[start:len(ids)]
        reason = None if not done else "stop" if row.finished and not over else "length"
        self.outputs.append(Delta(task.add.req_id, start, ids[start:], logprobs, reason))
        task.sent = len(ids)
        if done:
            self._finish(task)
            self.returning += 1

    # -- numbers ----------------------------------------------------------------------------------------------
    def stats(self) -> Stats:
        """Gauges, counters, and the busy share and steps per second over the last second (or more)."""
        now = time.perf_counter()
        since, busy, steps = self._window
        if now - since >= 1.0:
            self._rates = ((self.busy_seconds - busy) / (now - since), (self.steps - steps) / (now - since))
            self._window = (now, self.busy_seconds, self.steps)
        p = self.prefix
        held = self.held_seconds + (now - self._held_since if self.tasks else 0.0)
        return Stats(waiting=len(self.waiting), rows=sum(len(group.tasks) for group in self.groups),
                     batches=len(self.groups), forwards=self.forwards, committed=self.committed,
                     rows_computed=self.rows_computed, steps=self.steps, busy_seconds=self.busy_seconds,
                     held_seconds=held, seconds=now - self.started, busy=self._rates[0], steps_per_s=self._rates[1],
                     rows_per_step=list(self.rows_per_step),
                     prefix=None if p is None else PrefixStats(p.queried, p.hits, p.evicted, p.nbytes, len(p.blocks)))
