"""Judging a node acceptance (pure): per level, measured vs predicted vs calibrated, and the
verdict: `slow` when any level misses the prediction by more than the margin (docs/decisions.md,
"Node acceptance")."""

from __future__ import annotations

from portal.inventory.models import AcceptanceState

# The figures compared per level: (key in a bench level, label, True when higher is better).
COMPARED = (
    ("output_throughput", "output tok/s", True),
    ("mean_tpot_ms", "mean TPOT ms", False),
)
KEPT = ("output_throughput", "mean_tpot_ms", "median_ttft_ms", "mean_ttft_ms", "completed", "failed")


def _pick(level: dict | None) -> dict | None:
    if level is None:
        return None
    return {key: level.get(key) for key in KEPT}


def compare(
    measured: list[dict],
    predicted: list[dict] | None,
    calibrated: list[dict] | None,
    *,
    fit_levels: list[int] | None = None,
) -> list[dict]:
    """Per measured level: the measured, predicted and calibrated figures, measured ÷ predicted,
    and whether the calibration was fitted on it (`fitted`)."""

    def by_level(levels):
        return {lv["concurrency"]: lv for lv in levels or []}

    predicted_at, calibrated_at = by_level(predicted), by_level(calibrated)
    rows = []
    for level in measured:
        c = level["concurrency"]
        row = {
            "concurrency": c,
            "measured": _pick(level),
            "predicted": _pick(predicted_at.get(c)),
            "calibrated": _pick(calibrated_at.get(c)),
            "fitted": c in (fit_levels or ()),
        }
        for key, _, _ in COMPARED:
            expected = (row["predicted"] or {}).get(key)
            got = row["measured"].get(key)
            row[f"{key}_ratio"] = got / expected if got is not None and expected else None
        rows.append(row)
    return rows


def judge(levels: list[dict], *, margin: float) -> tuple[str, str]:
    """(`passed` or `slow`, why): slow when at any level output tok/s is below the prediction, or
    mean TPOT above it, by more than `margin` (a fraction)."""
    if not any(row.get("predicted") for row in levels):
        return AcceptanceState.PASSED, "measured only: no prediction to compare with"
    misses = []
    for row in levels:
        for key, label, higher_is_better in COMPARED:
            ratio = row.get(f"{key}_ratio")
            if ratio is None:
                continue
            slow = ratio < 1 - margin if higher_is_better else ratio > 1 + margin
            if slow:
                misses.append(
                    f"{row['concurrency']} users: {label} {row['measured'][key]:.1f} measured vs "
                    f"{row['predicted'][key]:.1f} predicted ({(ratio - 1) * 100:+.0f} %)"
                )
    if misses:
        return AcceptanceState.SLOW, f"slower than predicted by more than {margin:.0%}: " + "; ".join(misses)
    worst = min(
        (row["output_throughput_ratio"] for row in levels if row.get("output_throughput_ratio") is not None),
        default=None,
    )
    within = f" (output tok/s at {worst:.0%} of the prediction or better)" if worst is not None else ""
    return AcceptanceState.PASSED, f"within {margin:.0%} of the prediction at every level{within}"
