"""The bindings of room retention: the statements of retention: batches of old terminal rows, its
pause and its passes (``pgwork/sql/queries/retention.sql``), one typed function each."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from psycopg.rows import (
    class_row,
)

from ..queries import Q
from ._bind import Conn, _exec, _one, _value


async def retention_paused(conn: Conn) -> bool:
    return await _value(conn, "retention_paused", bool)


async def retention_set_paused(conn: Conn, *, paused: bool) -> None:
    await _exec(conn, "retention_set_paused", {"paused": paused})


@dataclass(frozen=True)
class Batch:
    scanned: int
    deleted: int
    ledger_deleted: int
    retired: int
    #: Series tombstones deleted: their deadline is two days past (no edit can bring it back).
    pruned: int
    last_at: datetime | None
    last_id: int | None


async def retention_delete_batch(
    conn: Conn,
    *,
    done_before: datetime,
    dead_before: datetime,
    after_at: datetime | None,
    after_id: int,
    limit: int,
    statement_timeout: str,
    lock_timeout: str,
) -> Batch:
    """One batch in its own transaction, under its own statement and lock timeouts (batch_limits,
    sent in the same round trip)."""
    params = {
        "done_before": done_before,
        "dead_before": dead_before,
        "after_at": after_at,
        "after_id": after_id,
        "limit": limit,
    }
    limits = {"statement_timeout": statement_timeout, "lock_timeout": lock_timeout}
    async with conn.pipeline(), conn.transaction():
        await conn.execute(Q["batch_limits"], limits)
        await conn.execute(Q["retention_lock"])
        cur = conn.cursor(row_factory=class_row(Batch))
        await cur.execute(Q["retention_delete_batch"], params)
    got = await cur.fetchall()
    if len(got) != 1:
        raise RuntimeError(f"retention_delete_batch: expected one row, got {len(got)}")
    return got[0]


async def retention_record_pass(conn: Conn, *, deleted: int, record_every: timedelta) -> None:
    await _exec(conn, "retention_record_pass", {"deleted": deleted, "record_every": record_every})


@dataclass(frozen=True)
class RetentionState:
    last_pass_at: datetime | None
    last_deleted: int
    total_deleted: int
    paused: bool
    oldest_terminal_age_seconds: float | None


async def retention_state(conn: Conn) -> RetentionState:
    return await _one(conn, "retention_state", RetentionState)


async def retention_backlog(
    conn: Conn, *, done_before: datetime, dead_before: datetime, limit: int
) -> int:
    """Terminal rows past their keep, counted up to ``limit``."""
    return await _value(
        conn,
        "retention_backlog",
        int,
        {"done_before": done_before, "dead_before": dead_before, "limit": limit},
    )
