"""What `/metrics` shows, built at scrape time from Redis (the summed counters, the live queues)
and the database (deployments by state).

Not prometheus_client's global registry: the answering process's
own Python and process metrics would change with whichever uvicorn worker took the
scrape, which is noise next to portal-wide totals.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, defaultdict

import redis
from django.conf import settings
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from portal.core.redis.client import redis_keys
from portal.core.redis.keys import USAGE_DEAD_LETTERS
from portal.deployments.models import Deployment, DeploymentState

from . import prometheus as m
from .gpu_metrics import gpu_families
from .models import SlaBreach

log = logging.getLogger("portal.metrics")

HISTOGRAMS = {
    m.DURATION: ("portal_gateway_request_duration_seconds", "Gateway request duration, arrival to last byte.",
                 m.DURATION_BUCKETS),
    m.TTFT: ("portal_gateway_ttft_seconds", "Gateway time to first byte from upstream (streamed only).",
             m.TTFT_BUCKETS),
}  # fmt: skip


def _queue_stale_ms() -> int:
    # Matches the admission script: a queue entry older than this was abandoned by a dead process.
    return int((settings.GATEWAY_QUEUE_TIMEOUT_S + settings.GATEWAY_SLOT_LEASE_S) * 1000)


def _batch_queue_stale_ms() -> int:
    return int((settings.GATEWAY_BATCH_QUEUE_TIMEOUT_S + settings.GATEWAY_SLOT_LEASE_S) * 1000)


def batch_queue_depths(client: redis.Redis, models: list[str]) -> dict[str, int]:
    """Batch requests waiting for spare capacity, per model, now."""
    now_ms = int(time.time() * 1000)
    keys = redis_keys()
    with client.pipeline(transaction=False) as pipe:
        for model in models:
            pipe.zcount(keys.batch_queue(model), now_ms - _batch_queue_stale_ms(), "+inf")
        return dict(zip(models, pipe.execute(), strict=True))


def read_counters(client: redis.Redis) -> dict[tuple, float]:
    out = {}
    for field, value in client.hgetall(redis_keys().metrics_counters).items():
        try:
            out[tuple(json.loads(field))] = float(value)
        except (ValueError, TypeError):
            continue
    return out


def live_gauges(client: redis.Redis, deployments: list[tuple[int, str, str, str]]) -> tuple[dict, dict]:
    """Queue depth per served model and requests in flight per serving deployment, now."""
    now_ms = int(time.time() * 1000)
    serving = [
        (pk, name, model) for pk, name, state, model in deployments if state == DeploymentState.SERVING
    ]
    models = sorted({model for _pk, _name, model in serving})
    keys = redis_keys()
    with client.pipeline(transaction=False) as pipe:
        for model in models:
            pipe.zcount(keys.queue(model), now_ms - _queue_stale_ms(), "+inf")
        for pk, _name, _model in serving:
            pipe.zcount(keys.inflight(pk), now_ms, "+inf")
        counts = pipe.execute()
    queues = dict(zip(models, counts[: len(models)], strict=True))
    inflight = {name: n for (_pk, name, _m), n in zip(serving, counts[len(models) :], strict=True)}
    return queues, inflight


class PortalCollector:
    def collect(self):
        deployments = list(
            Deployment.objects.values_list("pk", "name", "state", "model_version__name").order_by("pk")
        )
        states = GaugeMetricFamily("portal_deployments", "Deployments by lifecycle state.", labels=["state"])
        by_state = Counter(state for _pk, _name, state, _model in deployments)
        for state in DeploymentState.values:
            states.add_metric([state], by_state.get(state, 0))
        yield states
        yield self._breaching(deployments)
        yield from gpu_families()

        up = GaugeMetricFamily("portal_metrics_redis_up", "1 if the scrape could read Redis.")
        try:
            client = m.client()
            counters = read_counters(client)
            queues, inflight = live_gauges(client, deployments)
            batch_queues = batch_queue_depths(client, list(queues))
            dead_letters = client.llen(redis_keys().usage_dead)
        except redis.RedisError as error:
            log.warning("metrics scrape without Redis: %s", error)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from self._counters(counters)

        queue = GaugeMetricFamily(
            "portal_gateway_queue_depth", "Requests waiting for a replica slot, per model.", labels=["model"]
        )
        for model, n in queues.items():
            queue.add_metric([model], n)
        yield queue
        batch_queue = GaugeMetricFamily(
            "portal_gateway_batch_queue_depth",
            "Batch-class requests waiting for a model's spare capacity (apart from the queue depth).",
            labels=["model"],
        )
        for model, n in batch_queues.items():
            batch_queue.add_metric([model], n)
        yield batch_queue
        flight = GaugeMetricFamily(
            "portal_gateway_inflight_requests",
            "Gateway requests holding a slot on each serving deployment.",
            labels=["deployment"],
        )
        for name, n in inflight.items():
            flight.add_metric([name], n)
        yield flight
        yield GaugeMetricFamily(
            "portal_usage_dead_letter_records",
            "Usage records the flush could not store, kept in Redis to inspect (docs/operators.md, Day-2).",
            value=dead_letters,
        )

    def _breaching(self, deployments: list[tuple[int, str, str, str]]) -> GaugeMetricFamily:
        """1 for each deployment with an open SLA breach (portal/observability/services.py), else 0."""
        open_ids = set(SlaBreach.objects.filter(ended_at__isnull=True).values_list("deployment", flat=True))
        gauge = GaugeMetricFamily(
            "portal_deployment_sla_breaching",
            "1 while the deployment's P95 TTFT or TPOT has broken its SLA for 5 minutes in a row.",
            labels=["deployment"],
        )
        for pk, name, _state, _model in deployments:
            gauge.add_metric([name], 1 if pk in open_ids else 0)
        return gauge

    def _counters(self, counters: dict[tuple, float]):
        families = {
            m.REQUESTS: CounterMetricFamily(
                "portal_gateway_requests", "Gateway requests by outcome.",
                labels=["model", "endpoint", "status", "code"],
            ),
            m.TOKENS: CounterMetricFamily(
                "portal_gateway_tokens", "Tokens through the gateway (prompt, completion).",
                labels=["model", "kind"],
            ),
            m.REJECTIONS: CounterMetricFamily(
                "portal_gateway_rejections",
                "Requests the gateway refused, by error code (auth, quotas, queue, bad input).",
                labels=["reason"],
            ),
            m.UPSTREAM_ERRORS: CounterMetricFamily(
                "portal_gateway_upstream_errors", "Upstream failures and timeouts, by error code.",
                labels=["model", "reason"],
            ),
            m.UPSTREAM_CONNECT_ERRORS: CounterMetricFamily(
                "portal_gateway_upstream_connect_errors",
                "Connections to a replica that failed before a request was sent, by replica host and reason.",
                labels=["host", "reason"],
            ),
            m.CELERY: CounterMetricFamily(
                "portal_celery_tasks", "Celery task outcomes.", labels=["task", "outcome"]
            ),
            USAGE_DEAD_LETTERS: CounterMetricFamily(
                "portal_usage_dead_letters",
                "Usage records the flush refused (dead-lettered), by reason.",
                labels=["reason"],
            ),
        }  # fmt: skip
        parts: dict[str, dict[str, dict]] = {family: defaultdict(dict) for family in HISTOGRAMS}
        for key, value in sorted(counters.items(), key=lambda kv: [str(p) for p in kv[0]]):
            family, labels = key[0], key[1:]
            if family in families:
                families[family].add_metric([str(label) for label in labels], value)
            elif family in HISTOGRAMS and len(labels) >= 2:
                model, part = labels[0], labels[1]
                parts[family][model][labels[2] if part == "b" else part] = value
        yield from families.values()
        for family, (name, help_text, bounds) in HISTOGRAMS.items():
            histogram = HistogramMetricFamily(name, help_text, labels=["model"])
            for model, p in sorted(parts[family].items()):
                cumulative, buckets = 0.0, []
                for i, bound in enumerate([*bounds, float("inf")]):
                    cumulative += p.get(i, 0)
                    buckets.append(("+Inf" if bound == float("inf") else f"{bound:g}", cumulative))
                histogram.add_metric([model], buckets, sum_value=p.get("sum", 0.0))
            yield histogram


def exposition() -> bytes:
    return generate_latest(PortalCollector())
