"""vLLM's Prometheus `/metrics` text → the gauges and counters the portal watches.

Parsing is prometheus-client's; this module only picks vLLM's metric names and
sums them over label sets (a server serving one model has one set; data-parallel
engines add an `engine` label per engine). vLLM renamed a few metrics across
versions, so each figure lists every name it has had, newest first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families

# Figure → the metric names vLLM has used for it (V1 engine first).
GAUGES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    # A fraction 0..1 in vLLM despite the "perc" in its name.
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
COUNTERS: dict[str, tuple[str, ...]] = {
    "preemptions": ("vllm:num_preemptions", "vllm:num_preemptions_total"),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "requests_finished": ("vllm:request_success",),
}


@dataclass(frozen=True)
class VllmMetrics:
    """One scrape. A figure the server did not report is None, never a silent zero."""

    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    preemptions: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    requests_finished: float | None = None

    def to_dict(self) -> dict[str, float | None]:
        return asdict(self)


def _sample_values(text: str) -> dict[str, float]:
    """Sum every sample by its name over label sets (counters keep their `_total` name)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """Read vLLM's figures from a `/metrics` body; raises ValueError on text that is not Prometheus."""
    samples = _sample_values(text)
    values: dict[str, float | None] = {}
    for figure, names in GAUGES.items():
        values[figure] = next((samples[name] for name in names if name in samples), None)
    for figure, names in COUNTERS.items():
        # prometheus-client strips `_total` from a counter family's name but keeps it on the sample.
        candidates = [f"{name}_total" for name in names if not name.endswith("_total")] + list(names)
        values[figure] = next((samples[name] for name in candidates if name in samples), None)
    return VllmMetrics(**values)


def histogram_totals(text: str, metric: str) -> tuple[float, float] | None:
    """(sum, count) of a histogram such as `vllm:time_to_first_token_seconds`, or None if absent."""
    samples = _sample_values(text)
    if f"{metric}_count" not in samples:
        return None
    return samples.get(f"{metric}_sum", 0.0), samples[f"{metric}_count"]
