"""Every Redis key the portal and its gateway use, in one place, under one namespace.

Several installations may share one Redis server (and a developer's `make run`
shares database 0 with whatever ran before), so every key starts with the
installation's namespace: `<ns>:gw:...` (quotas, slots, queues, blocks, usage
records), `<ns>:metrics:...` (the summed counters and the dashboard's minutes)
and `<ns>:celery:...` (Celery's queues, through kombu's `global_keyprefix`).
Admission, revocation, the usage flush and every reader build their keys here,
so a writer and a reader can never disagree on a spelling.

Pure Python; no Django (portal/settings.py reads the namespace rules from here).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass

# Counter families added to from below observability (which exports every family it finds).
USAGE_DEAD_LETTERS = "usage_dead_letters"  # (reason): usage records the flush could not store

NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


# Engines spelled two ways, and the port each listens on when a URL names none.
_ENGINE_ALIASES = {"django.db.backends.postgresql_psycopg2": "django.db.backends.postgresql"}
_DEFAULT_PORTS = {"django.db.backends.postgresql": "5432", "django.db.backends.mysql": "3306"}
# The local server, however it is reached (for PostgreSQL an empty host is its local socket).
_LOCAL_HOSTS = {"", "localhost", "127.0.0.1", "::1", "[::1]", "localhost.localdomain"}


def database_identity(database: dict) -> str:
    """`engine|host|port|name` of a Django database setting, spelled one way: the engine's alias
    resolved, the host lowercased (the local server's spellings as one), the engine's default
    port filled in, a SQLite path made absolute. `db:5432/portal` and `DB/portal` are one database."""
    engine = str(database.get("ENGINE") or "")
    engine = _ENGINE_ALIASES.get(engine, engine)
    name = str(database.get("NAME") or "")
    if engine == "django.db.backends.sqlite3":
        if name and name != ":memory:" and not name.startswith("file:"):
            name = os.path.abspath(os.path.expanduser(name))
        return f"{engine}|||{name}"
    host = str(database.get("HOST") or "").strip()
    if not host.startswith("/"):  # a socket directory is a path, case and all
        host = host.lower().rstrip(".")
    if host in _LOCAL_HOSTS:
        host = "localhost"
    port = str(database.get("PORT") or "").strip() or _DEFAULT_PORTS.get(engine, "")
    return f"{engine}|{host}|{port}|{name}"


def namespace_for_database(database: dict) -> str:
    """A namespace derived from a database's identity (engine, host, port, name, normalised by
    `database_identity`): two installations with different databases never share keys by
    accident, and two processes of one installation agree however their URLs spell it."""
    return "portal-" + hashlib.sha256(database_identity(database).encode()).hexdigest()[:12]


def heartbeat_key(database_fingerprint: str) -> str:
    """Where each process says which namespace it uses: keyed by its database, under no namespace,
    so processes of one installation that disagree on the namespace still meet there."""
    return f"portal-heartbeat:{database_fingerprint}"


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
    def usage_open(self) -> str:
        """Hash: request id → the record a request would leave if its gateway process died (an
        `interrupted` record billing its reservation), from admission until it finishes."""
        return f"{self.gateway}usage:open"

    @property
    def usage_open_leases(self) -> str:
        """Sorted set: the request ids of `usage_open`, scored by when their lease ends (ms); the
        process serving one renews it with its slots."""
        return f"{self.gateway}usage:open:leases"

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
