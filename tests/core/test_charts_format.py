"""What every chart shares: one number formatting (axes, exact values, round ticks) and one escaping,
checked through each kind of chart with a label a user could have typed."""

from __future__ import annotations

import datetime as dt
import re

import pytest

from portal.core.charts import (
    Line,
    bar_chart_svg,
    exact_number,
    histogram,
    line_chart,
    short_number,
    sparkline,
    time_series_svg,
    y_ticks,
)

HOSTILE = "<script>alert('x')</script> & \"quoted\""
END = dt.datetime(2026, 12, 2, 4, 0, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("value", "label"),
    [
        (0, "0"), (0.06, "0.06"), (0.25, "0.25"), (1, "1"), (2.5, "2.5"), (12.5, "12.5"), (250, "250"),
        (999, "999"), (1000, "1k"), (1500, "1.5k"), (7500, "7.5k"), (100_000, "100k"), (293_822, "294k"),
        (999_600, "1M"), (80e6, "80M"), (2.5e9, "2.5G"), (-0.5, "-0.5"),
    ],
)  # fmt: skip
def test_axis_labels_are_short(value, label):
    assert short_number(value) == label


def test_exact_values_carry_thousands_separators():
    assert [exact_number(v) for v in (293_822, 0.25, 1_234.5, 7)] == ["293,822", "0.25", "1,234.50", "7"]


def test_ticks_are_round_steps_from_zero():
    assert y_ticks(0.8) == [0, 0.2, 0.4, 0.6, 0.8]
    assert y_ticks(0.84) == [0, 0.25, 0.5, 0.75, 1]
    assert y_ticks(5630) == [0, 2000, 4000, 6000]
    assert y_ticks(3, whole=True) == [0, 1, 2, 3, 4]


def test_a_time_series_in_the_thousands_has_short_ticks():
    times = [END - dt.timedelta(minutes=10 - i) for i in range(10)]
    svg = time_series_svg(
        times, {"requests": [3000.0] * 10}, start=times[0], end=END, title="Requests", unit=""
    )  # fmt: skip
    ticks = re.findall(r'class="chart-label y-tick">([^<]+)</text>', svg)
    assert ticks == ["0", "1k", "2k", "3k", "4k"]  # not 1e+03


def test_every_kind_of_chart_escapes_what_a_user_typed():
    times = [END - dt.timedelta(minutes=10 - i) for i in range(10)]
    charts = [
        bar_chart_svg([(HOSTILE, 5.0)], title=HOSTILE, limit=3.0, limit_label=HOSTILE),
        sparkline([1.0, 2.0, 3.0], label=HOSTILE),
        time_series_svg(
            times, {HOSTILE: [1.0] * 10}, start=times[0], end=END, title=HOSTILE, unit=HOSTILE,
            lines=[Line(2.0, HOSTILE, "sla")], chart_id=HOSTILE,
        ),
        line_chart(title=HOSTILE, x_labels=[HOSTILE], series=[(HOSTILE, [1.0])], y_label=HOSTILE,
                   x_title=HOSTILE, limits=[(HOSTILE, 1.5)]),
        histogram(title=HOSTILE, values=[0.1, 0.2], x_title=HOSTILE, limit=(HOSTILE, 0.15)),
    ]  # fmt: skip
    for svg in charts:
        assert "<script>" not in svg and '"quoted"' not in svg and "'x'" not in svg
        assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &quot;quoted&quot;" in svg


def test_a_bar_shows_its_value_in_full_and_the_axis_its_peak_in_short():
    svg = bar_chart_svg([("12-01", 293_822.0), ("12-02", 1_000.0)], title="Tokens per day", limit=100_000.0,
                        limit_label="daily quota")  # fmt: skip
    assert "12-01: 293,822</title>" in svg
    assert ">294k</text>" in svg and ">daily quota 100k</text>" in svg
