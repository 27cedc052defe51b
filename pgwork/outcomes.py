"""Outcome writer: attempt outcomes are written in batches, one statement per flush (group
commit). A delivery counts as done only once its outcome is durable."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import anyio
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from .db import fetch_all
from .metrics import Metrics
from .supervise import Backoff, Health

log = logging.getLogger("pgwork.outcomes")


@dataclass(frozen=True)
class Record:
    """One attempt's outcome, as written to ``renewal_work`` and the attempt ledger."""

    work_id: int
    lease: int
    attempt: int
    channel: str
    outcome: str  # delivered | duplicate | retry | failed
    status: str  # delivered | ready | dead
    retry_after: float | None
    started_at: datetime
    finished_at: datetime
    http_status: int | None = None
    error_class: str | None = None
    error: str | None = None
    receipt: Any = None
    # For settling (metrics and the attempt log line), not written.
    due_at: datetime | None = None
    operation_id: Any = None
    source: str = ""
    business_key: str = ""
    recipient: str = ""
    duration: float = 0.0

    def as_json(self) -> dict[str, Any]:
        """The record for ``record_outcomes`` (absent keys are NULL)."""
        d: dict[str, Any] = {
            "work_id": self.work_id,
            "lease": self.lease,
            "attempt": self.attempt,
            "outcome": self.outcome,
            "status": self.status,
            "started_at": self.started_at.isoformat(),
            "finished_at": self.finished_at.isoformat(),
        }
        if self.retry_after is not None:
            d["retry_after"] = self.retry_after
        if self.http_status is not None:
            d["http_status"] = self.http_status
        if self.error_class is not None:
            d["error_class"] = self.error_class
        if self.error is not None:
            d["error"] = self.error[:2000]
        if self.receipt is not None:
            d["receipt"] = self.receipt
        return d


@dataclass
class _Batch:
    records: list[Record] = field(default_factory=list)
    fenced: set[int] = field(default_factory=set)


class OutcomeWriter:
    #: Most records written by one statement.
    MAX_BATCH = 1000
    #: Flushes under way at once (Postgres commits concurrent flushes with one WAL flush).
    FLUSHES = 2

    def __init__(
        self,
        pool: AsyncConnectionPool[AsyncConnection[Any]],
        metrics: Metrics,
        identity: tuple[str, str, int],
        on_written: Callable[[list[Record], set[int]], None] | None = None,
        health: Health | None = None,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.daemon_id, self.host, self.pid = identity
        self.on_written = on_written
        self.health = health or Health()
        self._current = _Batch()
        self._waiting: list[_Batch] = []
        self._wake = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._writing = 0

    def pending(self) -> int:
        """Outcomes not yet durable: queued, or in a flush under way."""
        return (
            len(self._current.records) + sum(len(b.records) for b in self._waiting) + self._writing
        )

    def submit(self, rec: Record) -> None:
        """Queue ``rec``; it is written with the next flush, and ``on_written`` is called with it
        (and whether it was fenced) once it is durable."""
        batch = self._current
        batch.records.append(rec)
        if len(batch.records) >= self.MAX_BATCH:
            self._waiting.append(batch)
            self._current = _Batch()
        if self._idle.is_set():
            self._idle = anyio.Event()
        self._wake.set()

    def _take(self) -> _Batch | None:
        if self._waiting:
            return self._waiting.pop(0)
        if self._current.records:
            b, self._current = self._current, _Batch()
            return b
        return None

    async def run(self) -> None:
        """Flush whatever is pending at once, with up to ``FLUSHES`` flushes under way (batches
        grow while they are); a failed flush is retried until it succeeds."""
        limiter = anyio.Semaphore(self.FLUSHES)
        async with anyio.create_task_group() as tg:
            while True:
                batch = self._take()
                if batch is None:
                    if not self.pending():
                        self._idle.set()
                    await self._wake.wait()
                    self._wake = anyio.Event()
                    continue
                await limiter.acquire()
                self._writing += len(batch.records)
                tg.start_soon(self._flush, batch, limiter)

    async def _flush(self, batch: _Batch, limiter: anyio.Semaphore) -> None:
        backoff = Backoff()
        try:
            while True:
                self.health.begin(f"outcomes:{id(batch)}")
                try:
                    await self._write(batch)
                except Exception as e:
                    delay = backoff.next()
                    self.metrics.duty_failures.labels("outcomes").inc()
                    log.error(
                        "writing %d outcomes failed; retrying in %.1fs: %s",
                        len(batch.records),
                        delay,
                        e,
                        extra={"duty": "outcomes", "error_class": type(e).__name__},
                    )
                    await anyio.sleep(delay)
                    continue
                finally:
                    self.health.end(f"outcomes:{id(batch)}")
                if backoff.failures:
                    self.metrics.duty_restarts.labels("outcomes").inc()
                break
        finally:
            self._writing -= len(batch.records)
            limiter.release()
        self.metrics.outcomes_pending.set(self.pending())
        if not self.pending():
            self._idle.set()

    async def drain(self) -> None:
        """Wait until everything queued so far is written."""
        while self.pending():
            if self._idle.is_set():
                await anyio.sleep(0.005)
            else:
                await self._idle.wait()

    async def _write(self, batch: _Batch) -> None:
        rs = batch.records
        params = {
            "outcomes": json.dumps([r.as_json() for r in rs], separators=(",", ":")),
            "daemon_id": self.daemon_id,
            "host": self.host,
            "pid": self.pid,
        }
        async with self.pool.connection() as conn:
            rows = await fetch_all(conn, "record_outcomes", params)
        batch.fenced = {r["fenced_id"] for r in rows}
        self.metrics.outcome_flushes.inc()
        for r in rs:
            if r.work_id in batch.fenced:
                self.metrics.fenced.inc()
                log.warning(
                    "late outcome refused: the lease passed to another worker",
                    extra={
                        "work_id": r.work_id,
                        "lease": r.lease,
                        "outcome": r.outcome,
                        "channel": r.channel,
                    },
                )
        if self.on_written is not None:
            self.on_written(rs, batch.fenced)
