"""The binding's plumbing: cursors for named statements, rows as typed records, and the types
every room shares."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from functools import partial
from typing import Any, NamedTuple, TypeAlias, TypeVar
from uuid import UUID

from psycopg import AsyncConnection, AsyncCursor, AsyncRawCursor, Error
from psycopg.pq import TransactionStatus
from psycopg.rows import (
    AsyncRowFactory,
    BaseRowFactory,
    RowMaker,
    class_row,
    dict_row,
    tuple_row,
)

from ..queries import P, Q

Conn = AsyncConnection[Any]


class Status(StrEnum):
    """A work row's status, as pgwork.renewal_work's constraint spells them (a str: rows from
    the database compare equal to these)."""

    READY = "ready"
    CLAIMED = "claimed"
    DELIVERED = "delivered"
    DEAD = "dead"
    CANCELLED = "cancelled"
    SUPERSEDED = "superseded"
    EXPIRED = "expired"


T = TypeVar("T")


def _cursor(conn: Conn, name: str, row_factory: AsyncRowFactory[T]) -> AsyncCursor[T]:
    """A cursor for statement ``name``: a raw one for those converted to ``$n`` at import
    (``queries.P``: too long for psycopg's conversion cache), which ``_execute`` sends as such."""
    if name in P:
        return AsyncRawCursor(conn, row_factory=row_factory)
    return conn.cursor(row_factory=row_factory)


async def _execute(cur: AsyncCursor[Any], name: str, params: dict[str, Any]) -> None:
    """Run statement ``name`` on a cursor made by ``_cursor`` for it."""
    pos = P.get(name)
    if pos is None:
        await cur.execute(Q[name], params)
    else:
        await cur.execute(pos.sql, pos.args(params))


async def _rows(
    conn: Conn, name: str, cls: type[T], params: dict[str, Any] | None = None
) -> list[T]:
    async with _cursor(conn, name, class_row(cls)) as cur:
        await _execute(cur, name, params or {})
        return await cur.fetchall()


NT = TypeVar("NT", bound=tuple[Any, ...])


def _tuple_rows(cls: type[NT]) -> BaseRowFactory[NT]:
    """Rows as the named tuple ``cls``, built positionally. The result's column names are checked
    against the fields once per result, so a statement whose columns drift from the class fails
    at once, naming both, instead of filling fields with the wrong values."""
    expected: tuple[str, ...] = cls._fields  # type: ignore[attr-defined]

    def factory(cur: Any) -> RowMaker[NT]:
        names = _column_names(cur)
        if names != expected:
            raise TypeError(f"{cls.__name__}: the statement returns {names}, not {expected}")
        return partial(tuple.__new__, cls)

    return factory


def _column_names(cur: Any) -> tuple[str, ...]:
    """The current result's column names, read from the result itself (``cur.description``
    builds a Column object per column: a sixth of the page call's client side)."""
    res = cur.pgresult
    if res is None:
        return ()
    return tuple((res.fname(i) or b"").decode() for i in range(res.nfields))


async def _one(conn: Conn, name: str, cls: type[T], params: dict[str, Any] | None = None) -> T:
    got = await _rows(conn, name, cls, params)
    if len(got) != 1:
        raise RuntimeError(f"{name}: expected one row, got {len(got)}")
    return got[0]


async def _value(conn: Conn, name: str, kind: type[T], params: dict[str, Any] | None = None) -> T:
    """The one value (one row, one column) statement ``name`` returns, which must be a ``kind``:
    a count, a flag, a time."""
    got = await _column(conn, name, params)
    if len(got) != 1:
        raise RuntimeError(f"{name}: expected one row, got {len(got)}")
    if not isinstance(got[0], kind):
        raise TypeError(f"{name}: expected a {kind.__name__}, got {got[0]!r}")
    return got[0]


async def _column(conn: Conn, name: str, params: dict[str, Any] | None = None) -> list[Any]:
    """The one column of every row statement ``name`` returns."""
    async with _cursor(conn, name, tuple_row) as cur:
        await _execute(cur, name, params or {})
        if cur.pgresult is not None and cur.pgresult.nfields != 1:
            raise RuntimeError(f"{name}: expected one column, got {cur.pgresult.nfields}")
        return [r[0] for r in await cur.fetchall()]


async def _exec(conn: Conn, name: str, params: dict[str, Any] | None = None) -> None:
    async with _cursor(conn, name, tuple_row) as cur:
        await _execute(cur, name, params or {})


async def _dicts(conn: Conn, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """For the inspection commands, which show every column as it is."""
    async with _cursor(conn, name, dict_row) as cur:
        await _execute(cur, name, params)
        return await cur.fetchall()


@dataclass(frozen=True)
class Occurrence:
    """One occurrence of a reminder: what every attempt to send it shares."""

    #: Stable idempotency key of the occurrence (same on every attempt and after redrive).
    operation_id: UUID
    source: str
    business_key: str
    #: The reminder's deadline.
    deadline: datetime
    #: How long before the deadline this send is (``timedelta(0)``: at the deadline).
    occurrence: timedelta
    #: When this occurrence was due (deadline minus occurrence).
    due_at: datetime
    channel: str


#: What a claim is known by: (work id, lease), the row and the lease that claimed it (the
#: fencing token); every change after the claim names both. A plain tuple under a name: one is
#: made for every row claimed and every outcome settled, and a NamedTuple costs ten times more.
ClaimKey: TypeAlias = tuple[int, int]


class Identity(NamedTuple):
    """This daemon, as the ledger and the daemon table name it."""

    daemon_id: str
    host: str
    pid: int


class Claimed(NamedTuple):
    """A row the claim statement touched: claimed for delivery (``status == 'claimed'``), or
    closed instead of sent (cancelled, superseded, dead).

    A named tuple, read positionally (see ``_tuple_rows``): the claim returns up to a batch of
    these per statement, one per delivery (a frozen dataclass from keywords: bench/README.md,
    "Per-delivery code"; the column names are checked once, test_hot_path.py::
    test_claimed_rows_are_read_by_column_name_checked_once). The fields are in the statement's
    column order; the occurrence's own fields mean what they mean in ``Occurrence``."""

    id: int
    reminder_id: int
    source: str
    business_key: str
    deadline: datetime
    occurrence: timedelta
    due_at: datetime
    channel: str
    operation_id: UUID
    status: str
    attempts: int
    attempts_base: int
    lease: int
    #: Since when this occurrence has been tried (its due time, or its last redrive): the
    #: channel's retry_for counts from here.
    retry_since: datetime
    prev_status: str
    recipient: str | None
    #: The payload as JSON text, exactly as stored.
    payload: str | None
    #: W3C trace context the reminder was written with (None: none).
    traceparent: str | None
    tracestate: str | None
    #: An occurrence of a recurring reminder: its deadline as local time, and the zone (None
    #: for a one-off).
    deadline_local: datetime | None
    time_zone: str | None


@dataclass(frozen=True)
class ClaimRequest:
    """One channel's claim: up to ``limit`` rows the channel's gate allows."""

    channel: str
    limit: int
    max_attempts: int
    lease: timedelta
    daemon_id: str
    expire_after: timedelta | None = None
    #: Commit the claim after the WAL flush (``database.synchronous_claims``).
    synchronous: bool = False

    def params(self) -> dict[str, Any]:
        return {
            "channel": self.channel,
            "limit": self.limit,
            "max_attempts": self.max_attempts,
            "lease": self.lease,
            "daemon_id": self.daemon_id,
            "expire_after": self.expire_after,
            "synchronous_commit": "on" if self.synchronous else "off",
        }


@asynccontextmanager
async def _one_round_trip(conn: Conn) -> AsyncIterator[None]:
    """A transaction of the statements sent in the block, in one round trip: BEGIN, the
    statements and COMMIT in one pipeline. psycopg's ``conn.transaction()`` in a pipeline
    syncs when it begins and when it commits (more round trips: the no-op burn-down did 19k
    instead of 23k jobs/s with it; bench/HISTORY.md, issue 26). On an error the transaction is
    rolled back here, so the connection goes back to the pool idle. In a transaction the caller
    opened (tests), the statements are simply part of it."""
    if conn.info.transaction_status == TransactionStatus.INTRANS:
        async with conn.pipeline():
            yield
        return
    try:
        async with conn.pipeline():
            await conn.execute("BEGIN")
            yield
            await conn.execute("COMMIT")
    except BaseException:
        if not conn.closed and conn.info.transaction_status != TransactionStatus.IDLE:
            with suppress(Error):
                await conn.rollback()
        raise
