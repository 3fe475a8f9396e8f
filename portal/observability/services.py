"""Writes of the observability app: the queue-depth samples behind the dashboard's chart, the
per-minute production latency of each deployment and its SLA breaches."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections import defaultdict

from django.db import IntegrityError, connection, transaction
from django.db.models import F
from django.db.models.functions import Greatest
from django.utils import timezone

from portal.deployments.models import Deployment
from portal.teams.models import Usage, UsageStatus

from . import prometheus
from .collector import live_gauges
from .models import LatencyMinute, SlaBreach

logger = logging.getLogger("portal.sla")


def queue_depth_sample(*, at: float | None = None) -> int:
    """Read every served model's queue now and keep the minute's largest total; returns the total."""
    deployments = list(Deployment.objects.values_list("pk", "name", "state", "model_version__name"))
    queues, _inflight = live_gauges(prometheus.client(), deployments)
    total = sum(queues.values())
    prometheus.minute_max("queue_depth", total, at=time.time() if at is None else at)
    return total


# --- Production latency per deployment per minute, and SLA breaches -------------------------

# Breaking minutes in a row that make a breach (issue 16: "5 minutes in a row").
SLA_BREACH_MINUTES = 5
# Minutes the periodic rollup recomputes: a request's record is stamped with its arrival and
# stored when it ends, so a minute keeps filling for as long as its longest request runs.
LATENCY_ROLLUP_LOOKBACK_MINUTES = 30
ERROR_STATUSES = (UsageStatus.UPSTREAM_ERROR, UsageStatus.TIMEOUT)


def _minute_floor(at: dt.datetime) -> dt.datetime:
    return at.astimezone(dt.UTC).replace(second=0, microsecond=0)


def percentile_cont(values: list[float], fraction: float) -> float | None:
    """PostgreSQL's percentile_cont: linear interpolation between the closest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


_ROLLUP_SQL = """
SELECT deployment_id, date_trunc('minute', created_at) AS minute, count(*),
       count(*) FILTER (WHERE status = ANY(%(errors)s)),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY ttft_ms),
       percentile_cont(0.95) WITHIN GROUP (ORDER BY ttft_ms),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY tpot_ms),
       percentile_cont(0.95) WITHIN GROUP (ORDER BY tpot_ms),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY e2e_ms),
       percentile_cont(0.95) WITHIN GROUP (ORDER BY e2e_ms)
FROM (
    SELECT deployment_id, created_at, status,
           CASE WHEN stream THEN ttft_ms END AS ttft_ms,
           CASE WHEN stream AND status = %(completed)s AND ttft_ms IS NOT NULL AND completion_tokens > 1
                THEN GREATEST(duration_ms - ttft_ms, 0) / (completion_tokens - 1) END AS tpot_ms,
           CASE WHEN status = %(completed)s THEN duration_ms END AS e2e_ms
    FROM {table}
    WHERE deployment_id IS NOT NULL AND created_at >= %(since)s AND created_at < %(until)s
) AS u
GROUP BY 1, 2
"""


def _rollup_rows_postgres(since: dt.datetime, until: dt.datetime) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(
            _ROLLUP_SQL.format(table=connection.ops.quote_name(Usage._meta.db_table)),
            {
                "errors": [s.value for s in ERROR_STATUSES],
                "completed": UsageStatus.COMPLETED.value,
                "since": since,
                "until": until,
            },
        )
        return cursor.fetchall()


def _rollup_rows_python(since: dt.datetime, until: dt.datetime) -> list[tuple]:
    """The same rows as the SQL, for SQLite (no percentile_cont there)."""
    groups: dict[tuple[int, dt.datetime], dict[str, list]] = defaultdict(
        lambda: {"n": [0, 0], "ttft": [], "tpot": [], "e2e": []}
    )
    rows = Usage.objects.filter(
        deployment__isnull=False, created_at__gte=since, created_at__lt=until
    ).values_list(
        "deployment_id", "created_at", "status", "stream", "ttft_ms", "duration_ms", "completion_tokens"
    )
    for deployment_id, created_at, status, stream, ttft, duration, tokens in rows.iterator():
        group = groups[deployment_id, _minute_floor(created_at)]
        group["n"][0] += 1
        group["n"][1] += status in ERROR_STATUSES
        if status == UsageStatus.COMPLETED:
            group["e2e"].append(duration)
        if stream and ttft is not None:  # a non-streamed answer has no first token to time
            group["ttft"].append(ttft)
            if status == UsageStatus.COMPLETED and tokens > 1:
                group["tpot"].append(max(duration - ttft, 0) / (tokens - 1))
    return [
        (
            deployment_id,
            minute,
            g["n"][0],
            g["n"][1],
            *(percentile_cont(g[name], q) for name in ("ttft", "tpot", "e2e") for q in (0.5, 0.95)),
        )
        for (deployment_id, minute), g in groups.items()
    ]


def latency_rollup(*, since: dt.datetime, until: dt.datetime) -> int:
    """Recompute the per-minute latency rows of every deployment for the minutes in [since, until)
    (rounded down to whole minutes) from the usage records; returns how many rows were written.

    Idempotent: each (deployment, minute) row is overwritten with what the records say now. Rows
    are never deleted here, so a rollup over minutes whose records retention already pruned
    would only overwrite them with what is left: the periodic task looks back minutes, not days.
    """
    since, until = _minute_floor(since), _minute_floor(until)
    if until <= since:
        return 0
    compute = _rollup_rows_postgres if connection.vendor == "postgresql" else _rollup_rows_python
    rows = [
        LatencyMinute(
            deployment_id=deployment_id,
            minute=minute,
            requests=requests,
            errors=errors,
            p50_ttft_ms=p50_ttft,
            p95_ttft_ms=p95_ttft,
            p50_tpot_ms=p50_tpot,
            p95_tpot_ms=p95_tpot,
            p50_e2e_ms=p50_e2e,
            p95_e2e_ms=p95_e2e,
        )
        for (
            deployment_id,
            minute,
            requests,
            errors,
            p50_ttft,
            p95_ttft,
            p50_tpot,
            p95_tpot,
            p50_e2e,
            p95_e2e,
        ) in compute(since, until)
    ]
    # A deployment deleted since its records were read has no row to point at.
    existing = set(
        Deployment.objects.filter(pk__in={r.deployment_id for r in rows}).values_list("pk", flat=True)
    )
    rows = [r for r in rows if r.deployment_id in existing]
    LatencyMinute.objects.bulk_create(
        rows,
        update_conflicts=True,
        unique_fields=["deployment", "minute"],
        update_fields=[
            "requests", "errors", "p50_ttft_ms", "p95_ttft_ms", "p50_tpot_ms", "p95_tpot_ms",
            "p50_e2e_ms", "p95_e2e_ms",
        ],
    )  # fmt: skip
    return len(rows)


def minute_misses(row: LatencyMinute, *, sla_ttft_s: float, sla_tpot_s: float) -> list[str]:
    """Why a minute breaks the SLA (empty: it does not, or it measured nothing to judge)."""
    reasons = []
    if row.p95_ttft_ms is not None and row.p95_ttft_ms > sla_ttft_s * 1000:
        reasons.append(f"P95 TTFT {row.p95_ttft_ms / 1000:.2f} s > {sla_ttft_s:g} s")
    if row.p95_tpot_ms is not None and row.p95_tpot_ms > sla_tpot_s * 1000:
        reasons.append(f"P95 TPOT {row.p95_tpot_ms / 1000:.3f} s > {sla_tpot_s:g} s")
    return reasons


def sla_breaches_update(*, now: dt.datetime | None = None) -> dict[str, list[str]]:
    """Open a breach for each deployment whose last SLA_BREACH_MINUTES complete minutes all broke
    its SLA, and close the open breach of each whose last complete minute did not (a minute
    without requests does not break). Returns the names opened and closed."""
    current = _minute_floor(now or timezone.now())  # the minute still filling is not judged
    window_start = current - dt.timedelta(minutes=SLA_BREACH_MINUTES)
    rows: dict[int, dict[dt.datetime, LatencyMinute]] = defaultdict(dict)
    for row in LatencyMinute.objects.filter(minute__gte=window_start, minute__lt=current):
        rows[row.deployment_id][row.minute] = row
    open_ids = set(SlaBreach.objects.filter(ended_at__isnull=True).values_list("deployment_id", flat=True))
    deployments = Deployment.objects.filter(pk__in=set(rows) | open_ids).only(
        "pk", "name", "sla_p95_ttft_s", "sla_p95_tpot_s"
    )
    minutes = [window_start + dt.timedelta(minutes=i) for i in range(SLA_BREACH_MINUTES)]
    done: dict[str, list[str]] = {"opened": [], "closed": []}
    for deployment in deployments:
        sla = {"sla_ttft_s": deployment.sla_p95_ttft_s, "sla_tpot_s": deployment.sla_p95_tpot_s}
        mine = rows[deployment.pk]
        misses = [minute_misses(mine[m], **sla) if m in mine else [] for m in minutes]
        if deployment.pk in open_ids:
            if not misses[-1] and _breach_close(deployment, misses, minutes):
                done["closed"].append(deployment.name)
        elif all(misses) and _breach_open(deployment, started_at=minutes[0], reason="; ".join(misses[-1])):
            done["opened"].append(deployment.name)
    return done


def _breach_open(deployment: Deployment, *, started_at: dt.datetime, reason: str) -> bool:
    try:
        with transaction.atomic():
            SlaBreach.objects.create(deployment=deployment, started_at=started_at, reason=reason[:300])
    except IntegrityError:  # another evaluation opened it first (sla_breach_one_open)
        return False
    logger.warning("deployment %s breaches its SLA since %s: %s", deployment.name, started_at, reason)
    return True


def _breach_close(deployment: Deployment, misses: list[list[str]], minutes: list[dt.datetime]) -> bool:
    # Ends where the last breaking minute of the window ends, else where the window starts.
    last_breaking = max((m for m, miss in zip(minutes, misses, strict=True) if miss), default=None)
    ended_at = (last_breaking + dt.timedelta(minutes=1)) if last_breaking else minutes[0]
    closed = SlaBreach.objects.filter(deployment=deployment, ended_at__isnull=True).update(
        ended_at=Greatest(ended_at, F("started_at"))
    )
    if closed:
        logger.info("deployment %s is back inside its SLA (breach ended %s)", deployment.name, ended_at)
    return bool(closed)


def latency_rollup_recent(*, now: dt.datetime | None = None) -> dict:
    """The beat task's work: roll up the last minutes (the current one too, for the charts), then
    judge the complete ones against each deployment's SLA."""
    now = now or timezone.now()
    written = latency_rollup(
        since=now - dt.timedelta(minutes=LATENCY_ROLLUP_LOOKBACK_MINUTES), until=now + dt.timedelta(minutes=1)
    )
    return {"rows": written, **sla_breaches_update(now=now)}
