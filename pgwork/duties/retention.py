"""Retention duty: delete old terminal work and its ledger rows in keyset-paged, bounded batches.

Never a row that can still be claimed or retried (the status filter is in the DELETE), and never
in a way that lets a reminder be sent twice: the materialiser inserts only occurrences past the
reminder's progress (``next_fire_at``), and a delivered or dead occurrence of a reminder that
still exists leaves a tombstone (``pgwork.retired``) that the materialiser honours even after a
reschedule brings the same deadline back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from datetime import datetime, timedelta
from typing import Any

import anyio
from anyio.abc import TaskStatus
from psycopg import AsyncConnection, errors

from .. import db, store
from ..config import RetentionPolicy
from ..durations import format_duration
from ..metrics import Metrics
from ..supervise import Next, Supervisor

#: A pass that deleted nothing is recorded (pgwork.retention_state: what status and the web page
#: show as its last pass) only when the last record is older than this: an idle database is not
#: written to on every pass. The daemon's own gauge (pgwork_retention_last_pass_timestamp_seconds)
#: counts every pass.
IDLE_RECORD_EVERY = timedelta(minutes=10)
log = logging.getLogger("pgwork.retention")


@dataclass(frozen=True)
class RetentionResult:
    deleted: int
    ledger_deleted: int
    batches: int
    timeouts: int
    longest_batch: float
    largest_batch: int
    paused: bool
    #: The pass gave up: batches of the smallest size kept timing out (e.g. a row locked for long).
    stalled: bool
    duration: float


class Retention:
    #: Consecutive timeouts at the smallest batch size before a pass gives up (until the next one).
    STALL_AFTER = 5

    def __init__(self, policy: RetentionPolicy, metrics: Metrics | None = None) -> None:
        self.policy = policy
        self.metrics = metrics
        self.batch = policy.batch_size
        #: Since when (monotonic) a lock another session holds has stopped every pass.
        self.locked_since: float | None = None

    async def run_once(
        self,
        conn: AsyncConnection[Any],
        progress: Callable[[], None] | None = None,
        *,
        summary: bool = True,
    ) -> RetentionResult:
        """One pass over everything past its keep, batch by batch (each its own transaction).
        ``progress`` is called after every batch that completed (health: a long pass over a large
        backlog is not a stuck one). ``summary``: log what the pass did (`pgwork cleanup` says it
        itself, once)."""
        t0 = time.monotonic()
        now = await store.db_now(conn)
        done_before = now - timedelta(seconds=self.policy.keep)
        dead_before = now - timedelta(seconds=self.policy.dead_keep)
        after_at: datetime | None = None
        after_id = 0
        deleted = ledger = batches = timeouts = 0
        longest = 0.0
        largest = 0
        paused = stalled = locked = False
        in_a_row = 0
        while True:
            if await store.retention_paused(conn):
                paused = True
                break
            limit = self.batch
            b0 = time.monotonic()
            try:
                page = await store.retention_delete_batch(
                    conn,
                    done_before=done_before,
                    dead_before=dead_before,
                    after_at=after_at,
                    after_id=after_id,
                    limit=limit,
                    # Each batch is bounded in time and in how long it may wait for a lock.
                    statement_timeout=f"{int(self.policy.statement_timeout * 1000)}ms",
                    lock_timeout=f"{int(self.policy.lock_timeout * 1000)}ms",
                )
            except (errors.QueryCanceled, errors.LockNotAvailable) as e:
                timeouts += 1
                in_a_row = in_a_row + 1 if limit == self.policy.min_batch else 0
                if in_a_row >= self.STALL_AFTER:
                    stalled = True
                    if isinstance(e, errors.LockNotAvailable):
                        # Another session holds a lock the batches need (an app's LOCK TABLE, a
                        # row held in an open transaction): said once per wait, naming it.
                        locked = True
                        if self.locked_since is None:
                            self.locked_since = time.monotonic()
                            log.warning(
                                "retention waits for a lock another session holds; its passes "
                                "stop there until it goes: %s",
                                store.holders_text(await store.lock_holders(conn))
                                or "(it went meanwhile)",
                                extra={"duty": "retention", "error_class": type(e).__name__},
                            )
                        break
                    log.error(
                        "retention stalled: %d batches of %d rows timed out in a row; giving up this pass",
                        in_a_row,
                        limit,
                        extra={"duty": "retention", "error_class": type(e).__name__},
                    )
                    break
                self.batch = max(self.policy.min_batch, self.batch // 2)
                if self.metrics:
                    self.metrics.retention_timeouts.inc()
                # At debug: a smaller batch may get past a row that is locked, or finish within
                # the timeout; the pass's summary counts the timeouts, and a stall is said.
                log.debug(
                    "retention batch of %d timed out; next batches are %d rows",
                    limit,
                    self.batch,
                    extra={"duty": "retention", "error_class": type(e).__name__},
                )
                await anyio.sleep(self.policy.pause)
                continue
            took = time.monotonic() - b0
            if progress is not None:
                progress()
            longest = max(longest, took)
            largest = max(largest, page.deleted)
            in_a_row = 0
            batches += 1
            deleted += page.deleted
            ledger += page.ledger_deleted
            if self.metrics:
                self.metrics.retention_deleted.inc(page.deleted)
                self.metrics.retention_batch.observe(took)
            self.batch = min(self.policy.batch_size, self.batch + max(1, self.batch // 10))
            if page.scanned < limit:
                break
            after_at, after_id = page.last_at, page.last_id or 0
            await anyio.sleep(self.policy.pause)
        if not locked and self.locked_since is not None:
            log.info(
                "retention goes on: the lock it waited for went after %.0fs",
                time.monotonic() - self.locked_since,
                extra={"duty": "retention"},
            )
            self.locked_since = None
        if not paused and not stalled:
            await store.retention_record_pass(conn, deleted=deleted, record_every=IDLE_RECORD_EVERY)
        duration = time.monotonic() - t0
        if summary and (deleted or (timeouts and not stalled)):
            log.info(
                "retention deleted %d work rows and %d ledger rows",
                deleted,
                ledger,
                extra={
                    "duty": "retention",
                    "rows": deleted,
                    "ledger_rows": ledger,
                    "batches": batches,
                    "timeouts": timeouts,
                    "longest_batch_ms": round(longest * 1000, 1),
                    "keep": format_duration(self.policy.keep),
                },
            )
        return RetentionResult(
            deleted, ledger, batches, timeouts, longest, largest, paused, stalled, duration
        )


@dataclass(eq=False)
class RetentionDuty:
    """The retention duty: a pass every ``interval`` on its own connection (``retention.dsn``
    may name other credentials), with per-batch limits; each batch counts as progress for the
    watchdog, so a pass over a large backlog is never taken for a stuck one."""

    dsn: str
    policy: RetentionPolicy
    sup: Supervisor
    _: KW_ONLY
    interval: float
    connect_timeout: float
    #: Behind a transaction-pooling PgBouncer (see db.connect).
    pooled: bool = False

    def __post_init__(self) -> None:
        self.retention = Retention(self.policy, self.sup.metrics)

    async def step(self) -> Next:
        conn = await db.connect(self.dsn, timeout=self.connect_timeout, pooled=self.pooled)
        try:
            res = await self.retention.run_once(
                conn, progress=lambda: self.sup.health.progress("retention")
            )
        finally:
            await conn.close()
        if not res.paused:
            self.sup.metrics.retention_last_pass.set_to_current_time()
        return Next(self.interval, "tick")

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await self.sup.loop(
            "retention", self.step, first=Next(1.0, "tick"), task_status=task_status
        )
