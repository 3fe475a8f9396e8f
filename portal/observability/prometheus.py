"""The portal's own metrics: counted in each process, summed across processes in Redis.

The web tier runs several uvicorn workers (and Celery runs on other machines), so
no single process knows the totals. Each process counts in a dict under a lock
(no I/O on the request path) and a daemon thread adds the deltas to Redis every
PORTAL_METRICS_FLUSH_S seconds in one pipeline. A scrape of `/metrics` on any web
process reads the sums from Redis (`collector.py`), so one scrape target sees the
whole portal. A process that dies loses at most one interval of counts.

Redis layout (GATEWAY_REDIS_URL, keys from portal/core/redis/keys.py under the namespace):
- `<ns>:metrics:counters`: one hash; field = JSON `[family, labels...]`, value = the running sum.
- `<ns>:metrics:minute:<epoch minute>`: per-minute traffic for the dashboard (requests,
  tokens, errors, rejections, the largest queue depth sampled), kept two hours.
"""

from __future__ import annotations

import atexit
import bisect
import logging
import os
import threading
import time

import redis
from django.conf import settings

from portal.core.redis.client import gateway_redis, redis_keys
from portal.core.redis.keys import RedisKeys
from portal.core.redis.scripts import MINUTE_MAX, MinuteMaxCall
from portal.teams.models import UNBILLED_STATUSES, UsageStatus

log = logging.getLogger("portal.metrics")

MINUTE_TTL_S = 2 * 3600

# Upper bounds (seconds) of the latency histograms: a streamed answer runs for minutes on a V100.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# Families (the first item of a counter's key); collector.py turns them into Prometheus metrics.
REQUESTS = "requests"  # (model, endpoint, status, http code)
TOKENS = "tokens"  # (model, kind)
REJECTIONS = "rejections"  # (reason)
UPSTREAM_ERRORS = "upstream_errors"  # (model, reason)
UPSTREAM_CONNECT_ERRORS = "upstream_connect_errors"  # (replica host, reason): e.g. its name does not resolve
DURATION = "duration"  # histogram parts: (model, "b", bucket index) | (model, "sum") | (model, "count")
TTFT = "ttft"
CELERY = "celery"  # (task, outcome)

# Codes whose `model` is whatever the client typed: labelled "" so a client cannot mint series.
UNROUTED_CODES = frozenset({"model_not_found", "model_not_allowed"})
UPSTREAM_STATUSES = frozenset({UsageStatus.UPSTREAM_ERROR, UsageStatus.TIMEOUT})


def client() -> redis.Redis:
    # The client has timeouts: a scrape or a flush must not hang on a Redis that is gone.
    return gateway_redis()


encode_field = RedisKeys.counter_field  # the hash layout lives with the keys (teams adds to it too)


class Recorder:
    """In-process deltas, flushed to Redis by a daemon thread (started lazily, again after a fork)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        # Also the child's state after a fork (prefork Celery): the parent flushes what it had.
        self._lock = threading.Lock()
        self._sending = threading.Lock()  # one flush at a time: a caller's flush waits for the thread's
        self._counters: dict[tuple, float] = {}
        self._minutes: dict[tuple[int, str], int] = {}
        self._pid: int | None = None
        self._wake = threading.Event()
        self._failing_since: float | None = None

    def add(self, counters: dict[tuple, float], minute_fields: dict[str, int], *, at: float) -> None:
        minute = int(at // 60)
        with self._lock:
            for key, value in counters.items():
                self._counters[key] = self._counters.get(key, 0) + value
            for name, value in minute_fields.items():
                if value:
                    self._minutes[minute, name] = self._minutes.get((minute, name), 0) + value
        if self._pid != os.getpid():
            self._start()

    def _start(self) -> None:
        self._pid = os.getpid()
        threading.Thread(target=self._run, name="metrics-flush", daemon=True).start()

    def _run(self) -> None:
        pid = self._pid
        while self._pid == pid:
            self._wake.wait(settings.PORTAL_METRICS_FLUSH_S)
            self._wake.clear()
            self.flush()

    def flush(self) -> bool:
        """Add the deltas to Redis; on failure keep them for the next try. True if all went."""
        with self._sending:
            return self._flush()

    def _flush(self) -> bool:
        with self._lock:
            counters, self._counters = self._counters, {}
            minutes, self._minutes = self._minutes, {}
        if not counters and not minutes:
            return True
        keys = redis_keys()
        try:
            with client().pipeline(transaction=False) as pipe:
                for key, value in counters.items():
                    if isinstance(value, float):
                        pipe.hincrbyfloat(keys.metrics_counters, encode_field(key), value)
                    else:
                        pipe.hincrby(keys.metrics_counters, encode_field(key), value)
                for minute in {m for m, _ in minutes}:
                    pipe.expire(keys.metrics_minute(minute), MINUTE_TTL_S)
                for (minute, name), value in minutes.items():
                    pipe.hincrby(keys.metrics_minute(minute), name, value)
                pipe.execute()
        except redis.RedisError as error:
            self._requeue(counters, minutes, error)
            return False
        self._failing_since = None
        return True

    def _requeue(self, counters: dict, minutes: dict, error: Exception) -> None:
        oldest = int(time.time() // 60) - MINUTE_TTL_S // 60
        with self._lock:
            for key, value in counters.items():
                self._counters[key] = self._counters.get(key, 0) + value
            for key, value in minutes.items():
                if key[0] >= oldest:  # a minute past the dashboard's window is not worth keeping
                    self._minutes[key] = self._minutes.get(key, 0) + value
        if self._failing_since is None:  # log once per outage, not once per second
            self._failing_since = time.time()
            log.warning("metrics not flushed to Redis (kept in memory, retrying): %s", error)


recorder = Recorder()
atexit.register(recorder.flush)
os.register_at_fork(after_in_child=recorder._reset)


def _histogram(counters: dict, family: str, model: str, seconds: float, buckets: tuple) -> None:
    counters[family, model, "b", bisect.bisect_left(buckets, seconds)] = 1
    counters[family, model, "sum"] = seconds
    counters[family, model, "count"] = 1


def gateway_request_ended(
    *,
    endpoint: str,
    model: str,
    status: str,
    http_status: int,
    error_code: str = "",
    duration_s: float | None = None,
    ttft_s: float | None = None,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    at: float | None = None,
) -> None:
    """Count one gateway request at its end (in memory: no I/O here)."""
    if error_code in UNROUTED_CODES:
        model = ""
    counters: dict[tuple, float] = {(REQUESTS, model, endpoint, status, str(http_status)): 1}
    if prompt_tokens:
        counters[TOKENS, model, "prompt"] = prompt_tokens
    if completion_tokens:
        counters[TOKENS, model, "completion"] = completion_tokens
    if status in UNBILLED_STATUSES:  # answered by the gateway itself, refusal or outage: by its code
        counters[REJECTIONS, error_code or str(http_status)] = 1
    elif status in UPSTREAM_STATUSES and error_code != "internal_error":
        counters[UPSTREAM_ERRORS, model, error_code or str(http_status)] = 1
    if duration_s is not None:
        _histogram(counters, DURATION, model, float(duration_s), DURATION_BUCKETS)
    if ttft_s is not None:
        _histogram(counters, TTFT, model, float(ttft_s), TTFT_BUCKETS)
    recorder.add(
        counters,
        {
            "requests": 1,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            # An outage (no replica serving) is an error to operators, never a refusal (issue 38).
            "errors": 1 if status in UPSTREAM_STATUSES or status == UsageStatus.UNAVAILABLE else 0,
            "rejected": 1 if status == UsageStatus.REJECTED else 0,
        },
        at=time.time() if at is None else at,
    )


def exchange_ended(exchange, status: UsageStatus, http_status: int, error_code: str) -> None:
    """`gateway_request_ended` for a gateway Exchange (portal/gateway/usage.py). Never raises: the
    exchange's own finish (slots, usage record) must run whatever happens here."""
    try:
        gateway_request_ended(
            endpoint=exchange.endpoint,
            model=exchange.model,
            status=status,
            http_status=http_status,
            error_code=error_code,
            duration_s=time.perf_counter() - exchange.started_mono,
            ttft_s=exchange.ttft_ms / 1000 if exchange.ttft_ms is not None else None,
            prompt_tokens=exchange.prompt_tokens if status not in UNBILLED_STATUSES else 0,
            completion_tokens=exchange.completion_tokens,
        )
    except Exception:
        log.exception("gateway request not counted")


def unauthenticated(endpoint: str, error) -> None:
    """A request refused before it had a caller (401 bad or missing key): no usage record exists."""
    try:
        gateway_request_ended(
            endpoint=endpoint,
            model="",
            status=UsageStatus.REJECTED,
            http_status=error.status,
            error_code=error.code,
        )
    except Exception:
        log.exception("gateway request not counted")


def celery_task_outcome(task: str, outcome: str) -> None:
    """Count a task's outcome in Redis at once: tasks are rare next to requests, and a worker's child
    process may exit right after its task (a buffered count would go with it)."""
    try:
        client().hincrby(redis_keys().metrics_counters, encode_field((CELERY, task, outcome)), 1)
    except redis.RedisError as error:
        log.warning("task outcome %s %s not counted: %s", task, outcome, error)


def minute_max(name: str, value: int, *, at: float | None = None) -> None:
    """Keep the largest sample of a minute (several beat ticks and several models per minute)."""
    minute = int((time.time() if at is None else at) // 60)
    key = redis_keys().metrics_minute(minute)
    call = MinuteMaxCall(minute=key, name=name, value=value, ttl_s=MINUTE_TTL_S)
    client().eval(MINUTE_MAX, len(call.keys()), *call.keys(), *call.args())
