"""Reading vLLM's /metrics text."""

import pytest

from inference.vllm_metrics import histogram_totals, parse_vllm_metrics

# Shaped like vLLM 0.3x's V1 engine output (names, labels, counters with _total).
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 7.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 1200.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 800.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.9
"""


def test_it_reads_the_gauges_and_counters():
    metrics = parse_vllm_metrics(VLLM_METRICS)
    assert metrics.running == 3
    assert metrics.waiting == 5
    assert metrics.kv_cache_usage == 0.25
    assert metrics.preemptions == 7
    assert metrics.prompt_tokens == 1200
    assert metrics.generation_tokens == 800


def test_it_sums_over_engines():
    second_engine = VLLM_METRICS.replace('engine="0"', 'engine="1"').replace("# ", "#x ")
    text = VLLM_METRICS + "\n".join(line for line in second_engine.splitlines() if not line.startswith("#"))
    assert parse_vllm_metrics(text).running == 6


def test_it_reads_the_older_cache_usage_name():
    text = VLLM_METRICS.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert parse_vllm_metrics(text).kv_cache_usage == 0.25


def test_it_reports_missing_figures_as_none():
    metrics = parse_vllm_metrics("# TYPE other gauge\nother 1\n")
    assert metrics.running is None
    assert metrics.preemptions is None


def test_it_reads_histogram_totals():
    assert histogram_totals(VLLM_METRICS, "vllm:time_to_first_token_seconds") == (0.9, 4.0)
    assert histogram_totals(VLLM_METRICS, "vllm:e2e_request_latency_seconds") is None


def test_it_refuses_text_that_is_not_prometheus():
    with pytest.raises(ValueError):
        parse_vllm_metrics("<html>not metrics</html>\n")
