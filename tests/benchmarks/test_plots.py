"""Hand-built SVG plots: what they draw, and that labels are escaped."""

from __future__ import annotations

from portal.benchmarks.plots import histogram, line_chart, run_plots
from portal.benchmarks.services import FIELD_GUIDE_7B_TABLE, parse_table


def test_it_draws_throughput_ttft_and_tpot_with_the_sla_lines():
    plots = run_plots(parse_table(FIELD_GUIDE_7B_TABLE), sla_ttft_s=3.0, sla_tpot_s=0.2)
    assert len(plots) == 3
    throughput, ttft, tpot = plots
    assert "Output throughput vs concurrency" in throughput and throughput.count("<circle") == 5
    assert 'class="sla"' in ttft and "SLA P95 TTFT 3 s" in ttft
    assert "SLA P95 TPOT 0.2 s" in tpot
    assert "mean TTFT" in ttft  # the table has means, not P50s
    assert all(svg.startswith("<svg") and svg.endswith("</svg>") for svg in plots)


def test_it_escapes_labels():
    svg = line_chart(title="<script>x</script>", x_labels=["1"], series=[("a&b", [1.0])], y_label="y")
    assert "<script>" not in svg
    assert "&lt;script&gt;" in svg and "a&amp;b" in svg


def test_it_leaves_gaps_for_missing_values():
    svg = line_chart(title="t", x_labels=["1", "2", "3"], series=[("s", [1.0, None, 3.0])], y_label="y")
    assert svg.count("<circle") == 2


def test_it_bins_a_distribution_and_marks_the_limit():
    svg = histogram(title="TTFT", values=[0.1, 0.2, 0.2, 0.9], x_title="s", bins=4, limit=("SLA 3 s", 3.0))
    assert svg.count('class="bar"') == 2  # everything below 3 s falls in the first two of four bins
    assert "SLA 3 s" in svg
    assert histogram(title="x", values=[], x_title="s") == ""


def test_it_draws_nothing_without_closed_loop_levels():
    assert run_plots([{"concurrency": None, "request_rate": 2.0}], sla_ttft_s=3, sla_tpot_s=0.2) == []
