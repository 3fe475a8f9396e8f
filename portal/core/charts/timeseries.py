"""Time series as inline SVG with horizontal reference lines (the SLA, the benchmark's operating point): the
deployment page's production latency and the node page's GPU health. No JavaScript, no network assets."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass

from django.utils.safestring import SafeString

from .format import escape, safe_svg, short_number, within_scale, y_ticks

# Two clearly different colours: P95 (the SLA's percentile) orange and heavier, P50 blue.
DEFAULT_COLORS = ("#d9480f", "#1f6feb")
SERIES_WIDTHS = ("2", "1.6")
SLA_STYLE = 'stroke="#cf222e" stroke-width="1.4" stroke-dasharray="6 4"'
BENCH_STYLE = 'stroke="#1a7f37" stroke-width="1.4" stroke-dasharray="2 3"'
# Tick spacings for the time axis, shortest first; the first giving at most MAX_X_TICKS is used.
X_STEPS = [dt.timedelta(minutes=m) for m in (5, 10, 15, 30, 60, 120, 180, 360, 720, 1440, 2880)]
MAX_X_TICKS = 8


@dataclass(frozen=True)
class Line:
    """A horizontal reference line: `kind` is "sla" or "benchmark"."""

    value: float
    label: str
    kind: str


def time_ticks(start: dt.datetime, end: dt.datetime) -> list[tuple[dt.datetime, str]]:
    """Round times across [start, end], labelled with the date where a day starts (or always, for
    steps of a day or more) and with the time of day otherwise."""
    span = end - start
    step = next((s for s in X_STEPS if span / s <= MAX_X_TICKS), X_STEPS[-1])
    epoch = dt.datetime(2000, 1, 1, tzinfo=start.tzinfo or dt.UTC)
    first = epoch + step * math.ceil((start - epoch) / step)
    ticks = []
    at = first
    while at <= end:
        if step >= dt.timedelta(days=1):
            label = at.strftime("%a %d %b")
        elif at == first or (at.hour, at.minute) == (0, 0):
            label = at.strftime("%d %b %H:%M")
        else:
            label = at.strftime("%H:%M")
        ticks.append((at, label))
        at += step
    return ticks


def time_series_svg(
    times: list[dt.datetime],
    series: dict[str, list[float | None]],
    *,
    start: dt.datetime,
    end: dt.datetime,
    title: str,
    unit: str,
    lines: Sequence[Line] = (),
    width: int = 1100,
    height: int = 260,
    chart_id: str = "",
    colors: tuple[str, ...] = DEFAULT_COLORS,
) -> SafeString:
    """Each series as a polyline over [start, end] (None breaks the line), with `lines` across."""
    left, right, top, bottom = 64, 14, 24, 34
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [v for vs in series.values() for v in vs if v is not None]
    data_peak = max([*values, 0.0])
    # A line far above the data is drawn at the top edge and says so, rather than flattening the data.
    on_axis = [ln for ln in lines if within_scale(ln.value, data_peak)]
    ticks = y_ticks(max([data_peak, *(ln.value for ln in on_axis)]) * 1.05)
    peak = ticks[-1]
    span = (end - start).total_seconds() or 1.0

    def x(at: dt.datetime) -> float:
        return left + plot_w * (at - start).total_seconds() / span

    def y(value: float) -> float:
        return top + plot_h - plot_h * min(value, peak) / peak

    parts = [
        f'<svg class="chart latency-chart" id="{escape(chart_id)}" role="img" viewBox="0 0 {width} {height}" '
        f'width="100%" xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>',
        f'<text x="{left}" y="14" class="chart-title">{escape(title)}</text>',
    ]
    for i, value in enumerate(ticks):
        parts.append(
            f'<line x1="{left}" y1="{y(value):.1f}" x2="{width - right}" y2="{y(value):.1f}" '
            f'class="{"chart-axis" if i == 0 else "chart-grid"}"/>'
            f'<text x="{left - 4}" y="{y(value) + 4:.1f}" text-anchor="end" class="chart-label y-tick">'
            f"{short_number(value)}{' ' + escape(unit) if unit and i == len(ticks) - 1 else ''}</text>"
        )
    for at, label in time_ticks(start, end):
        parts.append(
            f'<line x1="{x(at):.1f}" y1="{top + plot_h}" x2="{x(at):.1f}" y2="{top + plot_h + 4}" '
            f'class="chart-axis"/><text x="{x(at):.1f}" y="{height - 12}" text-anchor="middle" '
            f'class="chart-label x-tick">{escape(label)}</text>'
        )
    parts.append(  # the zone once, left of the time labels
        f'<text x="4" y="{height - 12}" class="chart-label">UTC</text>'
    )
    legend_x = width // 2
    for n, (label, vs) in enumerate(series.items()):
        color = colors[n % len(colors)]
        style = f'stroke="{color}" stroke-width="{SERIES_WIDTHS[min(n, len(SERIES_WIDTHS) - 1)]}"'
        segments: list[list[str]] = [[]]
        for at, v in zip(times, vs, strict=True):
            if v is None:
                segments.append([])
            else:
                segments[-1].append(f"{x(at):.1f},{y(v):.1f}")
        for segment in segments:
            if len(segment) == 1:  # a lone point still shows
                cx, cy = segment[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.2" fill="{color}" class="series"/>')
            elif segment:
                parts.append(
                    f'<polyline class="series" data-series="{escape(label)}" fill="none" {style} '
                    f'points="{" ".join(segment)}"/>'
                )
        parts.append(
            f'<line x1="{legend_x}" y1="10" x2="{legend_x + 18}" y2="10" {style} stroke-width="3"/>'
            f'<text x="{legend_x + 22}" y="14" class="chart-label legend">{escape(label)}</text>'
        )
        legend_x += 110
    for line in lines:
        style = SLA_STYLE if line.kind == "sla" else BENCH_STYLE
        above = line not in on_axis
        label = f"↑ {line.label}: above this scale" if above else line.label
        parts.append(
            f'<line class="ref-line {escape(line.kind)}-line{" off-scale" if above else ""}" '
            f'data-value="{line.value:g}" x1="{left}" '
            f'y1="{y(line.value):.1f}" x2="{width - right}" y2="{y(line.value):.1f}" {style}>'
            f"<title>{escape(line.label)}</title></line>"
            f'<text x="{width - right}" y="{y(line.value) + (12 if above else -3):.1f}" text-anchor="end" '
            f'class="chart-label">{escape(label)}</text>'
        )
    parts.append("</svg>")
    return safe_svg("".join(parts))
