"""What every chart here shares: one way to write a number on a chart, one way to escape text, round
axis ticks and the rule for a reference line far above the data.

Labels come from users (team names, model names, deployment names), so every text drawn goes through
`escape`; numbers go through `short_number` (axes), `exact_number` (a value in full, in a tooltip)
or Python's own `:g` for machine-read attributes. Only then is the markup marked safe (`safe_svg`).
"""

from __future__ import annotations

import html
import math

from django.utils.safestring import SafeString, mark_safe

# The y axis gets about this many intervals, each a round step (1, 2, 2.5 or 5 × 10^n).
Y_INTERVALS = 4
# A reference line (an SLA, a quota) up to this many times the data's peak joins the scale, so the data
# keeps at least 1/OFF_SCALE_RATIO of the height; one further out is marked at the edge instead.
OFF_SCALE_RATIO = 4.0
# Thousands and up read with a suffix; a value just under a threshold that would round up to it
# (999,600) takes the larger unit ("1M", not "1000k").
_SI_UNITS = (("G", 1e9), ("M", 1e6), ("k", 1e3))
_ROUNDS_UP = 0.9995


def escape(text: object) -> str:
    """Text for SVG markup or an attribute: & < > " ' escaped, always (even text already marked safe)."""
    return html.escape(str(text), quote=True)


def safe_svg(svg: str) -> SafeString:
    """For templates: markup built by this package, every label escaped and every number formatted."""
    return mark_safe(svg)  # noqa: S308 (only markup built here, with every text escaped, comes through)


def short_number(value: float) -> str:
    """An axis label: three significant figures at most, two below 1, with k/M/G from a thousand up
    (0.06, 0.25, 2.5, 12.5, 250, 1k, 1.5k, 294k, 80M)."""
    unit, size = next(((u, s) for u, s in _SI_UNITS if abs(value) >= s * _ROUNDS_UP), ("", 1.0))
    scaled = value / size
    if abs(scaled) >= 100:
        text = f"{scaled:.0f}"
    elif abs(scaled) >= 1:
        text = f"{scaled:.3g}"
    else:
        text = f"{scaled:.2g}"
    return text + unit


def exact_number(value: float) -> str:
    """A value in full, with thousands separators (293,822; 0.25)."""
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"


def y_ticks(value: float, *, whole: bool = False) -> list[float]:
    """Round ticks from 0 to at least `value`: about Y_INTERVALS steps of 1, 2, 2.5 or 5 × 10^n
    (0, 500, 1000, … rather than 0, 625, 1250, …); `whole`: counts, so whole-number steps."""
    if whole:
        value = max(value, Y_INTERVALS)
    if value <= 0:
        return [0.0, 0.25, 0.5, 0.75, 1.0]
    raw = value / Y_INTERVALS
    exponent = 10 ** math.floor(math.log10(raw))
    steps = (1, 2, 5, 10) if whole and exponent >= 1 else (1, 2, 2.5, 5, 10)
    step = next(s * exponent for s in steps if raw <= s * exponent * (1 + 1e-9))
    count = math.ceil(value / step - 1e-9)
    return [round(step * i, 12) for i in range(count + 1)]


def within_scale(limit: float, data_peak: float) -> bool:
    """Whether a reference line at `limit` joins the axis (see OFF_SCALE_RATIO)."""
    return data_peak <= 0 or limit <= data_peak * OFF_SCALE_RATIO
