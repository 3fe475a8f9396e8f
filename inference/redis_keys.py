"""Every Redis key the portal and its gateway use, in one place, under one namespace.

Several installations may share one Redis server (and a developer's `make run`
shares database 0 with whatever ran before), so every key starts with the
installation's namespace: `<ns>:gw:...` (quotas, slots, queues, blocks, usage
records), `<ns>:metrics:...` (the summed counters and the dashboard's minutes)
and `<ns>:celery:...` (Celery's queues, through kombu's `global_keyprefix`).
Admission, revocation, the usage flush and every reader build their keys here,
so a writer and a reader can never disagree on a spelling.

Pure Python; no Django.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

# Counter families added to from below observability (which exports every family it finds).
USAGE_DEAD_LETTERS = "usage_dead_letters"  # (reason): usage records the flush could not store

NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def namespace_for_database(database: dict) -> str:
    """A namespace derived from a database's identity (engine, host, port, name): two
    installations with different databases never share keys by accident."""
    identity = "|".join(str(database.get(part) or "") for part in ("ENGINE", "HOST", "PORT", "NAME"))
    return "portal-" + hashlib.sha256(identity.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class RedisKeys:
    namespace: str

    def __post_init__(self) -> None:
        if not NAMESPACE_RE.fullmatch(self.namespace):
            raise ValueError(f"bad Redis namespace {self.namespace!r}: letters, digits, _ . - (at most 64)")

    # --- the gateway: admission state, blocks, usage records ---------------------
    @property
    def gateway(self) -> str:
        """What every gateway key starts with (`<ns>:gw:`), for a scan."""
        return f"{self.namespace}:gw:"

    def blocked(self, kind: str, id: int | str) -> str:
        return f"{self.gateway}blocked:{kind}:{id}"

    def rpm(self, kind: str, id: int | str) -> str:
        return f"{self.gateway}rpm:{kind}:{id}"

    def tpm(self, kind: str, id: int | str) -> str:
        return f"{self.gateway}tpm:{kind}:{id}"

    def tpd_prefix(self, kind: str, id: int | str) -> str:
        """Followed by the UTC day number."""
        return f"{self.gateway}tpd:{kind}:{id}:"

    def tpd_rebuilt(self, kind: str, id: int | str, day: int | str) -> str:
        """When (Redis's clock, µs) that day's counter was rebuilt from the database (apart from the
        counters' prefix, so a scan of it finds counters only)."""
        return f"{self.gateway}tpdrebuilt:{kind}:{id}:{day}"

    def concurrency(self, kind: str, id: int | str) -> str:
        return f"{self.gateway}conc:{kind}:{id}"

    def inflight(self, deployment_id: int | str) -> str:
        return f"{self.gateway}inflight:{deployment_id}"

    def long(self, deployment_id: int | str) -> str:
        return f"{self.gateway}long:{deployment_id}"

    def queue(self, model: str) -> str:
        return f"{self.gateway}queue:{model}"

    def batch_queue(self, model: str) -> str:
        """Batch requests waiting for a model's spare capacity, apart from the interactive queue."""
        return f"{self.gateway}bqueue:{model}"

    def reservation(self, request_id: str) -> str:
        """What one admission reserved (`<day>:<tokens>`), kept briefly: a caller that lost the
        admission's reply (a Redis timeout) gives back exactly that, and only if it was taken."""
        return f"{self.gateway}resv:{request_id}"

    def auth_failures(self, address: str) -> str:
        """Failed authentications from one client address in its current window."""
        return f"{self.gateway}authfail:{address}"

    @property
    def usage(self) -> str:
        """The list the gateway appends usage records to and the flush drains."""
        return f"{self.gateway}usage"

    @property
    def usage_dead(self) -> str:
        """Records the flush could not store, each with why (see the README's operations section)."""
        return f"{self.gateway}usage:dead"

    @property
    def usage_flushers(self) -> str:
        """Sorted set: the id of each flusher holding a batch, scored by when its lease ends (ms)."""
        return f"{self.gateway}usage:flushers"

    def usage_taken(self, flusher: str) -> str:
        """The batch one flusher took and has not yet stored."""
        return f"{self.gateway}usage:taken:{flusher}"

    @property
    def usage_hours(self) -> str:
        """Set: the UTC hours (epoch seconds) the flush stored records in since the hourly rollup last ran."""
        return f"{self.gateway}usage:hours"

    # --- the portal's metrics ------------------------------------------------------
    @property
    def metrics(self) -> str:
        return f"{self.namespace}:metrics:"

    @property
    def metrics_counters(self) -> str:
        return f"{self.metrics}counters"

    @staticmethod
    def counter_field(key: tuple) -> str:
        """A field of the `metrics_counters` hash: JSON `[family, labels...]`."""
        return json.dumps(key, separators=(",", ":"))

    def metrics_minute(self, minute: int) -> str:
        return f"{self.metrics}minute:{minute}"

    # --- Celery ----------------------------------------------------------------------
    @property
    def celery(self) -> str:
        """kombu's `global_keyprefix`: Celery's queue `control` lives in the list `<ns>:celery:control`."""
        return f"{self.namespace}:celery:"

    def celery_key(self, name: str) -> str:
        """The raw Redis key of a Celery queue (or of kombu's `unacked` hash) under this namespace."""
        return f"{self.celery}{name}"
