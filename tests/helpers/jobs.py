"""A worker that stalls mid-job past its lease: the job runs on a thread and its Nth fenced write
(portal/core/jobs) waits on an event until the test lets it go on. No sleeps: the test waits for
`paused`, for the lease to lapse, lets a second worker take over, then calls `resume`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.db import connection
from django.utils import timezone

from devtools import wait_until
from portal.core.jobs.lease import Lease, before_fenced_writes


class StalledWorker:
    """Run `job(worker=name)` on a thread; its `pause_at`-th fenced write that `pause_when(fields)`
    accepts (the names of the fields written; empty for a `fenced()` block) waits for `resume()`.

    After resuming, `writes_after_resume` counts the fenced writes it still attempted (the first
    one is refused: the worker lost its lease), `result` is what the job returned and `error`
    what it raised.
    """

    def __init__(
        self,
        name: str,
        job: Callable[..., Any],
        *,
        pause_at: int = 1,
        pause_when: Callable[[frozenset[str]], bool] = lambda fields: True,
    ) -> None:
        self.name, self.job, self.pause_at, self.pause_when = name, job, pause_at, pause_when
        self.matched = 0
        self.paused = threading.Event()
        self._resume = threading.Event()
        self.writes = 0
        self.writes_after_resume = 0
        self.lease: Lease | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"stalled-{name}", daemon=True)
        self._hooked = before_fenced_writes(self._hook)

    def _hook(self, lease: Lease, fields: frozenset[str]) -> None:
        if lease.owner != self.name:
            return
        self.writes += 1
        if self._resume.is_set():
            self.writes_after_resume += 1
            return
        if self.paused.is_set() or not self.pause_when(fields):
            return
        self.matched += 1
        if self.matched == self.pause_at:
            self.lease = lease
            self.paused.set()
            self._resume.wait(timeout=300)

    def _run(self) -> None:
        try:
            self.result = self.job(worker=self.name)
        except BaseException as error:  # reported to the test, which asserts on it
            self.error = error
        finally:
            connection.close()

    def start_and_wait_stalled(self, *, timeout_s: float = 120, lapse: bool = True) -> Lease:
        """Start the job and wait until it is stalled; then (with `lapse`) until its lease lapsed."""
        self._hooked.__enter__()
        self._thread.start()
        wait_until(
            lambda: self.paused.is_set() or not self._thread.is_alive(),
            what=f"{self.name} stalled at fenced write {self.pause_at}",
            timeout_s=timeout_s,
        )
        assert self.paused.is_set(), f"{self.name} ended before write {self.pause_at}: {self.error!r}"
        lease = self.lease
        if not lapse:
            return lease
        model = lease.model
        wait_until(
            lambda: model.objects.filter(pk=lease.target_id, lease_expires_at__lt=timezone.now()).exists(),
            what=f"the lease of {self.name} to lapse",
            timeout_s=lease.ttl_s + 30,
        )
        return lease

    def resume(self, *, timeout_s: float = 120) -> None:
        """Let the stalled worker go on and wait for its job to end."""
        self._resume.set()
        self._thread.join(timeout_s)
        self._hooked.__exit__(None, None, None)
        assert not self._thread.is_alive(), f"{self.name} did not end within {timeout_s:g} s"

    def close(self) -> None:
        """Never leave a paused thread behind a failed test."""
        if not self._resume.is_set():
            self._resume.set()
            self._thread.join(30)
            self._hooked.__exit__(None, None, None)
