"""A node acceptance's plots: measured vs the simulator's prediction (the SVG itself is drawn by
portal/core/charts/, shared with the run page and the planner's predict page)."""

from __future__ import annotations

from portal.core.charts import line_chart


def acceptance_plots(levels: list[dict]) -> list[str]:
    """A node acceptance: measured vs the simulator's prediction (and its calibrated fit) per level,
    for output tok/s and mean TPOT (`portal.benchmarks.acceptance.judging.compare` rows)."""
    if not levels:
        return []
    x = [str(row["concurrency"]) for row in levels]

    def col(which: str, key: str, scale: float = 1.0) -> list[float | None]:
        values = [(row.get(which) or {}).get(key) for row in levels]
        return [v * scale if v is not None else None for v in values]

    plots: list[str] = []
    for title, key, scale, unit in (
        ("Output throughput: measured vs predicted", "output_throughput", 1.0, "tokens/s"),
        ("Mean TPOT: measured vs predicted", "mean_tpot_ms", 1.0, "ms"),
    ):
        series = [("measured", col("measured", key, scale))]
        for which in ("predicted", "calibrated"):
            values = col(which, key, scale)
            if any(v is not None for v in values):
                series.append((which, values))
        plots.append(
            line_chart(
                title=title, x_labels=x, series=series, y_label=unit, dashed={"predicted", "calibrated"}
            )
        )
    return plots
