"""Plots of benchmark levels (lines over levels, a histogram): what they draw, and that labels are escaped."""

from __future__ import annotations

import re

from portal.core.charts import histogram, line_chart, run_plots


def test_it_escapes_labels():
    svg = line_chart(title="<script>x</script>", x_labels=["1"], series=[("a&b", [1.0])], y_label="y")
    assert "<script>" not in svg
    assert "&lt;script&gt;" in svg and "a&amp;b" in svg


def test_it_leaves_gaps_for_missing_values():
    svg = line_chart(title="t", x_labels=["1", "2", "3"], series=[("s", [1.0, None, 3.0])], y_label="y")
    assert svg.count("<circle") == 2


def test_it_bins_a_distribution_and_marks_the_limit():
    svg = histogram(title="TTFT", values=[0.1, 0.2, 0.2, 1.5], x_title="s", bins=4, limit=("SLA 2 s", 2.0))
    assert svg.count('class="bar"') == 2  # two of four bins hold them; the limit is on the scale
    assert "SLA 2 s" in svg and "off-scale" not in svg


def test_a_histogram_spans_the_data_and_marks_a_far_limit_at_its_edge():
    values = [0.010 + i * 0.001 for i in range(20)]  # 10–29 ms TTFTs under a 3 s SLA
    svg = histogram(title="TTFT", values=values, x_title="s", bins=10, limit=("SLA 3 s", 3.0))
    assert svg.count('class="bar"') == 10  # spread over every bin, not one bar beside the SLA
    assert 'class="sla off-scale"' in svg and "SLA 3 s: right of this scale" in svg


def test_lines_are_scaled_to_the_data_and_a_far_sla_is_an_arrow_at_the_top():
    svg = line_chart(
        title="TTFT", x_labels=["1", "2"], series=[("P95", [0.02, 0.04])], y_label="s",
        limits=[("SLA P95 TTFT 3 s", 3.0)],
    )  # fmt: skip
    assert 'class="sla off-scale"' in svg and "SLA P95 TTFT 3 s: above this scale" in svg
    assert ">0.06</text>" in svg and ">3</text>" not in svg  # the axis tops at 0.06 s, not 3 s
    near = line_chart(
        title="TTFT", x_labels=["1", "2"], series=[("P95", [2.0, 2.5])], y_label="s",
        limits=[("SLA P95 TTFT 3 s", 3.0)],
    )  # fmt: skip
    assert "off-scale" not in near and '<line class="sla"' in near
    assert histogram(title="x", values=[], x_title="s") == ""


def test_it_draws_nothing_without_closed_loop_levels():
    assert run_plots([{"concurrency": None, "request_rate": 2.0}], sla_ttft_s=3, sla_tpot_s=0.2) == []


def test_a_histograms_request_counts_have_whole_number_ticks():
    svg = histogram(title="TTFT", values=[0.1, 0.2, 0.3], x_title="s", bins=3)
    ticks = re.findall(r'text-anchor="end" fill="#5b6577">([0-9.]+)</text>', svg)
    assert ticks == ["0", "1", "2", "3", "4"]
