"""Time series as inline SVG with horizontal reference lines (the SLA, the benchmark's operating point): the
deployment page's production latency and the node page's GPU health. No JavaScript, no network assets."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

# Presentation attributes inline, so the chart reads the same wherever it is embedded.
SERIES_STYLES = ('stroke="#1f6feb" stroke-width="1.6"', 'stroke="#8c959f" stroke-width="1.2"')
SLA_STYLE = 'stroke="#cf222e" stroke-width="1.4" stroke-dasharray="6 4"'
BENCH_STYLE = 'stroke="#1a7f37" stroke-width="1.4" stroke-dasharray="2 3"'


@dataclass(frozen=True)
class Line:
    """A horizontal reference line: `kind` is "sla" or "benchmark"."""

    value: float
    label: str
    kind: str


def _number(value: float) -> str:
    return f"{value:.3g}"


def time_series_svg(
    times: list[dt.datetime],
    series: dict[str, list[float | None]],
    *,
    start: dt.datetime,
    end: dt.datetime,
    title: str,
    unit: str,
    lines: list[Line] = (),
    width: int = 720,
    height: int = 220,
    chart_id: str = "",
) -> SafeString:
    """Each series as a polyline over [start, end] (None breaks the line), with `lines` across."""
    left, right, top, bottom = 52, 12, 24, 30
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [v for vs in series.values() for v in vs if v is not None]
    peak = max([*values, *(line.value for line in lines), 0.0]) * 1.1 or 1.0
    span = (end - start).total_seconds() or 1.0

    def x(at: dt.datetime) -> float:
        return left + plot_w * (at - start).total_seconds() / span

    def y(value: float) -> float:
        return top + plot_h - plot_h * value / peak

    parts = [
        f'<svg class="chart latency-chart" id="{escape(chart_id)}" role="img" viewBox="0 0 {width} {height}" '
        f'width="100%" xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>',
        f'<text x="{left}" y="14" class="chart-title">{escape(title)}</text>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{width - right}" y2="{top + plot_h}" '
        'class="chart-axis"/>',
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end" class="chart-label">'
        f"{_number(peak)} {escape(unit)}</text>",
        f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end" class="chart-label">0</text>',
    ]
    fmt = "%H:%M" if span <= 86400 else "%m-%d %H:%M"
    for at, anchor in ((start, "start"), (start + (end - start) / 2, "middle"), (end, "end")):
        parts.append(
            f'<text x="{x(at):.1f}" y="{height - 10}" text-anchor="{anchor}" class="chart-label">'
            f"{at.strftime(fmt)}</text>"
        )
    legend_x = width // 2
    for (label, vs), style in zip(series.items(), SERIES_STYLES, strict=False):
        segments: list[list[str]] = [[]]
        for at, value in zip(times, vs, strict=True):
            if value is None:
                segments.append([])
            else:
                segments[-1].append(f"{x(at):.1f},{y(value):.1f}")
        for segment in segments:
            if len(segment) == 1:  # a lone point still shows
                cx, cy = segment[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="1.8" fill="#1f6feb" class="series"/>')
            elif segment:
                parts.append(
                    f'<polyline class="series" data-series="{escape(label)}" fill="none" {style} '
                    f'points="{" ".join(segment)}"/>'
                )
        parts.append(
            f'<line x1="{legend_x}" y1="10" x2="{legend_x + 16}" y2="10" {style}/>'
            f'<text x="{legend_x + 20}" y="14" class="chart-label">{escape(label)}</text>'
        )
        legend_x += 90
    for line in lines:
        style = SLA_STYLE if line.kind == "sla" else BENCH_STYLE
        parts.append(
            f'<line class="ref-line {escape(line.kind)}-line" data-value="{line.value:g}" x1="{left}" '
            f'y1="{y(line.value):.1f}" x2="{width - right}" y2="{y(line.value):.1f}" {style}>'
            f"<title>{escape(line.label)}</title></line>"
            f'<text x="{width - right}" y="{y(line.value) - 3:.1f}" text-anchor="end" class="chart-label">'
            f"{escape(line.label)}</text>"
        )
    parts.append("</svg>")
    return mark_safe("".join(parts))  # noqa: S308 (every interpolated text is escaped above)
