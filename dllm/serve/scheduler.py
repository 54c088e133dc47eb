"""The engine thread: requests join a running batch of their kind between blocks (continuous batching), batches of
different kinds take blocks in turn, and each block's tokens go to their requests."""
from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache import CACHES, PrefixBlocks
from ..core.checks import check_int
from ..core.errors import DllmError, DllmNotice
from ..engine.loop import Batch, Row
from .metrics import Metrics
from .requests import Job, RequestReader


class ShuttingDown(Exception):
    pass


@dataclass(eq=False)
class Group:
    """A running batch and its requests, which share a `Job.key` (the sampler's batch-wide settings, the cache, the
    block layout, LLaDA's options); their rows differ in per-row sampler settings, seeds, lengths and stop strings."""

    key: tuple
    batch: Batch
    jobs: dict[Row, Job] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        """Takes rows now: before its first block, or between blocks where rows may join a running batch."""
        return self.batch.joins_between_blocks or not self.batch.block


def _error(error: Exception) -> dict:
    """The event for a request that `error` ended: 400 with the one-line reason, or 500."""
    if isinstance(error, DllmError):
        return {"kind": "error", "status": 400, "message": str(error)}
    return {"kind": "error", "status": 500, "message": f"{type(error).__name__}: {error}"}


class Engine:
    """The decode loop's driver. Between blocks it admits waiting jobs, oldest first, into a batch of their key
    (a new one where none can take them), up to `max_batch` rows in all; then the next batch in turn runs a block,
    so no kind of request waits behind another unless the engine is full. After each block every row's answer so
    far goes to its job (`Job.emit`); turning ids into text is left to the HTTP side."""

    def __init__(self, model, tokenizer, name: str, defaults: dict[str, Any], max_batch: int = 8,
                 compile: bool = False, prefix_cache_mb: float = 0):
        check_int("max_batch", max_batch, 1)
        # kept blocks' keys and values, reused by every request that starts with them (block-causal and causal-prefix
        # models)
        self.prefix = PrefixBlocks(model, prefix_cache_mb) if prefix_cache_mb else None
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.max_batch, self.compile = max_batch, compile
        self.requests = RequestReader(model, tokenizer, name, defaults, compile)
        self.metrics = Metrics(self.prefix)
        self.waiting: deque[Job] = deque()
        self.cond = threading.Condition()
        self.groups: list[Group] = []  # running batches, in the order they take blocks
        self.draining = self.stopping = False
        self.forwards = self.committed = 0
        self.thread = threading.Thread(target=self._run, name="dllm-engine", daemon=True)

    @property
    def jobs(self) -> dict[Row, Job]:
        """Every running row's job (read from any thread: copies, never iterates what the engine thread changes)."""
        return {row: job for group in list(self.groups) for row, job in list(group.jobs.items())}

    # -- requests ---------------------------------------------------------------------------------------------
    def job(self, body: Any, chat: bool) -> Job:
        """Validate a request body into a Job (DllmError: the one-line reason)."""
        return self.requests.job(body, chat)

    def check_defaults(self) -> None:
        """Fail now (DllmError) on defaults that would fail every request: they decode a one-token prompt; a
        prefix cache needs a default cache that keeps finished blocks."""
        cache = self.requests.defaults["cache"]
        if self.prefix is not None and not CACHES.get(cache).keeps_final_blocks:
            raise DllmError(f"--prefix-cache-mb reuses the keys and values cache 'block' keeps; the default cache "
                            f"{cache!r} recomputes them: use --cache block or drop --prefix-cache-mb")
        try:
            with warnings.catch_warnings():  # a one-token prompt is outside any prompt format: not the user's
                warnings.simplefilter("ignore", DllmNotice)
                self.job({"prompt": [self.model.config.filler_id]}, chat=False)
        except DllmError as e:
            raise DllmError(f"the server's defaults cannot answer any request: {e}") from None

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.draining:
                raise ShuttingDown("the server is shutting down; send the request to another instance")
            self.waiting.append(job)
            self.metrics.queue.set(len(self.waiting))
            self.cond.notify()

    # -- the engine thread ------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Cancel what is left and end the thread (after uvicorn's bounded graceful shutdown)."""
        with self.cond:
            self.draining = self.stopping = True
            for job in list(self.waiting) + list(self.jobs.values()):
                job.cancelled = True
            self.cond.notify()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self.cond:
                while not (self.waiting or self.groups or self.stopping):
                    self.cond.wait()
                if self.stopping and not self.groups:
                    for job in self.waiting:
                        job.emit({"kind": "error", "status": 503, "message": "the server is shutting down"})
                    return
            self.step()

    def step(self) -> None:
        """Admit waiting jobs, then run one block of the next batch in turn (the engine thread's loop body)."""
        self._admit()
        if not self.groups:
            return
        group = self.groups[0]
        try:
            self._block(group)
        except Exception as error:  # every request of the batch gets the message, once; the server goes on
            for job in group.jobs.values():
                self._fail(job, error)
            group.jobs = {}
        self.groups.remove(group)
        if group.jobs:
            self.groups.append(group)  # its next block after every other batch's

    def _fail(self, job: Job, error: Exception) -> None:
        self.metrics.requests.labels(self._endpoint(job), "error").inc()  # counted before it is answered
        job.emit(_error(error))

    def _admit(self) -> None:
        """Between blocks: drop finished and cancelled rows, then fill free slots from the queue, oldest first; a
        job waits only while the engine is full."""
        for group in list(self.groups):
            self._retire(group)
        with self.cond:
            free = self.max_batch - sum(len(group.jobs) for group in self.groups)
            while self.waiting and free > 0:
                job = self.waiting.popleft()
                if job.cancelled:
                    continue
                group = next((g for g in self.groups if g.key == job.key and g.open), None)
                try:
                    if group is None:
                        group = self._group(job)
                    row = group.batch.add(job.ids, job.lengths["gen_length"], job.seed, job.sampler, job.logprobs)
                except Exception as error:  # checked in `job` already; this request alone gets any error left
                    self._fail(job, error)
                    continue
                if not group.jobs:
                    self.groups.append(group)
                group.jobs[row] = job
                free -= 1
            self.metrics.queue.set(len(self.waiting))
        self.metrics.rows.set(sum(len(group.jobs) for group in self.groups))
        self.metrics.batches.set(len(self.groups))

    def _group(self, job: Job) -> Group:
        """A new batch for `job`'s kind."""
        batch = Batch(self.model, job.sampler, job.cache, job.lengths["block_length"], job.steps_per_block,
                      stop_early=job.stop_early, compile=self.compile,
                      prefix_cache=self.prefix if job.cache.keeps_final_blocks else None, guidance=job.guidance)
        group = Group(job.key, batch)
        batch.callback = lambda info: self._step(group)
        return group

    def _retire(self, group: Group) -> None:
        """Take delivered and cancelled rows out of `group` (all at once where rows cannot leave a running batch);
        an empty group ends."""
        batch = group.batch
        leaving = [row for row, job in group.jobs.items() if job.delivered or job.cancelled]
        if batch.joins_between_blocks:
            for row in leaving:
                batch.remove(row)
                del group.jobs[row]
        elif len(leaving) == len(group.jobs):
            group.jobs = {}
        if not group.jobs:
            self.groups.remove(group)

    def _step(self, group: Group) -> None:
        """After every step: the row of a request that is complete (a stop string) or cancelled stops decoding (it
        leaves at the block's end)."""
        for row, job in group.jobs.items():
            if (job.cancelled or job.complete) and not job.delivered:
                group.batch.cancel(row)
                job.delivered = True
                if not job.complete:
                    self.metrics.requests.labels(self._endpoint(job), "cancelled").inc()

    def _block(self, group: Group) -> None:
        batch, metrics = group.batch, self.metrics
        nfe, committed, rows = batch.stats.nfe, batch.stats.gen_tokens, batch.rows_computed
        batch.run_block()
        metrics.rows_computed.inc(batch.rows_computed - rows)
        self.forwards += batch.stats.nfe - nfe
        self.committed += batch.stats.gen_tokens - committed
        metrics.forwards.inc(batch.stats.nfe - nfe)
        metrics.committed.inc(batch.stats.gen_tokens - committed)
        metrics.tokens_per_forward.set(self.committed / self.forwards if self.forwards else 0.0)
        now = time.perf_counter()
        for row, job in group.jobs.items():
            if job.delivered:
                continue
            if job.first_block is None:
                job.first_block = now
                metrics.first_block.observe(now - job.submitted)
            self._deliver(batch, row, job)

    @staticmethod
    def _deliver(batch: Batch, row: Row, job: Job) -> None:
        """Emit `row`'s answer so far (its decoded blocks, cut at max_tokens); at its end the finish reason, and
        the row stops decoding."""
        answer, finished = batch.answer(row), batch.done(row)
        over = job.max_tokens is not None and len(answer) > job.max_tokens
        ids = answer[:job.max_tokens] if job.max_tokens is not None else answer
        done = finished or job.max_tokens is not None and len(ids) >= job.max_tokens
        if done and not finished:
            batch.cancel(row)  # complete at max_tokens: the row stops decoding
        job.delivered = done
        job.emit({"kind": "block", "ids": ids, "done": done, "reason": "stop" if row.finished and not over else "length",
                  "logprobs": None if job.logprobs is None else batch.logprobs(row)[:len(ids)]})

    @staticmethod
    def _endpoint(job: Job) -> str:
        return "chat" if job.chat else "completions"
