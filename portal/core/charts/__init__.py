"""The portal's one home of inline SVG charts (no JavaScript, no network assets, no plotting library).

One module per kind of chart, all drawing numbers and text through `format`:
`timeseries` (a metric over time with reference lines), `levels` (a benchmark's levels: lines and a
histogram), `bars` (bar charts with a limit), `sparkline`. Import from here:
`from portal.core.charts import bar_chart_svg`.
"""

from .bars import bar_chart_svg
from .format import escape, exact_number, safe_svg, short_number, y_ticks
from .levels import histogram, line_chart, run_plots
from .sparkline import rates, sparkline
from .timeseries import Line, time_series_svg, time_ticks

__all__ = [
    "Line",
    "bar_chart_svg",
    "escape",
    "exact_number",
    "histogram",
    "line_chart",
    "rates",
    "run_plots",
    "safe_svg",
    "short_number",
    "sparkline",
    "time_series_svg",
    "time_ticks",
    "y_ticks",
]
