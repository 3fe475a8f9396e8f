"""The renewal of this process's leases (concurrency and replica slots, open usage records)."""

from __future__ import annotations

import asyncio
import logging

from .limiter import RateLimiter

log = logging.getLogger("portal.gateway")


class LeaseKeeper:
    """Renews the concurrency leases of this process's live requests, in one batch every
    lease/3, so a long stream keeps its slot and a crashed process's slots expire.

    A renewal puts back a member that lapsed (a failed round, a Redis restart): whatever this
    process still holds is in its sets again within one round. So a member is removed from Redis
    only after `drop` and `settled` (no round in flight could put it back)."""

    def __init__(self, limiter: RateLimiter) -> None:
        self.limiter = limiter
        self.leases: dict[str, set[str]] = {}
        self._task: asyncio.Task | None = None
        self._round: asyncio.Task | None = None

    def hold(self, zsets: list[str], member: str) -> None:
        for zset in zsets:
            self.leases.setdefault(zset, set()).add(member)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def drop(self, zsets: list[str], member: str) -> None:
        for zset in zsets:
            members = self.leases.get(zset)
            if members is not None:
                members.discard(member)
                if not members:
                    del self.leases[zset]

    def renewing(self) -> bool:
        """A renewal round is in flight (`settled` would wait for it)."""
        return self._round is not None and not self._round.done()

    async def settled(self) -> None:
        """Until no renewal round is in flight: one sent before a `drop` could re-add the member."""
        current = self._round
        if current is not None and not current.done():
            await asyncio.wait([current])

    async def _run(self) -> None:
        interval = self.limiter.lease_ms / 3000
        delay = interval
        while self.leases:
            await asyncio.sleep(delay)
            if not self.leases:
                break
            held = {zset: set(members) for zset, members in self.leases.items()}
            self._round = asyncio.ensure_future(self.limiter.renew(held))
            try:
                await self._round
                delay = interval
            except Exception as error:
                # A Redis blip: retry sooner than a whole interval, so no lease lapses for it. Said
                # once per failed round: leases that keep failing lapse, and other processes take the slots.
                log.warning(
                    "lease renewal failed (%d sets held; retrying in %.1f s): %r",
                    len(held),
                    interval / 4,
                    error,
                )
                delay = interval / 4
            finally:
                self._round = None
