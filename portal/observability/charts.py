"""The deployment page's production latency charts: portal/core/charts.py draws them (the node page's
GPU health charts use it too, from a lower layer)."""

from __future__ import annotations

from portal.core.charts import BENCH_STYLE, SERIES_STYLES, SLA_STYLE, Line, time_series_svg

__all__ = ["BENCH_STYLE", "SERIES_STYLES", "SLA_STYLE", "Line", "time_series_svg"]
