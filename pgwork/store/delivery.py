"""The bindings of room delivery: the statements of delivery: the claim, a channel's gate, the
outcomes, leases (``pgwork/sql/queries/delivery.sql``), one typed function each."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ._bind import (
    Claimed,
    ClaimRequest,
    Conn,
    _column,
    _cursor,
    _dicts,
    _execute,
    _one,
    _rows,
    _tuple_rows,
)


async def type_fields(conn: Conn, name: str) -> tuple[str, ...]:
    """The fields of the composite type ``name``, in order: pgwork.claimed (what ``Claimed``'s
    must be) and pgwork.outcome (what ``duties.outcomes.Record.json_text`` writes)."""
    return tuple(r["name"] for r in await _dicts(conn, "type_fields", {"type": name}))


async def claim_work(conn: Conn, req: ClaimRequest) -> list[Claimed]:
    """One statement: the lanes and the limit's lock are taken first, whatever this daemon's
    config says (a throttle limit, the breaker's probe: the channel row's to say), then the
    rows (pgwork/sql/code/claim.sql)."""
    async with _cursor(conn, "claim_work", _tuple_rows(Claimed)) as cur:
        await _execute(cur, "claim_work", req.params())
        return await cur.fetchall()


@dataclass(frozen=True)
class GateReading:
    """What the database says of a channel's gate: when its claim can next get rows (see
    next_available). ``deliver.gate.Gate`` is the worker's state built from it."""

    #: Seconds until the next row is claimable (negative: now); None when none.
    wait_s: float | None
    #: Paused, or retired (its row gone).
    paused: bool
    #: The channel's row is gone (`pgwork channel retire`): this daemon stops claiming it.
    retired: bool
    #: Seconds until a throttle's not_before passes (0: not held).
    hold_s: float | None
    #: Seconds until the rate limit has tokens for a small batch (None: no rate limit).
    tokens_s: float | None
    #: The global concurrency or throttle limit is reached.
    full: bool


async def next_available(conn: Conn, *, channel: str) -> GateReading:
    return await _one(conn, "next_available", GateReading, {"channel": channel})


@dataclass(frozen=True)
class Unapplied:
    """A record the outcome statement did not apply now: fenced, or ``already`` applied."""

    fenced_id: int
    lease: int
    already: bool


async def record_outcomes(
    conn: Conn, *, outcomes: str, daemon_id: str, host: str, pid: int
) -> list[Unapplied]:
    return await _rows(
        conn,
        "record_outcomes",
        Unapplied,
        {"outcomes": outcomes, "daemon_id": daemon_id, "host": host, "pid": pid},
    )


@dataclass(frozen=True)
class LeaseKept:
    """A row whose lease an extension renewed (``extend_leases``)."""

    id: int
    lease: int


async def extend_leases(
    conn: Conn, *, work_id: list[int], lease_no: list[int], lease: timedelta
) -> list[LeaseKept]:
    return await _rows(
        conn,
        "extend_leases",
        LeaseKept,
        {"work_id": work_id, "lease_no": lease_no, "lease": lease},
    )


async def release_leases(
    conn: Conn,
    *,
    work_id: list[int],
    lease_no: list[int],
    daemon_id: str,
    host: str,
    pid: int,
) -> list[int]:
    return await _column(
        conn,
        "release_leases",
        {
            "work_id": work_id,
            "lease_no": lease_no,
            "daemon_id": daemon_id,
            "host": host,
            "pid": pid,
        },
    )
