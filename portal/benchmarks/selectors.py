"""Reads of benchmark runs, scoped to what a user may see, and their exports and comparisons.

A run tied to a deployment is visible to whoever sees the deployment; a run of
a bare endpoint (or an imported table with no deployment) to staff and its
creator.
"""

from __future__ import annotations

import csv
import io
import re

from django.db.models import Q, QuerySet
from django.shortcuts import get_object_or_404

from portal.deployments.selectors import deployments_visible_to
from portal.inventory.models import Node

from .models import BenchmarkLevel, BenchmarkRun

# (label, level key, better: "up" | "down" | None, format) for tables, CSV and comparisons.
LEVEL_COLUMNS = (
    ("concurrency", "concurrency", None, "{:g}"),
    ("completed", "completed", None, "{:g}"),
    ("failed", "failed", "down", "{:g}"),
    ("output tok/s", "output_throughput", "up", "{:.1f}"),
    ("total tok/s", "total_token_throughput", "up", "{:.1f}"),
    ("req/s", "request_throughput", "up", "{:.2f}"),
    ("goodput req/s", "request_goodput", "up", "{:.2f}"),
    ("mean TTFT ms", "mean_ttft_ms", "down", "{:.1f}"),
    ("P50 TTFT ms", "median_ttft_ms", "down", "{:.1f}"),
    ("P95 TTFT ms", "p95_ttft_ms", "down", "{:.1f}"),
    ("P99 TTFT ms", "p99_ttft_ms", "down", "{:.1f}"),
    ("mean TPOT ms", "mean_tpot_ms", "down", "{:.2f}"),
    ("P50 TPOT ms", "median_tpot_ms", "down", "{:.2f}"),
    ("P95 TPOT ms", "p95_tpot_ms", "down", "{:.2f}"),
    ("mean ITL ms", "mean_itl_ms", "down", "{:.2f}"),
    ("P95 ITL ms", "p95_itl_ms", "down", "{:.2f}"),
    ("mean E2EL ms", "mean_e2el_ms", "down", "{:.1f}"),
    ("P95 E2EL ms", "p95_e2el_ms", "down", "{:.1f}"),
    ("preemptions", "preemptions", "down", "{:g}"),
    ("peak KV cache", "kv_cache_peak", None, "{:.0%}"),
    ("peak waiting", "waiting_peak", "down", "{:g}"),
)
CSV_KEYS = (
    "concurrency",
    "request_rate",
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "request_goodput",
    *(
        f"{stat}_{m}_ms"
        for m in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "median", "std", "p90", "p95", "p99")
    ),
    "preemptions",
    "kv_cache_peak",
    "waiting_peak",
    "running_peak",
    "client_cpu_share",
    "loop_lag_p95_ms",
    "client_bound",
    "partial",
    "partial_reason",
)


# --- Where engines live: for staff only (docs/decisions.md, "Benchmark runs keep engines' addresses
# to staff"). A run's texts quote the load generator's errors, which name the server it reached.
SERVER = "<server>"
PATH = "<path>"
_URL = re.compile(r"\b(?:https?|wss?)://[^\s'\"<>]*[^\s'\"<>:,.;)]")
# host:port where the host is an IP address, localhost or a dotted name: what aiohttp's errors
# print ("Cannot connect to host 10.0.0.7:8001"); "fixed:16:8" (a mix) has no such host.
_HOST_PORT = re.compile(
    r"(?<![\w.-])(?:\[[0-9A-Fa-f:.]+\]|\d{1,3}(?:\.\d{1,3}){3}|localhost|"
    r"[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z][A-Za-z0-9-]*):\d{1,5}\b"
)
# An IPv4 address on its own (a node's, in a message without a port).
_IPV4 = re.compile(r"(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?![\w.])")
# An absolute path of two parts or more (a tokenizer, a model directory, a log), not "tok/s".
_PATH = re.compile(r"(?<![\w.<>/~-])/(?:[^\s/'\"<>:,;()\[\]]+/)+[^\s/'\"<>:,;()\[\]]*")


def _hostnames() -> list[str]:
    """Node hostnames that are not also their (public) names, longest first."""
    names = {h for h, n in Node.objects.exclude(hostname="").values_list("hostname", "name") if h != n}
    return sorted(names, key=len, reverse=True)


def redact_text(text: str, hostnames: list[str] | None = None) -> str:
    """`text` with server URLs, host:port pairs, node hostnames and absolute paths blanked out."""
    if not text:
        return text
    text = _URL.sub(SERVER, text)
    text = _HOST_PORT.sub(SERVER, text)
    text = _IPV4.sub(SERVER, text)
    for hostname in hostnames if hostnames is not None else _hostnames():
        text = re.sub(rf"(?<![\w.-]){re.escape(hostname)}(?![\w-])", "<node>", text)
    return _PATH.sub(PATH, text)


def redact_data(value, hostnames: list[str] | None = None):
    """`redact_text` through JSON-shaped data: every string, dictionary keys included (a level's
    `errors` are keyed by the error's text)."""
    hostnames = hostnames if hostnames is not None else _hostnames()
    if isinstance(value, str):
        return redact_text(value, hostnames)
    if isinstance(value, dict):
        out: dict = {}
        for key, item in value.items():
            key, item = redact_text(str(key), hostnames), redact_data(item, hostnames)
            both_counts = isinstance(out.get(key), int) and isinstance(item, int)
            out[key] = out[key] + item if both_counts else item  # two servers' errors become one text
        return out
    if isinstance(value, list | tuple):
        return [redact_data(v, hostnames) for v in value]
    return value


def run_shown_to(user, run: BenchmarkRun, levels: list[BenchmarkLevel] | None = None) -> BenchmarkRun:
    """`run` (and `levels`, its levels) as `user` may read them, changed in memory only, never
    saved: for anyone but staff, the endpoint is blank and where engines listen (URLs, host:port,
    node hostnames) and server paths are blanked out of every text the run and its levels carry,
    as the deployment pages do for a deployment's own texts."""
    if not user.is_staff:
        _redact_run(run, levels or [])
    return run


def _redact_run(run: BenchmarkRun, levels: list[BenchmarkLevel]) -> None:
    hostnames = _hostnames()
    run.endpoint_url = ""
    for name in ("state_reason", "prompt_source", "sla_reason", "notes", "title"):
        setattr(run, name, redact_text(getattr(run, name), hostnames))
    run.config = redact_data(run.config, hostnames)
    run.snapshot = redact_data(run.snapshot, hostnames)
    for level in levels:
        level.results = redact_data(level.results, hostnames)


def runs_visible_to(user) -> QuerySet[BenchmarkRun]:
    runs = BenchmarkRun.objects.select_related("deployment", "profile", "created_by")
    if user.is_staff:
        return runs
    return runs.filter(
        Q(deployment__in=deployments_visible_to(user)) | Q(deployment__isnull=True, created_by=user)
    ).distinct()


def run_get_for_user(user, run_id: int) -> BenchmarkRun:
    return get_object_or_404(runs_visible_to(user), pk=run_id)


def run_levels(run: BenchmarkRun) -> list[dict]:
    return [level.results for level in run.levels.all()]


def run_export(run: BenchmarkRun, *, staff: bool = True) -> dict:
    """The run as JSON: metadata, snapshot and one object per level under vLLM's key names.

    Where the server listened (`endpoint_url`, and in any text) is for staff only (docs/decisions.md).
    """
    levels = list(run.levels.all())
    if not staff:
        _redact_run(run, levels)
    exported = {
        "run": {
            "id": run.pk,
            "kind": run.kind,
            "title": run.title,
            "state": run.state,
            "state_reason": run.state_reason,
            "notes": run.notes,
            "deployment": run.target_name,
            "endpoint_url": run.endpoint_url,
            "model": run.model_name,
            "mix": run.mix,
            "mix_definition": run.mix_definition,
            "config": run.config,
            "snapshot": run.snapshot,
            "prompt_source": run.prompt_source,
            "prompt_tokens_exact": run.prompt_tokens_exact,
            "sla": {"p95_ttft_s": run.sla_p95_ttft_s, "p95_tpot_s": run.sla_p95_tpot_s},
            "created_at": run.created_at.isoformat(),
            "finished_at": run.finished_at.isoformat() if run.finished_at else None,
        },
        "levels": [level.results for level in levels],
        "sla_concurrency": run.sla_concurrency,
        "sla_reason": run.sla_reason,
    }
    return exported


def run_export_csv(run: BenchmarkRun, *, staff: bool = True) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([*CSV_KEYS, "little_law_ok", "little_law_ratio", "roofline_share"])
    levels = run_levels(run)
    for level in levels if staff else redact_data(levels):
        little = level.get("little_law") or {}
        roofline = level.get("roofline") or {}
        writer.writerow(
            [level.get(key, "") if level.get(key) is not None else "" for key in CSV_KEYS]
            + [little.get("ok", ""), little.get("ratio", ""), roofline.get("share", "")]
        )
    return out.getvalue()


def _fmt(value, fmt: str) -> str:
    if value is None:
        return "—"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def level_rows(levels: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Display rows for a run's table: only columns some level has."""
    columns = [c for c in LEVEL_COLUMNS if any(level.get(c[1]) is not None for level in levels)]
    rows = [[_fmt(level.get(key), fmt) for _, key, _, fmt in columns] for level in levels]
    return [label for label, *_ in columns], rows


def _flatten(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def compare_runs(a: BenchmarkRun, b: BenchmarkRun, *, threshold: float = 0.05, staff: bool = True) -> dict:
    """Two runs side by side, levels matched by concurrency (or rate), with deltas b − a.

    A change beyond `threshold` (5 %) is marked better or worse by the metric's direction, but only
    when both runs sent the same workload: across two mixes a delta measures the mix, not the server,
    so the page shows the numbers unmarked under a warning (`workload_differs`).
    """
    workload_differs = a.mix != b.mix or (a.mix_definition or {}) != (b.mix_definition or {})
    levels_a = {(lv.get("concurrency"), lv.get("request_rate")): lv for lv in run_levels(a)}
    levels_b = {(lv.get("concurrency"), lv.get("request_rate")): lv for lv in run_levels(b)}
    keys = sorted(set(levels_a) | set(levels_b), key=lambda k: (k[0] is None, k[0] or 0, k[1] or 0))
    rows = []
    for key in keys:
        la, lb = levels_a.get(key, {}), levels_b.get(key, {})
        cells = []
        for label, metric, better, fmt in LEVEL_COLUMNS[3:]:
            va, vb = la.get(metric), lb.get(metric)
            if va is None and vb is None:
                continue
            delta, mark = None, ""
            if isinstance(va, int | float) and isinstance(vb, int | float) and va:
                delta = (vb - va) / abs(va)
                if better and abs(delta) > threshold and not workload_differs:
                    mark = "better" if (delta > 0) == (better == "up") else "worse"
            cells.append(
                {
                    "label": label,
                    "a": _fmt(va, fmt),
                    "b": _fmt(vb, fmt),
                    "delta": f"{delta * 100:+.1f} %" if delta is not None else "",
                    "mark": mark,
                }
            )
        concurrency = key[0] if key[0] is not None else f"rate {key[1]:g}/s"
        rows.append({"level": concurrency, "only": "a" if not lb else "b" if not la else "", "cells": cells})
    snap_a, snap_b = _flatten(a.snapshot), _flatten(b.snapshot)
    if not staff:
        snap_a, snap_b = redact_data(snap_a), redact_data(snap_b)
    changed = [
        {"key": key, "a": snap_a.get(key), "b": snap_b.get(key)}
        for key in sorted(set(snap_a) | set(snap_b))
        if snap_a.get(key) != snap_b.get(key) and not key.startswith("roofline")
    ]
    for name in ("mix", "model_name", "endpoint_url") if staff else ("mix", "model_name"):
        if getattr(a, name) != getattr(b, name):
            changed.append({"key": name, "a": getattr(a, name), "b": getattr(b, name)})
    return {"rows": rows, "changed": changed, "workload_differs": workload_differs}
