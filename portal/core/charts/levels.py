"""Plots of benchmark levels as inline SVG: measured runs (benchmarks), simulated sweeps (the
planner's predict page, in deployments) and a node acceptance draw the same plots.

Levels sit at evenly spaced x positions (16, 32, 64, … read better that way than
on a linear axis); SLA limits are dashed horizontal lines. The axes are scaled to
the data: a limit far above it (a 3 s SLA over 20 ms TTFTs) would flatten every
point onto zero, so it is drawn as an arrow at the plot's edge, labelled with its
value, instead of stretching the axis. Every label is escaped (`format.escape`).
"""

from __future__ import annotations

from django.utils.safestring import SafeString

from .format import escape, safe_svg, short_number, within_scale, y_ticks

WIDTH, HEIGHT = 560, 300
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 34, 46
COLORS = ("#2456a6", "#d2691e", "#1b7f3b", "#8a2be2")
SLA_COLOR = "#b3261e"


def _nice_max(value: float, *, whole: bool = False) -> float:
    return y_ticks(value, whole=whole)[-1]


def _frame(
    title: str, y_label: str, y_max: float, x_labels: list[str], x_title: str, *, whole: bool = False
) -> list[str]:
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" role="img" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
        f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="#fff"/>',
        f'<text x="{LEFT}" y="20" font-size="14" font-weight="600" fill="#1d2430">{escape(title)}</text>',
    ]
    for value in y_ticks(y_max, whole=whole):
        y = TOP + plot_h - plot_h * value / y_max
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e3e7ee"/>')
        parts.append(
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end" fill="#5b6577">'
            f"{short_number(value)}</text>"
        )
    for i, label in enumerate(x_labels):
        x = _x(i, len(x_labels))
        parts.append(
            f'<text x="{x:.1f}" y="{TOP + plot_h + 16}" font-size="11" text-anchor="middle" fill="#5b6577">'
            f"{escape(label)}</text>"
        )
    parts.append(
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 8}" font-size="12" text-anchor="middle" fill="#1d2430">'
        f"{escape(x_title)}</text>"
    )
    parts.append(
        f'<text x="14" y="{TOP + plot_h / 2}" font-size="12" text-anchor="middle" fill="#1d2430" '
        f'transform="rotate(-90 14 {TOP + plot_h / 2})">{escape(y_label)}</text>'
    )
    parts.append(
        f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{TOP + plot_h}" stroke="#5b6577"/>'
        f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{TOP + plot_h}" y2="{TOP + plot_h}" stroke="#5b6577"/>'
    )
    return parts


def _x(index: int, count: int) -> float:
    plot_w = WIDTH - LEFT - RIGHT
    if count == 1:
        return LEFT + plot_w / 2
    return LEFT + 24 + (plot_w - 48) * index / (count - 1)


def _y(value: float, y_max: float) -> float:
    plot_h = HEIGHT - TOP - BOTTOM
    return TOP + plot_h - plot_h * min(value, y_max) / y_max


def line_chart(
    *,
    title: str,
    x_labels: list[str],
    series: list[tuple[str, list[float | None]]],
    y_label: str,
    x_title: str = "concurrency",
    limits: list[tuple[str, float]] | None = None,
    dashed: set[str] | None = None,
) -> SafeString:
    """Lines over levels; None values leave a gap. `limits` are labelled dashed lines (SLA), or an
    arrow at the top edge when they lie far above the data (see the module's docstring)."""
    limits = limits or []
    data = [v for _, ys in series for v in ys if v is not None]
    data_max = max(data, default=0.0)
    on_scale = [(label, v) for label, v in limits if within_scale(v, data_max)]
    off_scale = [(label, v) for label, v in limits if not within_scale(v, data_max)]
    y_max = _nice_max(max([*data, *(v for _, v in on_scale)], default=1.0) * 1.08)
    parts = _frame(title, y_label, y_max, x_labels, x_title)
    for label, value in on_scale:
        y = _y(value, y_max)
        parts.append(
            f'<line class="sla" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
            f'stroke="{SLA_COLOR}" stroke-dasharray="6 4"/>'
            f'<text x="{WIDTH - RIGHT - 4}" y="{y - 4:.1f}" font-size="11" text-anchor="end" '
            f'fill="{SLA_COLOR}">{escape(label)}</text>'
        )
    for n, (label, _value) in enumerate(off_scale):
        # An upward arrow at the top right, under the legend: the limit is above everything shown.
        x, y = WIDTH - RIGHT - 8, TOP + 28 + 14 * n
        parts.append(
            f'<g class="sla off-scale"><path fill="{SLA_COLOR}" '
            f'd="M{x - 5:.1f},{y:.1f} L{x:.1f},{y - 9:.1f} L{x + 5:.1f},{y:.1f} Z"/>'
            f'<text x="{x - 9:.1f}" y="{y:.1f}" font-size="11" text-anchor="end" '
            f'fill="{SLA_COLOR}">{escape(label)}: above this scale</text></g>'
        )
    for n, (label, ys) in enumerate(series):
        color = COLORS[n % len(COLORS)]
        dash = ' stroke-dasharray="4 3"' if dashed and label in dashed else ""
        points = [(_x(i, len(ys)), _y(v, y_max)) for i, v in enumerate(ys) if v is not None]
        if len(points) > 1:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{path}"/>')
        for px, py in points:
            parts.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3.5" fill="{color}"/>')
        legend_x = LEFT + 8 + 150 * n
        parts.append(
            f'<rect x="{legend_x}" y="{TOP + 2}" width="10" height="10" fill="{color}"/>'
            f'<text x="{legend_x + 14}" y="{TOP + 11}" font-size="11" fill="#1d2430">{escape(label)}</text>'
        )
    parts.append("</svg>")
    return safe_svg("".join(parts))


def histogram(
    *, title: str, values: list[float], x_title: str, bins: int = 24, limit: tuple[str, float] | None = None
) -> SafeString:
    """A histogram of per-request values (the latency distribution of one level)."""
    if not values:
        return SafeString("")
    low, high = min(values), max(values)
    off_scale = limit is not None and limit[1] > high and not within_scale(limit[1], high)
    if limit and not off_scale:
        high = max(high, limit[1])
    if high <= low:
        high = low + max(abs(low) * 0.1, 1e-3)  # all alike: one narrow range, not one wide bar
    width = (high - low) / bins
    counts = [0] * bins
    for value in values:
        counts[min(bins - 1, int((value - low) / width))] += 1
    y_max = _nice_max(max(counts) * 1.08, whole=True)
    edges = [low + width * i for i in range(bins + 1)]
    labels = [short_number(edges[i]) if i % 4 == 0 else "" for i in range(bins)]
    parts = _frame(title, "requests", y_max, labels, x_title, whole=True)
    plot_w = WIDTH - LEFT - RIGHT
    bar_w = (plot_w - 48) / bins
    for i, count in enumerate(counts):
        if not count:
            continue
        x = LEFT + 24 + bar_w * i - bar_w / 2
        y = _y(count, y_max)
        parts.append(
            f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{bar_w - 1:.1f}" '
            f'height="{_y(0, y_max) - y:.1f}" '
            f'fill="#2456a6"><title>{short_number(edges[i])}–{short_number(edges[i + 1])}: {count}'
            "</title></rect>"
        )
    if limit and off_scale:
        label, value = limit
        x, y = WIDTH - RIGHT - 4, TOP + 28
        parts.append(
            f'<g class="sla off-scale"><path fill="{SLA_COLOR}" '
            f'd="M{x - 9:.1f},{y - 5:.1f} L{x:.1f},{y:.1f} L{x - 9:.1f},{y + 5:.1f} Z"/>'
            f'<text x="{x - 12:.1f}" y="{y + 4:.1f}" font-size="11" text-anchor="end" '
            f'fill="{SLA_COLOR}">{escape(label)}: right of this scale</text></g>'
        )
    elif limit:
        label, value = limit
        x = LEFT + 24 + (plot_w - 48) * (value - low) / (high - low) - bar_w / 2
        parts.append(
            f'<line class="sla" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{HEIGHT - BOTTOM}" stroke="#b3261e" '
            f'stroke-dasharray="6 4"/><text x="{x - 4:.1f}" y="{TOP + 12}" font-size="11" text-anchor="end" '
            f'fill="#b3261e">{escape(label)}</text>'
        )
    parts.append("</svg>")
    return safe_svg("".join(parts))


def run_plots(levels: list[dict], *, sla_ttft_s: float, sla_tpot_s: float) -> list[SafeString]:
    """Throughput vs concurrency; P50/P95 TTFT and TPOT vs concurrency with the SLA lines."""
    closed = [lv for lv in levels if lv.get("concurrency") is not None]
    if not closed:
        return []
    x = [str(lv["concurrency"]) for lv in closed]

    def col(key: str, scale: float = 1.0) -> list[float | None]:
        return [lv[key] * scale if lv.get(key) is not None else None for lv in closed]

    plots = [
        line_chart(
            title="Output throughput vs concurrency",
            x_labels=x,
            series=[("output tok/s", col("output_throughput"))],
            y_label="tokens/s",
        )
    ]

    def middle(metric: str) -> tuple[str, list[float | None]]:
        """P50, or the mean where only means are known (an imported table)."""
        median = col(f"median_{metric}_ms", 1 / 1000)
        if any(v is not None for v in median):
            return f"P50 {metric.upper()}", median
        return f"mean {metric.upper()}", col(f"mean_{metric}_ms", 1 / 1000)

    ttft = [middle("ttft"), ("P95 TTFT", col("p95_ttft_ms", 1 / 1000))]
    if any(v is not None for _, ys in ttft for v in ys):
        plots.append(
            line_chart(
                title="TTFT vs concurrency",
                x_labels=x,
                series=ttft,
                y_label="seconds",
                limits=[(f"SLA P95 TTFT {sla_ttft_s:g} s", sla_ttft_s)],
                dashed={ttft[0][0]},
            )
        )
    tpot = [middle("tpot"), ("P95 TPOT", col("p95_tpot_ms", 1 / 1000))]
    if any(v is not None for _, ys in tpot for v in ys):
        plots.append(
            line_chart(
                title="TPOT vs concurrency",
                x_labels=x,
                series=tpot,
                y_label="seconds",
                limits=[(f"SLA P95 TPOT {sla_tpot_s:g} s", sla_tpot_s)],
                dashed={tpot[0][0]},
            )
        )
    return plots
