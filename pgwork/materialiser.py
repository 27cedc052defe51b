"""Materialiser duty: reminders whose occurrences fire within the look-ahead become work rows."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from psycopg import AsyncConnection

from .db import fetch_one
from .queries import Q

log = logging.getLogger("pgwork.materialiser")

#: How soon to try again when another daemon holds the materialiser lock, seconds.
BUSY_RETRY = 0.05


@dataclass(frozen=True)
class PassResult:
    cutoff: datetime
    scanned: int
    made: int
    made_due: int
    pages: int
    duration: float
    #: The longest page transaction, seconds.
    longest_page: float
    next_fire_at: datetime | None


_EPOCH = datetime.fromisoformat("1970-01-01T00:00:00+00:00")


async def run_once(
    conn: AsyncConnection[Any],
    *,
    lookahead: float,
    page_size: int,
    cutoff: datetime | None = None,
    coordinate: bool = True,
    on_made: Callable[[], None] | None = None,
) -> PassResult | None:
    """One complete pass: every occurrence firing at or before the cutoff gets its work row.

    Pages on ``(next_fire_at, id)``, one short transaction per page. Returns None when another
    materialiser holds the lock (it is doing this work right now). ``coordinate=False`` skips the
    lock: correctness never depends on it (tests use that to race two passes). ``on_made`` is called
    as soon as a page that made rows has committed: local workers claim the ones due now at once
    and set their timers for the others.
    """
    t0 = time.monotonic()
    after_at, after_id = _EPOCH, 0
    scanned = made = made_due = pages = 0
    longest = 0.0
    while True:
        p0 = time.monotonic()
        page = await fetch_one(
            conn,
            "materialise_page",
            {
                "cutoff": cutoff,
                "lookahead": timedelta(seconds=lookahead),
                "after_at": after_at,
                "after_id": after_id,
                "limit": page_size,
                "coordinate": coordinate,
            },
        )
        if not page["got"]:
            return None
        cutoff = page["cutoff"]
        longest = max(longest, time.monotonic() - p0)
        if page["made"] and on_made is not None:
            on_made()
        pages += 1
        scanned += page["scanned"]
        made += page["made"]
        made_due += page["made_due"]
        if page["scanned"] < page_size:
            break
        after_at, after_id = page["last_at"], page["last_id"]
    duration = time.monotonic() - t0
    assert cutoff is not None
    async with conn.transaction():
        await conn.execute(Q["materialise_async_commit"])
        await conn.execute(
            Q["materialise_record_pass"],
            {"cutoff": cutoff, "made": made, "duration_ms": duration * 1000},
        )
    nxt = (await fetch_one(conn, "next_fire_at"))["at"]
    if made:
        log.info(
            "materialised %d work rows",
            made,
            extra={
                "rows": made,
                "scanned": scanned,
                "pages": pages,
                "cutoff": cutoff.isoformat(),
                "duration_ms": round(duration * 1000, 1),
            },
        )
    return PassResult(cutoff, scanned, made, made_due, pages, duration, longest, nxt)
