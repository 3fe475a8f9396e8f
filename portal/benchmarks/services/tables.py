"""Importing a benchmark table someone else measured (the V100 field guide's, a spreadsheet's, a
CSV): parsed with the standard `csv` module into levels under vLLM's key names, stored as a run."""

from __future__ import annotations

import csv
import re

from django.db import transaction
from django.utils import timezone

from inference.loadgen.sla import Sla, operating_point
from inference.loadgen.summary import little_law_from_table
from portal.core.errors import ApplicationError
from portal.deployments.models import Deployment

from ..models import BenchmarkLevel, BenchmarkRun, RunKind, RunState

# docs/v100-field-guide.md#reference-run: 7B/TP8 on 8×V100-32G with the 40/30/20/10 mix (one run).
FIELD_GUIDE_7B_TABLE = """\
| concurrency | output tok/s | mean TTFT s | P95 TTFT s | mean TPOT s | P95 TPOT s |
|---|---|---|---|---|---|
| 16 | 1380 | 0.45 | 0.82 | 0.042 | 0.065 |
| 32 | 2350 | 0.63 | 1.35 | 0.058 | 0.088 |
| 64 | 3560 | 1.05 | 2.10 | 0.076 | 0.120 |
| 128 | 4820 | 1.85 | 3.20 | 0.104 | 0.175 |
| 256 | 5630 | 3.40 | 6.50 | 0.155 | 0.310 |
"""

# Header words → (level key, multiplier to vLLM's unit). Seconds become ms.
_COLUMNS = (
    (("concurrency",), "concurrency", None),
    (("output", "tok"), "output_throughput", 1.0),
    (("req",), "request_throughput", 1.0),
    (("mean", "ttft"), "mean_ttft_ms", None),
    (("p95", "ttft"), "p95_ttft_ms", None),
    (("mean", "tpot"), "mean_tpot_ms", None),
    (("p95", "tpot"), "p95_tpot_ms", None),
    (("mean", "e2el"), "mean_e2el_ms", None),
    (("mean", "output", "tokens"), "mean_output_tokens", 1.0),
)


# The separators a pasted table may use, in the order they are tried on its header line: Markdown's
# pipes, a spreadsheet's tabs, CSV's commas. One per table, so a comma inside a cell is a cell's.
_DELIMITERS = ("|", "\t", ",")
# "1,380": a figure with thousands separators (quoted in a CSV, bare in a Markdown or TSV cell).
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")


def _delimiter(header: str) -> str:
    """The first separator found in the header line outside quoted cells (a comma when none is)."""
    unquoted = re.sub(r'"[^"]*"', "", header)
    return next((d for d in _DELIMITERS if d in unquoted), ",")


def _rows(text: str) -> list[list[str]]:
    """The table's rows of stripped cells, its Markdown separator line (`|---|:--:|`) left out."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return []
    delimiter = _delimiter(lines[0])
    if delimiter == "|":
        lines = [line.strip("|") for line in lines]  # a Markdown row's outer pipes open no cell
    reader = csv.reader(lines, delimiter=delimiter, skipinitialspace=True)
    rows = [[cell.strip() for cell in row] for row in reader]
    return [row for row in rows if not all(set(cell) <= set("-: ") for cell in row)]


def _number(cell: str) -> float:
    """A cell's figure: "≈"/"~" dropped, thousands separators too; ValueError when it is no number."""
    value = cell.replace("≈", "").replace("~", "").strip()
    if _THOUSANDS.fullmatch(value):
        value = value.replace(",", "")
    return float(value)


def parse_table(text: str) -> list[dict]:
    """A Markdown/CSV/TSV table of per-level figures → level dicts under vLLM's key names."""
    rows = _rows(text)
    if len(rows) < 2:
        raise ApplicationError("paste a header row and at least one level", field="table")
    header = [cell.lower() for cell in rows[0]]
    mapping: list[tuple[str, float] | None] = []
    for cell in header:
        found = None
        for words, key, factor in sorted(_COLUMNS, key=lambda c: -len(c[0])):
            if all(word in cell for word in words):
                if factor is None:
                    factor = 1000.0 if re.search(r"\bs\b|\(s\)|seconds", cell) else 1.0
                found = (key, factor)
                break
        mapping.append(found)
    if not any(m and m[0] == "concurrency" for m in mapping):
        raise ApplicationError("the header needs a concurrency column", field="table")
    levels = []
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise ApplicationError(
                f"row {number} has {len(row)} cells, the header {len(header)}", field="table"
            )
        level: dict = {"failed": None}
        for cell, target in zip(row, mapping, strict=True):
            if target is None or not cell:
                continue
            try:
                value = _number(cell)
            except ValueError as error:
                raise ApplicationError(f"row {number}: {cell!r} is not a number", field="table") from error
            key, factor = target
            level[key] = int(value) if key == "concurrency" else value * factor
        levels.append(level)
    return levels


def benchmark_import_table(
    *, user, title: str, text: str, deployment: Deployment | None = None, profile=None, mix: str = "imported"
) -> BenchmarkRun:
    """Staff: store an external table as a run, each level checked against Little's law."""
    if not user.is_staff:
        raise ApplicationError("only staff may import tables", field="table")
    levels = parse_table(text)
    with transaction.atomic():
        run = BenchmarkRun.objects.create(
            kind=RunKind.IMPORTED,
            title=title or "imported table",
            deployment=deployment,
            profile=profile or (deployment.profile if deployment else None),
            mix=mix,
            state=RunState.DONE,
            config={"source_table": text},
            created_by=user,
            started_at=timezone.now(),
            finished_at=timezone.now(),
            notes="Imported: only the columns of the table are known.",
        )
        for index, level in enumerate(levels):
            level["little_law"] = little_law_from_table(level)
            BenchmarkLevel.objects.create(
                run=run, index=index, concurrency=level.get("concurrency"), results=level
            )
        concurrency, why = operating_point(levels, Sla(run.sla_p95_ttft_s, run.sla_p95_tpot_s))
        run.sla_concurrency, run.sla_reason = concurrency, why
        run.save(update_fields=["sla_concurrency", "sla_reason"])
    return run
