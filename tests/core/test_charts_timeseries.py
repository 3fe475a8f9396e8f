"""The production latency charts: whole width, round y ticks, P50 and P95 in different colours,
dated time axes, and a reference line far above the data marked at the edge."""

from __future__ import annotations

import datetime as dt
import re

from portal.core.charts import Line, time_series_svg, time_ticks

END = dt.datetime(2026, 12, 2, 4, 0, tzinfo=dt.UTC)


def chart(window: dt.timedelta, p95: float, p50: float, lines=()) -> str:
    times = [END - window + window * i / 10 for i in range(10)]
    return time_series_svg(
        times, {"P95 TTFT": [p95] * 10, "P50 TTFT": [p50] * 10}, start=END - window, end=END,
        title="TTFT", unit="s", lines=list(lines), chart_id="t",
    )  # fmt: skip


def test_it_has_round_y_ticks_and_distinct_colours_for_p95_and_p50():
    svg = chart(dt.timedelta(hours=1), 0.8, 0.4)
    ticks = re.findall(r'class="chart-label y-tick">([0-9.]+)', svg)
    assert ticks == ["0", "0.25", "0.5", "0.75", "1"]  # round steps up past the 0.8 s P95
    colours = re.findall(r'data-series="(P\d\d) TTFT" fill="none" stroke="(#[0-9a-f]{6})"', svg)
    assert dict(colours) == {"P95": "#d9480f", "P50": "#1f6feb"}
    assert 'width="100%"' in svg


def test_day_and_week_axes_carry_dates():
    day = [label for _, label in time_ticks(END - dt.timedelta(days=1), END)]
    assert len(day) <= 8 and day[0] == "01 Dec 06:00" and "02 Dec 00:00" in day and "09:00" in day
    week = [label for _, label in time_ticks(END - dt.timedelta(days=7), END)]
    assert week == [f"{day} Nov" for day in ("Thu 26", "Fri 27", "Sat 28", "Sun 29", "Mon 30")] + [
        "Tue 01 Dec",
        "Wed 02 Dec",
    ]
    hour = [label for _, label in time_ticks(END - dt.timedelta(hours=1), END)]
    assert hour[0] == "02 Dec 03:00" and hour[1] == "03:10"


def test_a_reference_line_far_above_the_data_is_marked_at_the_top():
    svg = chart(dt.timedelta(hours=1), 0.05, 0.02, [Line(3.0, "SLA P95 TTFT 3 s", "sla")])
    assert 'class="ref-line sla-line off-scale" data-value="3"' in svg
    assert "SLA P95 TTFT 3 s: above this scale" in svg
    assert ">0.06 s</text>" in svg  # the top tick follows the data, not the 3 s SLA
    near = chart(dt.timedelta(hours=1), 2.5, 1.0, [Line(3.0, "SLA P95 TTFT 3 s", "sla")])
    assert "off-scale" not in near and 'class="ref-line sla-line" data-value="3"' in near
