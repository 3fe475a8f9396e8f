"""Sparklines as inline SVG for the deployment page's recent engine samples (no chart library, no network)."""

from __future__ import annotations

from collections.abc import Sequence

from django.utils.safestring import SafeString

from .format import escape, safe_svg


def sparkline(
    values: Sequence[float | None], *, width: int = 240, height: int = 40, label: str = ""
) -> SafeString:
    """A polyline of the values, scaled to the box; gaps (None) break the line."""
    points = [(i, v) for i, v in enumerate(values) if v is not None]
    if len(points) < 2:
        return safe_svg('<span class="muted">not enough samples</span>')
    top = max(v for _, v in points)
    bottom = min(0.0, min(v for _, v in points))
    span = (top - bottom) or 1.0
    step = width / max(1, len(values) - 1)
    segments: list[list[str]] = []
    current: list[str] = []
    for i, value in enumerate(values):
        if value is None:
            if current:
                segments.append(current)
            current = []
            continue
        y = height - 2 - (value - bottom) / span * (height - 4)
        current.append(f"{i * step:.1f},{y:.1f}")
    if current:
        segments.append(current)
    lines = "".join(f'<polyline points="{" ".join(segment)}"/>' for segment in segments)
    return safe_svg(
        f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(label)}">{lines}</svg>'
    )


def rates(counters: Sequence[float | None], seconds: Sequence[float]) -> list[float | None]:
    """Per-second rates between consecutive counter samples (a reset reads as a gap)."""
    out: list[float | None] = [None]
    for i in range(1, len(counters)):
        a, b, dt = counters[i - 1], counters[i], seconds[i] - seconds[i - 1]
        out.append(None if a is None or b is None or b < a or dt <= 0 else (b - a) / dt)
    return out
