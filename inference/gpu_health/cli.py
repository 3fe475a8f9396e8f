"""`python -m inference.gpu_health`: one sample of this machine as the agent takes it, judged."""

from __future__ import annotations

import subprocess
from typing import Any

from .rules import GpuContext, evaluate
from .sampling import DEFAULT_TIMEOUT_S, bounded_run, read_sample


def main(argv: list[str] | None = None) -> int:
    """`python -m inference.gpu_health`: one sample of this machine as the agent takes it, judged, as JSON
    (`--raw FILE` also keeps nvidia-smi's own output, e.g. for a committed fixture)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=(main.__doc__ or "").splitlines()[0])
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--raw", help="write nvidia-smi's stdout here")
    args = parser.parse_args(argv)
    if not 0 < args.timeout <= 600:
        parser.error("--timeout must be above 0 and at most 600 s")
    raw: dict[str, str] = {}

    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        result = bounded_run(argv, **kwargs)
        raw[argv[0]] = result.stdout or ""  # the last answer: the one after any dropped field
        return result

    sample = read_sample(timeout_s=args.timeout, run=run)
    if args.raw:
        with open(args.raw, "w") as out:
            out.write(raw.get("nvidia-smi", ""))
    verdicts = [evaluate(GpuContext(g.index, g.pci_bus_id), sample) for g in sample.gpus]
    report = {
        "at": sample.at.isoformat(),
        "seconds": round(sample.seconds, 4),
        "error": sample.error,
        "unavailable": sample.unavailable,
        "unsupported_fields": list(sample.unsupported_fields),
        "problems": [p.reason for p in sample.problems],
        "gpus": [g.to_dict() for g in sample.gpus],
        "xids": [x.to_dict() for x in sample.xids],
        "verdicts": [{"index": v.index, "state": v.state, "findings": v.findings_dicts()} for v in verdicts],
    }
    print(json.dumps(report, indent=2))
    return 0 if not sample.error else 1
