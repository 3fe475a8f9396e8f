"""Each process says, every minute, which Redis namespace it uses, where every process of the
installation meets whatever namespace it uses: a hash keyed by the database itself
(`heartbeat_key`, under no namespace). Two namespaces live for one database means processes
configured differently (a derived namespace from a differently spelled URL, or a typo) that split
usage and queues without a word: each such process logs a warning, and the ops dashboard shows it.

The database's fingerprint comes from the database, not from how its URL is spelled: PostgreSQL's
system identifier and the database's name (SQLite: its absolute path).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
from django.conf import settings
from django.db import DatabaseError, connection, transaction

from portal.core.redis.keys import database_identity, heartbeat_key

from .redis.client import gateway_redis

log = logging.getLogger("portal.core")

HEARTBEAT_INTERVAL_S = 60
# A process unheard of for this long is gone (three missed beats).
HEARTBEAT_LIVE_S = 3 * HEARTBEAT_INTERVAL_S
# The hash itself outlives a stopped installation by a day, no more.
HEARTBEAT_KEY_TTL_S = 86_400


@dataclass(frozen=True)
class NamespaceBeat:
    namespace: str
    kind: str  # web, worker, beat
    host: str
    seen_at: float  # epoch seconds

    @property
    def seen(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self.seen_at, tz=dt.UTC)


_fingerprints: dict[str, str] = {}


def database_fingerprint() -> str:
    """The same for every process connected to the same database, however its URL is spelled
    (asked of the database once per process: pages that show it cost no query)."""
    spelled = database_identity(settings.DATABASES["default"])
    if spelled not in _fingerprints:
        _fingerprints[spelled] = _ask_fingerprint(spelled)
    return _fingerprints[spelled]


def _ask_fingerprint(identity: str) -> str:
    if connection.vendor == "postgresql":
        try:
            with transaction.atomic(), connection.cursor() as cursor:  # a savepoint, if in a transaction
                cursor.execute("SELECT system_identifier::text, current_database() FROM pg_control_system()")
                system_id, name = cursor.fetchone()
            identity = f"postgresql|{system_id}|{name}"
        except DatabaseError:  # an older server or a restricted role: the normalised URL will do
            pass
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def _field(kind: str) -> str:
    return f"{settings.PORTAL_REDIS_NAMESPACE}|{kind}|{socket.gethostname()}|{os.getpid()}"


def namespace_heartbeat_record(
    *, kind: str, fingerprint: str | None = None, now: float | None = None
) -> list[str]:
    """Record that this process (of `kind`) uses this namespace; returns the other namespaces live
    for the same database (and warns when there are any)."""
    now = time.time() if now is None else now
    key = heartbeat_key(fingerprint or database_fingerprint())
    client = gateway_redis()
    with client.pipeline(transaction=False) as pipe:
        pipe.hset(key, _field(kind), now)
        pipe.expire(key, HEARTBEAT_KEY_TTL_S)
        pipe.hgetall(key)
        _, _, raw = pipe.execute()
    beats = _beats(raw, now=now)
    stale = [field for field, seen in raw.items() if float(seen) < now - HEARTBEAT_KEY_TTL_S]
    if stale:
        client.hdel(key, *stale)
    others = sorted({b.namespace for b in beats} - {settings.PORTAL_REDIS_NAMESPACE})
    if others:
        log.warning(
            "Redis namespace mismatch: this %s process uses %r, other processes of the same database use %s; "
            "set PORTAL_REDIS_NAMESPACE alike everywhere",
            kind, settings.PORTAL_REDIS_NAMESPACE, ", ".join(map(repr, others)),
        )  # fmt: skip
    return others


def _beats(raw: dict[Any, Any], *, now: float) -> list[NamespaceBeat]:
    beats = []
    for field, seen in raw.items():
        namespace, kind, host, _pid = (field.decode() if isinstance(field, bytes) else field).split("|", 3)
        if float(seen) >= now - HEARTBEAT_LIVE_S:
            beats.append(NamespaceBeat(namespace, kind, host, float(seen)))
    return beats


def live_namespaces(*, now: float | None = None) -> list[NamespaceBeat] | None:
    """The processes heard from lately, one entry per (namespace, kind, host), newest first;
    None if Redis or the database cannot say."""
    now = time.time() if now is None else now
    try:
        raw = gateway_redis().hgetall(heartbeat_key(database_fingerprint()))
    except (redis.RedisError, DatabaseError):
        return None
    newest: dict[tuple[str, str, str], NamespaceBeat] = {}
    for beat in _beats(raw, now=now):
        slot = (beat.namespace, beat.kind, beat.host)
        if slot not in newest or newest[slot].seen_at < beat.seen_at:
            newest[slot] = beat
    return sorted(newest.values(), key=lambda b: (b.namespace, b.kind, b.host))


_started: set[str] = set()
_lock = threading.Lock()


def namespace_heartbeat_start(kind: str) -> None:
    """Beat every HEARTBEAT_INTERVAL_S from a daemon thread of this process (once per kind)."""
    with _lock:
        if kind in _started:
            return
        _started.add(kind)
    name = f"namespace-heartbeat-{kind}"
    threading.Thread(target=_beat_forever, args=(kind,), name=name, daemon=True).start()


def _beat_forever(kind: str) -> None:
    fingerprint = None
    while True:
        try:
            fingerprint = fingerprint or database_fingerprint()
            namespace_heartbeat_record(kind=kind, fingerprint=fingerprint)
        except Exception as error:  # a beat missed is no reason to end the thread
            log.debug("namespace heartbeat skipped: %s", error)
        finally:
            connection.close()  # this thread's own connection: not held between beats
        time.sleep(HEARTBEAT_INTERVAL_S)
