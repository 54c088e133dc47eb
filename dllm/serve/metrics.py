"""The server's Prometheus metrics (prometheus_client, extra `serve`), one registry per engine."""


class Metrics:
    """Prometheus metrics of one server (its own registry)."""

    def __init__(self, prefix_cache=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("dllm_requests", "Requests answered, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("dllm_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.tokens = Counter("dllm_generated_tokens", "Answer tokens sent", registry=r)
        self.committed = Counter("dllm_committed_tokens", "Tokens committed by the sampler", registry=r)
        self.forwards = Counter("dllm_forwards", "Model forwards", registry=r)
        self.rows_computed = Counter("dllm_rows_computed", "Token rows the network computed, summed over layers",
                                     registry=r)
        self.tokens_per_forward = Gauge("dllm_tokens_per_forward", "Committed tokens per forward (all rows), "
                                        "since start", registry=r)
        self.queue = Gauge("dllm_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.rows = Gauge("dllm_batch_rows", "Rows in the running batch", registry=r)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.latency = Histogram("dllm_request_latency_seconds", "Request latency, submit to last block",
                                 buckets=buckets, registry=r)
        self.first_block = Histogram("dllm_first_block_seconds", "Submit to the first final block",
                                     buckets=buckets, registry=r)
        if prefix_cache is not None:
            r.register(_PrefixCacheCollector(prefix_cache))

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
