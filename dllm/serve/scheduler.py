"""The engine thread: requests wait in a queue and join the running batch between blocks (continuous batching);
each block's new text goes to its request."""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch

from ..cache import CACHES, PrefixBlocks
from ..core.checks import check_int
from ..core.errors import DllmError
from ..engine.loop import Batch
from ..engine.text import answer_text
from .metrics import Metrics
from .requests import Job, RequestReader


class ShuttingDown(Exception):
    pass


def _stop_start(text: str, stops: list[str]) -> int:
    """The length of the longest end of `text` that begins one of `stops` (0 if none)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def _shortest_prefix(tokenizer, ids: list[int], holds) -> int:
    """The fewest of `ids` (1..len) whose text `holds`, a test that stays true for every longer prefix once true
    (len(ids) if none does)."""
    low, high = 1, len(ids)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if holds(answer_text(tokenizer, ids[:mid])) else (mid + 1, high)
    return low


def _tokens_through_stop(tokenizer, ids: list[int], stops: list[str]) -> int:
    """How many of `ids` it takes for the text to contain one of `stops` (as vLLM counts a stopped completion)."""
    return _shortest_prefix(tokenizer, ids, lambda text: any(s in text for s in stops))


def _tokens_in_text(tokenizer, ids: list[int], length: int) -> int:
    """How many of `ids` have their text within its first `length` characters."""
    if not ids or len(answer_text(tokenizer, ids)) <= length:
        return len(ids)
    return _shortest_prefix(tokenizer, ids, lambda text: len(text) > length) - 1


class Engine:
    """The decode loop's driver: admits waiting jobs between blocks, runs blocks, sends each job its new text."""

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
        self.batch: Batch | None = None
        self.jobs: dict[Any, Job] = {}  # the batch's rows -> their requests
        self.draining = self.stopping = False
        self.key: tuple | None = None  # the running batch's Job.key
        self.forwards = self.committed = 0
        self.thread = threading.Thread(target=self._run, name="dllm-engine", daemon=True)

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
                while not (self.waiting or self.jobs or self.stopping):
                    self.cond.wait()
                if self.stopping and not self.jobs:
                    for job in self.waiting:
                        job.send("error", status=503, message="the server is shutting down")
                    return
            try:
                self._admit()
                if self.jobs:
                    self._block()
            except Exception as error:  # every request of the batch gets the message, once; the server goes on
                message = str(error) if isinstance(error, DllmError) else f"{type(error).__name__}: {error}"
                for job in self.jobs.values():
                    job.send("error", status=400 if isinstance(error, DllmError) else 500, message=message)
                    self.metrics.requests.labels(self._endpoint(job), "error").inc()
                self.jobs, self.batch = {}, None

    def _admit(self) -> None:
        """Between blocks: drop delivered and cancelled rows, then fill free slots from the queue (FIFO; a
        request that cannot share the batch waits until the batch drains)."""
        batch = self.batch
        if batch is not None:
            leaving = [row for row, job in self.jobs.items() if job.delivered or job.cancelled]
            if batch.joins_between_blocks:
                for row in leaving:
                    batch.remove(row)
                    del self.jobs[row]
            elif len(leaving) == len(self.jobs):
                self.jobs = {}
            if not self.jobs:
                self.batch = batch = None
        if batch is not None and batch.block and not batch.joins_between_blocks:
            return
        with self.cond:
            while self.waiting and len(self.jobs) < self.max_batch:
                job = self.waiting[0]
                if job.cancelled:
                    self.waiting.popleft()
                    continue
                if batch is not None and job.key != self.key:
                    break
                self.waiting.popleft()
                try:
                    if batch is None:
                        batch = self.batch = Batch(self.model, job.sampler, job.cache, job.lengths["block_length"],
                                                   job.steps_per_block, stop_early=job.stop_early, compile=self.compile,
                                                   callback=self._step, prefix_cache=self.prefix
                                                   if job.cache.keeps_final_blocks else None)
                        self.key = job.key
                    row = batch.add(job.ids, job.lengths["gen_length"], job.seed, job.logprobs)
                except Exception as e:  # checked in `job` already; this request alone gets any error left
                    job.send("error", status=400 if isinstance(e, DllmError) else 500,
                             message=str(e) if isinstance(e, DllmError) else f"{type(e).__name__}: {e}")
                    self.metrics.requests.labels(self._endpoint(job), "error").inc()
                    continue
                self.jobs[row] = job
            self.metrics.queue.set(len(self.waiting))
        self.metrics.rows.set(len(self.jobs))

    def _step(self, info: dict) -> None:
        """After every step: a cancelled request's row stops decoding (it leaves at the block's end)."""
        for row, job in self.jobs.items():
            if job.cancelled and not job.delivered:
                self.batch.cancel(row)
                job.delivered = True
                self.metrics.requests.labels(self._endpoint(job), "cancelled").inc()

    def _block(self) -> None:
        batch, metrics = self.batch, self.metrics
        nfe, committed, rows = batch.stats.nfe, batch.stats.gen_tokens, batch.rows_computed
        batch.run_block()
        metrics.rows_computed.inc(batch.rows_computed - rows)
        self.forwards += batch.stats.nfe - nfe
        self.committed += batch.stats.gen_tokens - committed
        metrics.forwards.inc(batch.stats.nfe - nfe)
        metrics.committed.inc(batch.stats.gen_tokens - committed)
        metrics.tokens_per_forward.set(self.committed / self.forwards if self.forwards else 0.0)
        now = time.perf_counter()
        for row, job in self.jobs.items():
            if job.delivered:
                continue
            if job.first_block is None:
                job.first_block = now
                metrics.first_block.observe(now - job.submitted)
            self._deliver(batch, row, job, now)

    def _deliver(self, batch: Batch, row, job: Job, now: float) -> None:
        """Send the text of `row`'s newly decoded blocks; at its end the finish reason and usage."""
        answer, finished, stop_token = batch.answer(row), batch.done(row), row.finished
        over = job.max_tokens is not None and len(answer) > job.max_tokens  # cut at max_tokens
        ids = answer[:job.max_tokens] if job.max_tokens is not None else answer
        text = answer_text(self.tokenizer, ids)
        hits = [i for i in (text.find(s) for s in job.stop) if i >= 0]
        text = text[:min(hits)] if hits else text
        done = finished or bool(hits) or job.max_tokens is not None and len(ids) >= job.max_tokens
        if not done:  # text that may begin a stop string waits for the next block
            text = text[:len(text) - _stop_start(text, job.stop)]
        if hits:  # tokens decoded past the stop string are not the answer's
            ids = ids[:_tokens_through_stop(self.tokenizer, ids, job.stop)]
        if done or not text.endswith("\ufffd"):  # a character split between blocks waits for its end
            delta, job.text = text[len(job.text):], text
            if delta and job.stream:
                job.send("delta", text=delta, logprobs=self._logprobs(batch, row, job, ids, done))
        if not done:
            return
        if not finished:
            batch.cancel(row)  # complete at max_tokens or a stop string: the row stops decoding
        job.delivered = True
        reason = "stop" if hits or stop_token and not over else "length"
        usage = {"prompt_tokens": len(job.ids), "completion_tokens": len(ids), "total_tokens": len(job.ids) + len(ids)}
        job.send("done", text=job.text, finish_reason=reason, usage=usage,
                 logprobs=self._logprobs(batch, row, job, ids, done))
        metrics = self.metrics
        metrics.tokens.inc(len(ids))
        metrics.prompt_tokens.inc(len(job.ids))
        metrics.latency.observe(now - job.submitted)
        metrics.requests.labels(self._endpoint(job), "ok").inc()

    def _logprobs(self, batch: Batch, row, job: Job, ids: list[int], done: bool) -> list | None:
        """The log-probabilities of `ids`' tokens not sent yet whose text has been (all of them once `done`)."""
        if job.logprobs is None:
            return None
        sent = len(ids) if done else _tokens_in_text(self.tokenizer, ids, len(job.text))
        tokens, job.logprobs_sent = batch.logprobs(row)[job.logprobs_sent:sent], max(sent, job.logprobs_sent)
        return tokens

    @staticmethod
    def _endpoint(job: Job) -> str:
        return "chat" if job.chat else "completions"
