"""The server's Prometheus metrics (prometheus_client, extra `serve`), one registry per engine."""

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)  # seconds

METRICS = (  # attribute, kind, name, description, labels
    ("requests", "counter", "dllm_requests", "Requests answered, by endpoint and outcome", ("endpoint", "outcome")),
    ("prompt_tokens", "counter", "dllm_prompt_tokens", "Prompt tokens of answered requests", ()),
    ("tokens", "counter", "dllm_generated_tokens", "Answer tokens sent", ()),
    ("committed", "counter", "dllm_committed_tokens", "Tokens committed by the sampler", ()),
    ("forwards", "counter", "dllm_forwards", "Model forwards", ()),
    ("rows_computed", "counter", "dllm_rows_computed", "Token rows the network computed, summed over layers", ()),
    ("tokens_per_forward", "gauge", "dllm_tokens_per_forward", "Committed tokens per forward (all rows), since start",
     ()),
    ("queue", "gauge", "dllm_queue_depth", "Requests waiting for a batch slot", ()),
    ("rows", "gauge", "dllm_batch_rows", "Rows in the running batches", ()),
    ("batches", "gauge", "dllm_batches", "Running batches (one per kind of request: sampler, cache, layout)", ()),
    ("latency", "histogram", "dllm_request_latency_seconds", "Request latency, submit to last block", ()),
    ("first_block", "histogram", "dllm_first_block_seconds", "Submit to the first final block", ()),
)


class Metrics:
    """Prometheus metrics of one server (its own registry), an attribute per row of `METRICS`, and the prefix
    cache's counters where it has one."""

    def __init__(self, prefix_cache=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
        self.registry = CollectorRegistry()
        for attribute, kind, name, description, labels in METRICS:
            extra = {"buckets": BUCKETS} if kind == "histogram" else {}
            setattr(self, attribute, kinds[kind](name, description, labels, registry=self.registry, **extra))
        if prefix_cache is not None:
            self.registry.register(_PrefixCacheCollector(prefix_cache))

    def answered(self, endpoint: str, usage: dict, seconds: float) -> None:
        """Count a complete answer."""
        self.tokens.inc(usage["completion_tokens"])
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.latency.observe(seconds)
        self.requests.labels(endpoint, "ok").inc()

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _PrefixCacheCollector:
    """The prefix cache's counters (`cache.PrefixBlocks`), read at each scrape."""

    def __init__(self, prefix):
        self.prefix = prefix

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p = self.prefix
        yield CounterMetricFamily("dllm_prefix_cache_queried_tokens", "Tokens of whole blocks before rows' current "
                                  "blocks looked up at each batch layout", value=p.queried)
        yield CounterMetricFamily("dllm_prefix_cache_hit_tokens", "Of those, tokens whose keys and values were "
                                  "reused", value=p.hits)
        yield CounterMetricFamily("dllm_prefix_cache_evicted_blocks", "Blocks evicted (least recently used)",
                                  value=p.evicted)
        yield GaugeMetricFamily("dllm_prefix_cache_bytes", "Bytes of kept keys and values", value=p.nbytes)
        yield GaugeMetricFamily("dllm_prefix_cache_blocks", "Blocks kept", value=len(p.blocks))
