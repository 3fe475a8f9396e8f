"""The simulator's `/metrics`, under vLLM's metric names (V1 engine).

`inference.vllm_metrics` reads the gauges and counters; the histograms have vLLM's
names and bucket edges so dashboards built for vLLM read them unchanged.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's bucket edges (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class SimMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.labels = {"model_name": model_name, "engine": "0"}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            TPOT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TPOT_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS
        )
        self._prefix = (0, 0)
        # Create every series now, so a fresh server reports zeros rather than nothing.
        for metric in (self.running, self.waiting, self.kv_usage, self.preemptions, self.prompt_tokens,
                       self.generation_tokens, self.prefix_queries, self.prefix_hits, self.ttft, self.tpot,
                       self.itl, self.e2e):  # fmt: skip
            metric.labels(**self.labels)
        for reason in ("stop", "length", "abort"):
            self.success.labels(**self.labels, finished_reason=reason)

    def update_gauges(self, *, running: int, waiting: int, kv_usage: float, queries: int, hits: int) -> None:
        self.running.labels(**self.labels).set(running)
        self.waiting.labels(**self.labels).set(waiting)
        self.kv_usage.labels(**self.labels).set(kv_usage)
        old_queries, old_hits = self._prefix
        if queries > old_queries:
            self.prefix_queries.labels(**self.labels).inc(queries - old_queries)
        if hits > old_hits:
            self.prefix_hits.labels(**self.labels).inc(hits - old_hits)
        self._prefix = (queries, hits)

    def render(self) -> bytes:
        return generate_latest(self.registry)
