"""The server's Prometheus metrics (prometheus_client, extra `serve`), one registry per server: the HTTP process's
own (requests, tokens sent, latencies) and the engine process's numbers, which arrive with its outputs
(`messages.Stats`)."""
from __future__ import annotations

from .messages import Stats

SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BUCKETS = {"rows_per_step": (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)}  # a histogram's, where not SECONDS

METRICS = (  # attribute, kind, name, description, labels
    ("requests", "counter", "dllm_requests", "Requests answered, by endpoint and outcome", ("endpoint", "outcome")),
    ("prompt_tokens", "counter", "dllm_prompt_tokens", "Prompt tokens of answered requests", ()),
    ("tokens", "counter", "dllm_generated_tokens", "Answer tokens sent", ()),
    ("committed", "counter", "dllm_committed_tokens", "Tokens committed by the sampler", ()),
    ("forwards", "counter", "dllm_forwards", "Model forwards", ()),
    ("rows_computed", "counter", "dllm_rows_computed", "Token rows the network computed, summed over layers", ()),
    ("tokens_per_forward", "gauge", "dllm_tokens_per_forward", "Committed tokens per forward (all rows), since start",
     ()),
    ("queue", "gauge", "dllm_queue_depth", "Requests waiting in the engine for a batch slot", ()),
    ("rows", "gauge", "dllm_batch_rows", "Rows in the engine's running batches", ()),
    ("batches", "gauge", "dllm_batches", "Running batches (one per kind of request: sampler, cache, layout)", ()),
    ("steps", "counter", "dllm_engine_steps", "Decoding steps the engine ran", ()),
    ("steps_per_second", "gauge", "dllm_engine_steps_per_second", "Engine steps per second, over its last second",
     ()),
    ("busy_seconds", "counter", "dllm_engine_busy_seconds", "Seconds the engine spent inside the decode loop "
     "(Batch.run_block: the rows' layout, forwards, sampler steps, the waits for the device)", ()),
    ("held_seconds", "counter", "dllm_engine_held_seconds", "Seconds the engine held at least one request (waiting "
     "or running): busy_seconds over this is its busy share while requests wait", ()),
    ("busy", "gauge", "dllm_engine_busy", "Share of the engine's last second spent inside the decode loop", ()),
    ("restarts", "counter", "dllm_engine_restarts", "Engines started anew after a failure (--engine-restart)", ()),
    ("rows_per_step", "histogram", "dllm_batch_rows_per_step", "Rows of the batch each decoding step computed",
     ()),
    ("latency", "histogram", "dllm_request_latency_seconds", "Request latency, submit to last block", ()),
    ("first_block", "histogram", "dllm_first_block_seconds", "Submit to the first final block", ()),
)

ENGINE_COUNTERS = ("committed", "forwards", "rows_computed", "steps", "busy_seconds", "held_seconds")  # `Stats`'s


class Metrics:
    """Prometheus metrics of one server (its own registry), an attribute per row of `METRICS`, and the prefix
    cache's counters where the engine has one."""

    def __init__(self, with_prefix_cache: bool = False):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
        self.registry = CollectorRegistry()
        for attribute, kind, name, description, labels in METRICS:
            extra = {"buckets": BUCKETS.get(attribute, SECONDS)} if kind == "histogram" else {}
            setattr(self, attribute, kinds[kind](name, description, labels, registry=self.registry, **extra))
        self.last = Stats()  # the engine's numbers as last counted
        self.committed_total = self.forwards_total = 0
        if with_prefix_cache:
            self.registry.register(_PrefixCacheCollector(self))

    def answered(self, endpoint: str, usage: dict, seconds: float) -> None:
        """Count a complete answer."""
        self.tokens.inc(usage["completion_tokens"])
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.latency.observe(seconds)
        self.requests.labels(endpoint, "ok").inc()

    def engine(self, stats: Stats) -> None:
        """The engine's latest numbers: its counters advance by what they grew since the last, its gauges are set."""
        for name in ENGINE_COUNTERS:
            grown = getattr(stats, name) - getattr(self.last, name)
            if grown > 0:
                getattr(self, name).inc(grown)
        known = self.last.rows_per_step
        for rows, steps in enumerate(stats.rows_per_step):
            for _ in range(steps - (known[rows] if rows < len(known) else 0)):
                self.rows_per_step.observe(rows)
        self.committed_total += max(stats.committed - self.last.committed, 0)
        self.forwards_total += max(stats.forwards - self.last.forwards, 0)
        self.tokens_per_forward.set(self.committed_total / self.forwards_total if self.forwards_total else 0.0)
        self.queue.set(stats.waiting)
        self.rows.set(stats.rows)
        self.batches.set(stats.batches)
        self.busy.set(stats.busy)
        self.steps_per_second.set(stats.steps_per_s)
        self.last = stats

    def engine_restarted(self) -> None:
        """A new engine counts from zero."""
        self.last = Stats()
        self.restarts.inc()

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _PrefixCacheCollector:
    """The prefix cache's counters (`cache.PrefixBlocks` in the engine), as its last numbers said."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p = self.metrics.last.prefix
        if p is None:
            return
        yield CounterMetricFamily("dllm_prefix_cache_queried_tokens", "Tokens of whole blocks before rows' current "
                                  "blocks looked up at each batch layout", value=p.queried)
        yield CounterMetricFamily("dllm_prefix_cache_hit_tokens", "Of those, tokens whose keys and values were "
                                  "reused", value=p.hits)
        yield CounterMetricFamily("dllm_prefix_cache_evicted_blocks", "Blocks evicted (least recently used)",
                                  value=p.evicted)
        yield GaugeMetricFamily("dllm_prefix_cache_bytes", "Bytes of kept keys and values", value=p.nbytes)
        yield GaugeMetricFamily("dllm_prefix_cache_blocks", "Blocks kept", value=p.blocks)
