"""Trends duty: each channel's attempts per minute, where the web page draws them.

The outcome writer hands over every batch it made durable (``count``): its records are counted
by channel, in the minute (by the database's clock) they were recorded. Every ``EVERY`` seconds
the minutes that changed are written, each value whole (``trend_write``: a write repeated after a
lost reply counts nothing twice), and every ``PRUNE_EVERY`` seconds minutes older than
``KEEP_HOURS`` are deleted, ``PRUNE_BATCH`` at a time. A daemon killed loses at most its last
unwritten seconds of trend: the ledger (``pgwork.attempt``) is the record, this is the picture.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import anyio
from anyio.abc import TaskStatus
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from .. import store
from ..clock import Clock
from ..store import ClaimKey
from ..supervise import Next, Supervisor


class Counted(Protocol):
    """What is counted of an outcome (``duties.outcomes.Record`` is one)."""

    channel: str
    outcome: str
    status: str
    #: When the attempt started and finished (monotonic seconds).
    started: float
    finished: float

    @property
    def key(self) -> ClaimKey: ...


log = logging.getLogger("pgwork.trends")


@dataclass
class Minute:
    """One channel's attempts recorded in one minute by this daemon."""

    delivered: int = 0
    failed: int = 0
    dead: int = 0
    fenced: int = 0
    took_sum: float = 0.0
    took_max: float = 0.0


class Trends:
    #: Seconds between writes of the minutes that changed.
    EVERY = 10.0
    #: Minutes older than this many hours are pruned.
    KEEP_HOURS = 48
    PRUNE_EVERY = 3600.0
    PRUNE_BATCH = 5000

    def __init__(
        self,
        pool: AsyncConnectionPool[AsyncConnection[Any]],
        sup: Supervisor,
        daemon_id: str,
        clock: Clock,
    ) -> None:
        self.pool = pool
        self.sup = sup
        self.clock = clock
        #: Whose minutes these are: a restarted daemon (same configured id) writes its own.
        self.written_by = f"{daemon_id}/{secrets.token_hex(3)}"
        self._minutes: dict[tuple[str, int], Minute] = {}
        self._changed: set[tuple[str, int]] = set()
        self._prune_at = time.monotonic() + 60.0

    def count(self, records: Iterable[Counted], fenced: Collection[ClaimKey]) -> None:
        """Count a batch of records once they are durable (``fenced``: those refused as late).
        Per record a few additions: a batch is mostly one channel's, looked up once a run."""
        minute = int(self.clock.epoch(time.monotonic()) // 60 * 60)
        minutes, changed = self._minutes, self._changed
        channel, m = None, Minute()
        for r in records:
            if r.channel != channel:
                channel = r.channel
                key = (channel, minute)
                m = minutes.get(key) or minutes.setdefault(key, Minute())
                changed.add(key)
            if fenced and r.key in fenced:
                m.fenced += 1
                continue
            if r.outcome == "delivered" or r.outcome == "duplicate":
                m.delivered += 1
            else:
                m.failed += 1
                m.dead += r.status == "dead"
            took = r.finished - r.started
            m.took_sum += took
            if took > m.took_max:
                m.took_max = took

    async def write(self) -> int:
        """Write the minutes that changed since the last write; returns how many. Minutes that
        can no longer change (before the current one) are forgotten once written."""
        if not self._changed:
            return 0
        # What is counted from here on (during the write) is the next write's.
        changed, self._changed = self._changed, set()
        minutes = json.dumps(
            [{"channel": c, "minute": t, **asdict(self._minutes[(c, t)])} for c, t in changed]
        )
        try:
            async with self.pool.connection() as conn:
                await store.trend_write(conn, written_by=self.written_by, minutes=minutes)
        except BaseException:
            self._changed |= changed
            raise
        now = int(self.clock.epoch(time.monotonic()) // 60 * 60)
        for key in [k for k in self._minutes if k[1] < now and k not in self._changed]:
            del self._minutes[key]
        return len(changed)

    async def step(self) -> Next:
        await self.write()
        if time.monotonic() >= self._prune_at:
            async with self.pool.connection() as conn:
                gone = await store.trend_prune(
                    conn, keep_hours=self.KEEP_HOURS, limit=self.PRUNE_BATCH
                )
            if gone:
                log.info("pruned %d trend minutes", gone, extra={"duty": "trends", "rows": gone})
            # A full batch: more are left, the next pass prunes again.
            more = gone >= self.PRUNE_BATCH
            self._prune_at = 0.0 if more else time.monotonic() + self.PRUNE_EVERY
        return Next(self.EVERY, "tick")

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await self.sup.loop(
            "trends", self.step, first=Next(self.EVERY, "tick"), task_status=task_status
        )

    async def last_write(self) -> None:
        """At a clean stop: write what is left; a failure is logged, the stop goes on."""
        try:
            with anyio.fail_after(5):
                await self.write()
        except Exception as e:
            log.warning(
                "the last trend minutes were not written: %s",
                e,
                extra={"duty": "trends", "error_class": type(e).__name__},
            )
