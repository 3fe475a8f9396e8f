"""Step 6: account. Every request that got past authentication ends here exactly once.

`Exchange.finish` leaves the request's slots, corrects its token reservation and
queues its usage record (`portal/teams/usage_record.py`, the one shape both ends share) in one
Redis script (no database write on the request path); `portal.teams.tasks.usage_flush` moves
records into the database in batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asgiref.sync import sync_to_async
from django.db import Error as DatabaseError
from django.db import close_old_connections

from portal.gateway.admission.leases import LeaseKeeper
from portal.gateway.admission.limiter import RateLimiter
from portal.gateway.admission.records import Admission, Scope
from portal.observability import prometheus
from portal.teams import selectors
from portal.teams.models import UNBILLED_STATUSES, PriorityClass, UsageStatus
from portal.teams.usage_record import UsageRecord

from .auth import Caller

if TYPE_CHECKING:
    from .upstream import UpstreamResponse
from .errors import database_unavailable

log = logging.getLogger("portal.gateway")


def _billed_on_day(kind: str, id: int | str, day: int) -> int:
    close_old_connections()  # the gateway handler sends no request signals (gateway/asgi.py)
    return selectors.tokens_billed_on_day(kind=kind, id=int(id), day=day)


async def tokens_billed_on_day(kind: str, id: int | str, day: int) -> int:
    """A team's or key's tokens of one UTC day, from the database: how a daily counter that Redis
    lost (a restart) or never had (the day's first request) is rebuilt before admission counts on it."""
    try:
        return await sync_to_async(_billed_on_day)(kind, id, day)
    except DatabaseError:
        raise database_unavailable() from None


@dataclass
class Exchange:
    """What the gateway knows about one request, from authentication to the last byte."""

    request_id: str
    endpoint: str
    limiter: RateLimiter
    keeper: LeaseKeeper
    started: float = field(default_factory=time.time)
    started_mono: float = field(default_factory=time.perf_counter)
    caller: Caller | None = None
    team: Scope | None = None
    key: Scope | None = None
    model: str = ""
    stream: bool = False
    admission: Admission | None = None
    placed: bool = False  # it got a replica slot; before that, nothing ran and nothing is billed
    deployment_id: int | None = None  # the replica whose slot it holds now (None once it left one)
    # The last replica it was sent to: a request that failed on every replica is recorded against
    # the last one, so production error rates (and a rollout's verdict) see upstream errors.
    tried_deployment_id: int | None = None
    replica_slots: int = 1  # slots held on the replica: one per prompt of a batch
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float | None = None
    finished: bool = False
    leases: list[tuple[list[str], str]] = field(default_factory=list)  # (zsets, member) renewed
    upstream: UpstreamResponse | None = None  # the open UpstreamResponse, closed when the exchange finishes
    # The most the upstream's usage may bill (`bill_upstream`): the prompt's ceiling (its count, or
    # its body's bytes if more: a tokenizer's token covers at least one byte) and the output's
    # (max_tokens of every sequence). 0 until admission knows them: nothing is bounded yet.
    prompt_ceiling: int = 0
    completion_ceiling: int = 0
    replica_name: str = ""  # the replica answering now, named when its usage numbers are refused
    usage_doubted: bool = False  # an upstream's usage was out of bounds (logged once per request)
    answer_deadline: float = 0.0  # loop time by which a whole (non-streamed) answer must be in
    opened: bool = False  # its `interrupted` record may wait in Redis (`open_record`) until it finishes
    _stopped: bool = False  # its slots are no longer renewed and upstream is closed (`_stop`)
    _reply: Awaitable[None] | None = None  # the finish script's reply, when `finish_soon` sent it
    # False for a batch line (gateway/internal.py): its one usage row is written with the line's
    # result, in one transaction, so no record is queued here, not even an `interrupted` one.
    record_usage: bool = True
    outcome: tuple[UsageStatus, int, str] | None = None  # (status, HTTP status, error code) once finished

    def admitted(self, admission: Admission) -> None:
        """Known before the request queues, so a client leaving the queue still gets its slots
        released and its reservation refunded by `finish`; and its team's and key's concurrency
        slots are renewed from now on, while it waits in the queue too (a batch request waits far
        longer than one lease)."""
        self.admission = admission
        scopes = [s for s in (self.team, self.key) if s is not None and s.limits.max_concurrent]
        if scopes:
            self.hold([self.limiter.concurrency_key(s) for s in scopes])
        if self.opened:  # its open record's lease, written with the admission
            self.hold([self.limiter.open_leases_key()])

    def hold(self, zsets: list[str], members: list[str] | None = None) -> None:
        for member in members or [self.request_id]:
            self.leases.append((zsets, member))
            self.keeper.hold(zsets, member)

    async def let_go(self, zsets: list[str], members: list[str] | None = None) -> None:
        """Stop renewing these slots, then wait out a renewal in flight, which could put them back:
        call before removing them from Redis."""
        for member in members or [self.request_id]:
            self.keeper.drop(zsets, member)
        await self.keeper.settled()

    def bill_upstream(self, usage: object, *, completion_estimate: int | None = None) -> None:
        """Take the upstream's `usage` object as what is billed, within bounds: 0 ≤ each count ≤
        its ceiling. A count that is not a whole number (a string, a list, a negative) is not
        believed: the prompt keeps the gateway's own count, the completion its `completion_estimate`
        (events streamed) or, with none, its ceiling. A breach is logged once per request."""
        usage = usage if isinstance(usage, dict) else {}
        prompt = self._bounded("prompt_tokens", usage.get("prompt_tokens"), self.prompt_ceiling)
        if prompt:  # absent or 0: the gateway's own count stands
            self.prompt_tokens = prompt
        completion = self._bounded(
            "completion_tokens", usage.get("completion_tokens"), self.completion_ceiling
        )
        if completion is None:
            if completion_estimate is not None:
                completion = completion_estimate
            elif "completion_tokens" in usage and usage["completion_tokens"] is not None:
                completion = self.completion_ceiling  # a broken count of an answer that did run
            else:
                completion = 0
            if self.completion_ceiling:
                completion = min(max(completion, 0), self.completion_ceiling)
        self.completion_tokens = max(completion, 0)

    def _bounded(self, name: str, value: object, ceiling: int) -> int | None:
        """`value` as a count in [0, ceiling] (ceiling 0: unbounded above); None if absent or no count."""
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            self._doubt(name, value)
            return None
        if ceiling and value > ceiling:
            self._doubt(name, value)
            return ceiling
        return value

    def _doubt(self, name: str, value: object) -> None:
        if self.usage_doubted:
            return
        self.usage_doubted = True
        log.warning(
            "gateway request %s: replica %s reported %s=%.40r, out of bounds; billed within what it reserved",
            self.request_id,
            self.replica_name or self.tried_deployment_id,
            name,
            value,
        )

    def mark_first_byte(self) -> None:
        self.ttft_ms = (time.perf_counter() - self.started_mono) * 1000

    def open_record(self, *, reserved_tokens: int) -> str:
        """The record this request leaves in Redis if this process dies before `finish` (JSON): an
        `interrupted` one billing its reservation (`reserved_tokens`, its prompt's count included),
        which the daily counters then still hold. The admission script writes it with the
        reservation, under a lease renewed with the request's slots; the usage flush queues it
        once the lease lapsed (docs/concurrency.md, "Requests whose gateway process died"); `finish`
        forgets it in its own script. No Redis call of its own, none per chunk."""
        if not self.record_usage:
            return ""  # the admission script opens no record
        record = self._record(UsageStatus.INTERRUPTED, 500, "gateway_interrupted")
        completion = max(0, reserved_tokens - self.prompt_tokens)
        # Sent: the script may write it even if its reply is lost, so `finish` forgets it whatever comes.
        self.opened = True
        return dataclasses.replace(record, completion_tokens=completion, duration_ms=0.0).to_json()

    async def finish(self, status: UsageStatus, http_status: int, error_code: str = "") -> None:
        """Close upstream, leave the slots, correct tokens, queue the record: once, and whole.

        Shielded: a cancellation arriving meanwhile (the client left at the last moment) is
        raised to the caller, but cannot cut these steps half way."""
        if self.finished:
            return
        self.finished = True
        self.outcome = (status, http_status, error_code)
        await asyncio.shield(self._finish(status, http_status, error_code))

    def finish_soon(self, status: UsageStatus, http_status: int, error_code: str = "") -> None:
        """Start `finish` now, without yielding, when nothing must be waited for first (no lease
        renewal in flight): its script is written to Redis before this returns, so whatever this
        process sends later (a stream's end, then the client's next request) reaches Redis after
        it, and a client that has the whole stream never finds its slots still taken. `finish`
        then only awaits the reply (RelayStream calls it after the response's end)."""
        if self.finished or self._reply is not None or self.keeper.renewing():
            return
        try:
            self._stop(status, http_status, error_code)
            self._reply = self._send(status, http_status, error_code)
        except Exception:
            log.exception("request %s could not start its accounting", self.request_id)

    async def _finish(self, status: UsageStatus, http_status: int, error_code: str) -> None:
        reply = self._reply
        try:
            if not self._stopped:
                self._stop(status, http_status, error_code)
                # A renewal sent before the drop must not re-add what finish removes.
                await self.keeper.settled()
                reply = self._send(status, http_status, error_code)
            if reply is not None:
                await reply
        except Exception:
            # Redis unreachable: the slots expire with their leases; the record is lost, so say so.
            log.exception(
                "usage not recorded for request %s (team %s)",
                self.request_id,
                getattr(self.caller, "team_slug", "?"),
            )

    def _stop(self, status: UsageStatus | None = None, http_status: int = 0, error_code: str = "") -> None:
        """Count the request, stop renewing its slots, close upstream: what finishing does without Redis."""
        self._stopped = True
        if status is not None:
            self.outcome = (status, http_status, error_code)
            prometheus.exchange_ended(self, status, http_status, error_code)  # in memory; flushed later
        for zsets, member in self.leases:
            self.keeper.drop(zsets, member)
        if self.upstream is not None:
            # Closing a half-read response drops its connection: vLLM sees the disconnect and aborts.
            with contextlib.suppress(Exception):
                self.upstream.close()

    def _send(self, status: UsageStatus, http_status: int, error_code: str) -> Awaitable[None] | None:
        """The finish script, written now when the limiter's connection is open; its reply to await
        (None: nothing to record, the request never got past authentication)."""
        if self.caller is None:
            return None
        record = self._record(status, http_status, error_code)
        billed = self.placed and status not in UNBILLED_STATUSES
        used = self.prompt_tokens + self.completion_tokens if billed else 0
        return self.limiter.start_finish(
            request_id=self.request_id,
            team=self.team,
            key=self.key,
            admission=self.admission,
            used_tokens=used,
            deployment_id=self.deployment_id,
            # The limiter (no portal types) takes JSON-ready data; none: not queued (a batch line).
            usage=record.to_dict() if self.record_usage else None,
            replica_slots=self.replica_slots,
            close_open=self.opened,  # in the same script, after its own record is queued
        )

    def usage_record(self) -> UsageRecord:
        """The record of a finished exchange (what `finish` queued, or would have)."""
        assert self.outcome is not None, "the exchange has not finished"
        return self._record(*self.outcome)

    def _record(self, status: UsageStatus, http_status: int, error_code: str) -> UsageRecord:
        caller = self.caller
        assert caller is not None  # recorded only once authenticated
        return UsageRecord(
            request_id=uuid.UUID(self.request_id),
            created_at=dt.datetime.fromtimestamp(self.started, tz=dt.UTC),
            team_id=caller.team_id,
            api_key_id=caller.key_id,
            model=self.model,
            deployment_id=self.tried_deployment_id,  # deployment_id, or the last replica it left
            endpoint=self.endpoint,
            priority_class=PriorityClass(caller.priority_class),
            stream=self.stream,
            status=status,
            http_status=http_status,
            error_code=error_code,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            ttft_ms=self.ttft_ms,
            duration_ms=(time.perf_counter() - self.started_mono) * 1000,
        )
