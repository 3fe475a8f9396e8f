"""The benchmark from a shell: `python manage.py bench …` (and `python -m inference.loadgen.cli …`).

Prints the per-level table and the SLA operating point; `--json out.json` writes
{"levels": [...], "sla_concurrency": N, ...} with vLLM's result key names.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from inference.errors import InputError
from inference.loadgen.loadgen import BenchConfig, LevelPlan, run_blocking, run_sweep
from inference.loadgen.sla import Sla, operating_point
from inference.loadgen.summary import format_table
from inference.loadgen.workloads import load_mix


class _Out(Protocol):
    """sys.stdout, or a management command's OutputWrapper."""

    def write(self, text: str, /) -> object: ...


def _list(text: str | None, kind: Callable[[str], Any], flag: str) -> list[Any]:
    if not text:
        return []
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise InputError(flag, f"write {flag} as a comma-separated list, e.g. 16,32") from error


def _say(out: _Out, text: str) -> None:
    # Django's OutputWrapper adds a newline unless the text ends with one; print() would double it.
    out.write(text + "\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", required=True, help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)"
    )
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--concurrency", default="", help="closed-loop levels, e.g. 16,32,64")
    parser.add_argument("--request-rate", default="", help="open-loop Poisson levels in requests/s, e.g. 2,4")
    parser.add_argument("--requests-per-level", type=int, default=None, help="measured requests per level")
    parser.add_argument("--duration", type=float, default=None, help="or: seconds per level")
    parser.add_argument(
        "--warmup", type=int, default=None, help="warm-up requests per level (default: one per user)"
    )
    parser.add_argument("--mix", default="field-mix", help="preset, fixed:<in>:<out>, or a mix JSON file")
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer.json (or its directory) for exact prompt lengths"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--level-timeout", type=float, default=None, help="seconds before a level is cut (partial)"
    )
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--sla-ttft", type=float, default=3.0, help="SLA P95 TTFT, seconds")
    parser.add_argument("--sla-tpot", type=float, default=0.2, help="SLA P95 TPOT, seconds")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", dest="json_path", default=None, help="write the results here")
    parser.add_argument("--samples", action="store_true", help="keep per-request samples in the JSON")


def run(options: dict[str, Any], out: _Out = sys.stdout) -> dict[str, Any]:
    """Run the sweep described by parsed options; raises InputError for bad input."""
    concurrencies = _list(options["concurrency"], int, "concurrency")
    rates = _list(options["request_rate"], float, "request_rate")
    requests = options["requests_per_level"]
    if requests is None and options["duration"] is None:
        requests = 64
    plans = [
        LevelPlan(concurrency=c, requests=requests, duration_s=options["duration"], warmup=options["warmup"])
        for c in concurrencies
    ] + [
        LevelPlan(request_rate=r, requests=requests, duration_s=options["duration"], warmup=options["warmup"])
        for r in rates
    ]
    if not plans:
        raise InputError("concurrency", "give --concurrency (e.g. 16,32) and/or --request-rate")
    sla = Sla(options["sla_ttft"], options["sla_tpot"])
    config = BenchConfig(
        base_url=options["url"],
        model=options["model"],
        mix=load_mix(options["mix"], allow_files=True),
        levels=plans,
        seed=options["seed"],
        tokenizer=options["tokenizer"],
        level_timeout_s=options["level_timeout"],
        request_timeout_s=options["request_timeout"],
        slo={"ttft": sla.p95_ttft_s * 1000, "tpot": sla.p95_tpot_s * 1000},
        api_key=options["api_key"],
    )
    result = run_blocking(run_sweep(config))
    if not options.get("samples"):
        for level in result.levels:
            level.pop("samples", None)
    concurrency, why = operating_point(result.levels, sla)
    _say(out, format_table(result.levels))
    _say(out, f"\nprompts: {result.prompt_source}")
    _say(out, f"SLA ({sla.describe()}): {why}")
    for level in result.levels:
        little = level["little_law"]
        if little.get("ok") is False:
            _say(out, f"level {level['concurrency']}: {little['note']}")
        if level.get("client_bound"):
            _say(out, f"level {level['concurrency']}: client-bound ({level['client_bound_reason']})")
        elif level.get("host_note"):
            _say(out, f"level {level['concurrency']}: busy host: {level['host_note']}")
        for reason, count in level["errors"].items():
            _say(out, f"level {level['concurrency']}: {count} failed: {reason}")
    if result.error:
        _say(out, f"stopped early: {result.error}")
    report = {
        "url": options["url"],
        "model": options["model"],
        "mix": options["mix"],
        "prompt_source": result.prompt_source,
        "prompt_tokens_exact": result.prompt_tokens_exact,
        "levels": result.levels,
        "sla": {"p95_ttft_s": sla.p95_ttft_s, "p95_tpot_s": sla.p95_tpot_s},
        "sla_concurrency": concurrency,
        "sla_reason": why,
        "error": result.error,
    }
    if options.get("json_path"):
        Path(options["json_path"]).write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    options = vars(parser.parse_args(argv))
    try:
        run(options)
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
