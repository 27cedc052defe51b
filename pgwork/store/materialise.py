"""The bindings of room materialise: the statements of the materialiser: pages of due reminders
made into work, the reminders set aside (``pgwork/sql/queries/materialise.sql``), one typed
function each."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import datetime, timedelta

import psycopg

from ..queries import Q
from ._bind import (
    Claimed,
    ClaimRequest,
    Conn,
    _column_names,
    _dicts,
    _exec,
    _one,
    _one_round_trip,
    _rows,
)


@dataclass(frozen=True)
class Page:
    cutoff: datetime
    scanned: int
    made: int
    made_due: int
    #: Occurrences closed as expired by the channel's catch_up policy instead of sent (the
    #: page's column name; the pass calls them ``caught_up``).
    skipped: int
    notified: int
    earliest_made: datetime | None
    last_at: datetime | None
    last_id: int | None
    #: Series whose share of the page ended short of the cutoff: the next pass goes on.
    unfinished: int
    #: Where the next page's turn of sources starts (after this source; None: the first).
    turn_source: str | None


_PAGE_COLUMNS = tuple(f.name for f in fields(Page))


async def materialise_page(
    conn: Conn,
    *,
    coordinate: bool,
    cutoff: datetime | None,
    lookahead: timedelta,
    after_at: datetime | None,
    after_id: int,
    limit: int,
    origin: str = "",
    take: Sequence[ClaimRequest] = (),
    aside: Sequence[int] = (),
    turn_after: str | None = None,
) -> tuple[Page | None, list[Claimed]]:
    """One page, one statement (its own transaction): the coordination lock, the page, and the
    rows it inserted claimed for the channels in ``take`` (up to each one's ``limit``; they share
    one lease length and daemon). The page is None when another materialiser holds the lock.
    ``origin`` is the payload of the page's NOTIFY (a daemon's listener skips its own: its
    workers were told). ``turn_after``: a full page serves the sources with due reminders in
    turn from the one after it (the last page's ``Page.turn_source``)."""
    params = {
        "coordinate": coordinate,
        "cutoff": cutoff,
        "lookahead": lookahead,
        "after_at": after_at,
        "after_id": after_id,
        "limit": limit,
        "origin": origin,
        # One JSON text, not three arrays: psycopg's dumping of the arrays cost more than the
        # rest of the call's client side together.
        "take": json.dumps(
            [
                {
                    "channel": t.channel,
                    "room": t.limit,
                    "expire_after_s": t.expire_after.total_seconds() if t.expire_after else None,
                }
                for t in take
            ]
        ),
        "lease": take[0].lease if take else timedelta(0),
        "daemon_id": take[0].daemon_id if take else "",
        "aside": list(aside),
        "turn_after": turn_after,
    }
    assert all(t.lease == params["lease"] and t.daemon_id == params["daemon_id"] for t in take)
    async with conn.cursor() as cur:
        if any(t.synchronous for t in take):
            # The page function commits without waiting for the WAL flush; a page that claims
            # for a channel whose claims are synchronous takes that back before its commit
            # (same transaction, same round trip).
            async with _one_round_trip(conn):
                await cur.execute(Q["materialise_page"], params)
                await conn.execute(Q["commit_synchronously"])
        else:
            await cur.execute(Q["materialise_page"], params)
        names = _column_names(cur)
        if names != _PAGE_COLUMNS + Claimed._fields:
            raise TypeError(f"materialise_page returns {names}, not the Page and Claimed fields")
        got = await cur.fetchall()
    n = len(_PAGE_COLUMNS)
    if not got:
        return None, []
    page = Page(*got[0][:n])
    return page, [tuple.__new__(Claimed, r[n:]) for r in got if r[n] is not None]


@dataclass(frozen=True)
class DueReminder:
    id: int
    source: str
    business_key: str
    fire_at: datetime


@dataclass(frozen=True)
class SetAside:
    """A reminder a materialiser's page failed on, left out of pages for a while."""

    reminder_id: int
    source: str
    business_key: str
    #: The occurrence it failed on.
    fire_at: datetime
    #: The daemon that last tried it.
    daemon_id: str
    since: datetime
    tried_at: datetime
    next_try_at: datetime
    tries: int
    error: str


async def set_aside_record(
    conn: Conn, reminder: DueReminder, *, daemon_id: str, wait: float, error: str
) -> None:
    await _exec(
        conn,
        "set_aside_record",
        {
            "reminder_id": reminder.id,
            "source": reminder.source,
            "business_key": reminder.business_key,
            "fire_at": reminder.fire_at,
            "daemon_id": daemon_id,
            "wait": wait,
            "error": error,
        },
    )


async def set_aside_forget(conn: Conn) -> int:
    """Forgets the reminders no longer stuck; returns how many are left."""
    got = await _dicts(conn, "set_aside_forget", {})
    return int(got[0]["left_aside"])


async def set_aside_list(
    conn: Conn, *, reminder_id: int | None = None, limit: int = 100
) -> list[SetAside]:
    return await _rows(
        conn, "set_aside_list", SetAside, {"reminder_id": reminder_id, "limit": limit}
    )


async def next_due_reminder(
    conn: Conn,
    *,
    cutoff: datetime | None,
    lookahead: timedelta,
    after_at: datetime | None,
    after_id: int,
    aside: Sequence[int],
) -> DueReminder | None:
    got = await _rows(
        conn,
        "next_due_reminder",
        DueReminder,
        {
            "cutoff": cutoff,
            "lookahead": lookahead,
            "after_at": after_at,
            "after_id": after_id,
            "aside": list(aside),
        },
    )
    return got[0] if got else None


async def materialise_record_pass(
    conn: Conn, *, cutoff: datetime, made: int, duration_ms: float, record_every: timedelta
) -> datetime | None:
    """Record a pass's evidence (one that made nothing: only when the last record is older than
    ``record_every``); returns the cutoff recorded, or as it would have been (None: no state
    row)."""
    params = {
        "cutoff": cutoff,
        "made": made,
        "duration_ms": duration_ms,
        "record_every": record_every,
    }
    if made:
        got = await _dicts(conn, "materialise_record_pass", params)
        return got[0]["last_cutoff"] if got else None
    try:
        async with conn.transaction():
            await _exec(conn, "record_without_waiting")
            got = await _dicts(conn, "materialise_record_pass", params)
    except psycopg.errors.LockNotAvailable:
        return cutoff  # a retention batch holds the state table: not recorded this time
    return got[0]["last_cutoff"] if got else None


@dataclass(frozen=True)
class NextFire:
    at: datetime | None
    id: int | None
    after_cutoff_s: float | None
    #: The earliest occurrence of the reminders set aside (None: none due at all).
    aside_at: datetime | None = None


async def next_fire_at(conn: Conn, *, cutoff: datetime, aside: Sequence[int] = ()) -> NextFire:
    return await _one(conn, "next_fire_at", NextFire, {"cutoff": cutoff, "aside": list(aside)})


@dataclass(frozen=True)
class MaterialiserState:
    last_cutoff: datetime | None
    last_pass_at: datetime | None
    last_inserted: int
    last_duration_ms: float
    total_inserted: int
    cutoff_age_seconds: float | None


async def materialiser_state(conn: Conn) -> MaterialiserState:
    return await _one(conn, "materialiser_state", MaterialiserState)
