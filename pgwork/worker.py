"""Claim/deliver duty: per channel, claim due rows with SKIP LOCKED in short transactions,
deliver outside any transaction, and hand the outcome to the outcome writer."""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from anyio.abc import TaskGroup
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from .channels import Channel, Delivered, Delivery, Failed, Outcome, Retry
from .config import RetryPolicy
from .db import fetch_all, fetch_one
from .metrics import Metrics
from .outcomes import OutcomeWriter, Record
from .supervise import Next
from .waker import Waker

log = logging.getLogger("pgwork.worker")


def backoff_delay(policy: RetryPolicy, attempt: int) -> float:
    """Full jitter: a random delay in [0, min(cap, base * 2**(attempt-1))]."""
    ceiling = min(policy.cap, policy.base * 2 ** min(attempt - 1, 60))
    return random.uniform(0, ceiling)


def decide(
    outcome: Outcome, attempts_used: int, policy: RetryPolicy
) -> tuple[str, str, float | None, str | None]:
    """(ledger outcome, new status, retry delay, error) for an attempt's outcome.
    ``attempts_used`` counts this attempt, relative to the last redrive."""
    if isinstance(outcome, Delivered):
        return ("duplicate" if outcome.duplicate else "delivered"), "delivered", None, None
    if isinstance(outcome, Failed):
        return "failed", "dead", None, f"permanent failure: {outcome.error}"
    if attempts_used >= policy.max_attempts:
        return (
            "retry",
            "dead",
            None,
            f"attempt budget spent ({attempts_used} attempts); last error: {outcome.error}",
        )
    delay = outcome.delay if outcome.delay is not None else backoff_delay(policy, attempts_used)
    return "retry", "ready", delay, outcome.error


@dataclass
class Held:
    """A row this daemon holds: claimed, outcome not yet durable."""

    work_id: int
    lease: int
    channel: str


class Leases:
    """The rows this daemon holds, for heartbeats and for release on shutdown."""

    def __init__(self) -> None:
        self.held: dict[int, Held] = {}

    def add(self, h: Held) -> None:
        self.held[h.work_id] = h

    def drop(self, work_id: int) -> None:
        self.held.pop(work_id, None)


class ChannelWorker:
    def __init__(
        self,
        channel: Channel,
        pool: AsyncConnectionPool[AsyncConnection[Any]],
        writer: OutcomeWriter,
        leases: Leases,
        metrics: Metrics,
        *,
        daemon_id: str,
        lease: float,
        claim_batch: int,
        tick: float,
    ) -> None:
        self.channel = channel
        self.name = channel.config.name
        self.policy = channel.config.retry
        self.capacity = channel.config.concurrency
        self.pool = pool
        self.writer = writer
        self.leases = leases
        self.metrics = metrics
        self.daemon_id = daemon_id
        self.lease = lease
        self.claim_batch = claim_batch
        self.tick = tick
        self.waker = Waker()
        self.in_flight = 0
        self.tg: TaskGroup | None = None

    async def claim_step(self) -> Next:
        """Claim as many rows as there is free capacity for (at most one batch) and start them."""
        assert self.tg is not None
        free = self.capacity - self.in_flight
        if free <= 0:
            return Next(math.inf, "slot")  # a finishing delivery wakes us
        limit = min(free, self.claim_batch)
        async with self.pool.connection() as conn:
            rows = await fetch_all(
                conn,
                "claim_work",
                {
                    "channel": self.name,
                    "limit": limit,
                    "max_attempts": self.policy.max_attempts,
                    "lease": timedelta(seconds=self.lease),
                    "daemon_id": self.daemon_id,
                },
            )
            if len(rows) < limit:
                nxt = (await fetch_one(conn, "next_available", {"channel": self.name}))["at"]
            else:
                nxt = None
        for row in rows:
            if row["prev_status"] == "claimed":
                self.metrics.lease_reclaims.labels(self.name).inc()
                log.warning(
                    "reclaimed a row whose lease expired",
                    extra={
                        "work_id": row["id"],
                        "channel": self.name,
                        "attempt": row["attempts"],
                        "operation_id": str(row["operation_id"]),
                    },
                )
            if row["status"] != "claimed":
                self.metrics.closed_at_claim.labels(self.name, row["status"]).inc()
                log.info(
                    "closed at claim instead of sending: %s",
                    row["status"],
                    extra={
                        "work_id": row["id"],
                        "channel": self.name,
                        "outcome": row["status"],
                        "operation_id": str(row["operation_id"]),
                    },
                )
                continue
            self.metrics.claimed.labels(self.name).inc()
            self.leases.add(Held(row["id"], row["lease"], self.name))
            self.in_flight += 1
            self.tg.start_soon(self._deliver, row)
        self.metrics.in_flight.labels(self.name).set(self.in_flight)
        if len(rows) == limit:
            return Next(0, "more")
        if nxt is None:
            return Next(self.tick, "tick")
        wait = (nxt - datetime.now(UTC)).total_seconds()
        return Next(max(0.0, min(self.tick, wait)), "timer" if wait < self.tick else "tick")

    async def _deliver(self, row: dict[str, Any]) -> None:
        d = Delivery(
            work_id=row["id"],
            operation_id=row["operation_id"],
            source=row["source"],
            business_key=row["business_key"],
            deadline=row["deadline"],
            occurrence=row["occurrence"],
            due_at=row["due_at"],
            channel=self.name,
            recipient=row["recipient"],
            payload=row["payload"],
            attempt=row["attempts"],
        )
        started = datetime.now(UTC)
        t0 = time.monotonic()
        try:
            try:
                outcome = await self.channel.deliver(d)
            except Exception as e:  # a channel bug or a receiver problem: retry with backoff
                outcome = Retry(
                    error=f"{type(e).__name__}: {e}"[:500], error_class=type(e).__name__
                )
            elapsed = time.monotonic() - t0
            finished = datetime.now(UTC)
            used = row["attempts"] - row["attempts_base"]
            ledger, status, delay, error = decide(outcome, used, self.policy)
            rec = Record(
                work_id=d.work_id,
                lease=row["lease"],
                attempt=row["attempts"],
                channel=self.name,
                outcome=ledger,
                status=status,
                retry_after=delay,
                started_at=started,
                finished_at=finished,
                http_status=outcome.http_status,
                error_class=None if isinstance(outcome, Delivered) else outcome.error_class,
                error=error,
                receipt=outcome.receipt if isinstance(outcome, Delivered) else None,
            )
            accepted = await self.writer.record(rec)
            # Durable now: this row is no longer ours to heartbeat or release.
            self.leases.drop(d.work_id)
            self.metrics.delivery_duration.labels(self.name).observe(elapsed)
            self.metrics.attempts.labels(self.name, ledger if accepted else "fenced").inc()
            if accepted and status == "delivered":
                self.metrics.lateness.labels(self.name).observe(
                    max(0.0, (finished - d.due_at).total_seconds())
                )
                if ledger == "duplicate":
                    self.metrics.duplicates.labels(self.name).inc()
            level = logging.INFO if status != "dead" else logging.WARNING
            log.log(
                level,
                "attempt %s",
                ledger if accepted else "fenced",
                extra={
                    "work_id": d.work_id,
                    "operation_id": str(d.operation_id),
                    "source": d.source,
                    "business_key": d.business_key,
                    "channel": self.name,
                    "attempt": d.attempt,
                    "outcome": ledger if accepted else "fenced",
                    "status": status,
                    "duration_ms": round(elapsed * 1000, 2),
                    "http_status": outcome.http_status,
                    **({"error": error} if error else {}),
                    **({"retry_in_s": round(delay, 3)} if delay is not None else {}),
                },
            )
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.labels(self.name).set(self.in_flight)
            self.waker.wake("slot")


async def heartbeat_step(
    pool: AsyncConnectionPool[AsyncConnection[Any]], leases: Leases, lease: float
) -> set[int]:
    """Extend the lease of every row still held; returns the ids no longer ours (fenced)."""
    held = list(leases.held.values())
    if not held:
        return set()
    async with pool.connection() as conn:
        rows = await fetch_all(
            conn,
            "extend_leases",
            {
                "work_id": [h.work_id for h in held],
                "lease_no": [h.lease for h in held],
                "lease": timedelta(seconds=lease),
            },
        )
    kept = {r["id"] for r in rows}
    lost = {h.work_id for h in held} - kept
    # A row whose outcome became durable meanwhile was dropped from `leases`; only the rest are lost.
    return {i for i in lost if i in leases.held}


async def release_all(
    pool: AsyncConnectionPool[AsyncConnection[Any]], leases: Leases, identity: tuple[str, str, int]
) -> int:
    """Give back every row still held, without counting the attempt. Returns how many."""
    held = list(leases.held.values())
    if not held:
        return 0
    daemon_id, host, pid = identity
    async with pool.connection() as conn:
        rows = await fetch_all(
            conn,
            "release_leases",
            {
                "work_id": [h.work_id for h in held],
                "lease_no": [h.lease for h in held],
                "daemon_id": daemon_id,
                "host": host,
                "pid": pid,
            },
        )
    for h in held:
        leases.drop(h.work_id)
    return len(rows)
