"""A benchmark table's plots: throughput, TTFT and TPOT over its levels, with the SLA lines (the
plots themselves: tests/core/test_charts_levels.py)."""

from __future__ import annotations

from portal.benchmarks.services import FIELD_GUIDE_7B_TABLE, parse_table
from portal.core.charts import run_plots


def test_it_draws_throughput_ttft_and_tpot_with_the_sla_lines():
    plots = run_plots(parse_table(FIELD_GUIDE_7B_TABLE), sla_ttft_s=3.0, sla_tpot_s=0.2)
    assert len(plots) == 3
    throughput, ttft, tpot = plots
    assert "Output throughput vs concurrency" in throughput and throughput.count("<circle") == 5
    assert 'class="sla"' in ttft and "SLA P95 TTFT 3 s" in ttft
    assert "SLA P95 TPOT 0.2 s" in tpot
    assert "mean TTFT" in ttft  # the table has means, not P50s
    assert all(svg.startswith("<svg") and svg.endswith("</svg>") for svg in plots)
