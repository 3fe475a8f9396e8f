"""Bar charts as inline SVG (no JavaScript, no network assets): a team's usage against its quota,
the dashboard's traffic per minute."""

from __future__ import annotations

from django.utils.safestring import SafeString

from .format import escape, exact_number, safe_svg, short_number


def bar_chart_svg(
    points: list[tuple[str, float]],
    *,
    title: str,
    limit: float | None = None,
    limit_label: str = "quota",
    width: int = 720,
    height: int = 200,
    label_every: int = 1,
) -> SafeString:
    """Bars for (label, value) points; an optional dashed line at `limit` (e.g. a daily quota)."""
    left, right, top, bottom = 48, 8, 22, 28
    plot_w, plot_h = width - left - right, height - top - bottom
    peak = max([v for _, v in points] + [limit or 0, 1])
    step = plot_w / max(len(points), 1)
    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" width="100%" '
        f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>',
        f'<text x="{left}" y="14" class="chart-title">{escape(title)}</text>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{width - right}" y2="{top + plot_h}" '
        'class="chart-axis"/>',
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end" class="chart-label">'
        f"{short_number(peak)}</text>",
        f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end" class="chart-label">0</text>',
    ]
    for i, (label, value) in enumerate(points):
        h = plot_h * value / peak
        x = left + i * step
        parts.append(
            f'<rect x="{x + step * 0.1:.1f}" y="{top + plot_h - h:.1f}" width="{step * 0.8:.1f}" '
            f'height="{h:.1f}" class="chart-bar"><title>{escape(label)}: {exact_number(value)}</title></rect>'
        )
        if i % label_every == 0:
            parts.append(
                f'<text x="{x + step / 2:.1f}" y="{height - 10}" text-anchor="middle" class="chart-label">'
                f"{escape(label)}</text>"
            )
    if limit:
        y = top + plot_h - plot_h * limit / peak
        parts.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" class="chart-limit"/>'
            f'<text x="{width - right}" y="{y - 3:.1f}" text-anchor="end" class="chart-label">'
            f"{escape(limit_label)} {short_number(limit)}</text>"
        )
    parts.append("</svg>")
    return safe_svg("".join(parts))
