"""Writes for benchmark runs, one module per job:

- `runs`: queue a run (`benchmark_run_create` with a `BenchmarkRunRequest`), cancel it;
- `limits`: what a run may ask (bounds for everyone, tighter ones for members) and its level plans;
- `snapshot`: what was measured (deployment snapshot, server version, roofline share of a level);
- `execution`: the job's body (`benchmark_run_execute`), on the `benchmarks` queue;
- `sla`: the run's SLA operating point and, for staff, applying it as the gateway cap;
- `tables`: importing an external table (Markdown, CSV, TSV) as a run.

Node acceptance, a benchmark of a node rather than of a deployment, is `portal/benchmarks/acceptance/`.
"""

from .execution import benchmark_run_end_unheld, benchmark_run_execute, benchmark_runs_expire
from .limits import (
    MAX_CONCURRENCY,
    MAX_LEVEL_S,
    MAX_LEVELS,
    MAX_REQUEST_RATE,
    MAX_REQUESTS_PER_LEVEL,
    MAX_SEED,
)
from .runs import BenchmarkRunRequest, benchmark_run_cancel, benchmark_run_create
from .sla import benchmark_run_apply_sla_cap, benchmark_run_pick_sla
from .snapshot import deployment_snapshot, deployment_tokenizer_path, roofline_share, server_version
from .tables import FIELD_GUIDE_7B_TABLE, benchmark_import_table, parse_table

__all__ = [
    "FIELD_GUIDE_7B_TABLE",
    "MAX_CONCURRENCY",
    "MAX_LEVELS",
    "MAX_LEVEL_S",
    "MAX_REQUESTS_PER_LEVEL",
    "MAX_REQUEST_RATE",
    "MAX_SEED",
    "BenchmarkRunRequest",
    "benchmark_import_table",
    "benchmark_run_apply_sla_cap",
    "benchmark_run_cancel",
    "benchmark_run_create",
    "benchmark_run_end_unheld",
    "benchmark_run_execute",
    "benchmark_run_pick_sla",
    "benchmark_runs_expire",
    "deployment_snapshot",
    "deployment_tokenizer_path",
    "parse_table",
    "roofline_share",
    "server_version",
]
