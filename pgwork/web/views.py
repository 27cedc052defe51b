"""What each page of the web page shows, as a typed record built from ``store`` calls only: no
markup here (``html.py`` draws a view) and no request (``app.py`` reads the request). A page's rows
are tested from its view, without a browser (tests/test_web_views.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from psycopg import AsyncConnection

from .. import store
from ..history import History, reminder_history

#: Rows per page.
PAGE = 50
#: The trend windows a channel's page offers, hours (the first is the default); the daemons keep
#: two days of minutes (pgwork/duties/trends.py).
TREND_HOURS = (3, 1, 12, 48)
#: The reminders set aside the overview lists (status lists up to 100).
OVERVIEW_SET_ASIDE = 20
#: The late sources the overview lists, the most overdue first (`pgwork status` lists each).
LATE_SOURCES = 20
#: A channel's live rows: every one, those claimable now, those waiting for their time (made
#: ahead of it, or a retry in its backoff), those a worker holds.
LIVE_STATUSES = {"": ("ready", "waiting", "claimed"), "ready": ("ready",),
                 "waiting": ("waiting",), "claimed": ("claimed",)}  # fmt: skip

Conn = AsyncConnection[Any]


@dataclass(frozen=True)
class Overview:
    lag: store.Lag
    sources: list[store.SourceLag]
    #: Live rows and dead letters per channel and status (ready, waiting, claimed, dead).
    counts: dict[str, dict[str, int]]
    channels: list[store.ChannelState]
    aside: list[store.SetAside]
    daemons: list[store.DaemonRow]
    materialiser: store.MaterialiserState
    retention: store.RetentionState
    now: datetime


async def overview(conn: Conn) -> Overview:
    """Each query reads an index bounded by live rows or dead letters, or the catalog."""
    counts: dict[str, dict[str, int]] = {}
    for s in await store.work_states(conn):
        counts.setdefault(s.channel, {})[s.status] = s.n
    return Overview(
        lag=await store.lag(conn),
        sources=await store.late_sources(conn, limit=LATE_SOURCES),
        counts=counts,
        channels=await store.channel_states(conn),
        aside=await store.set_aside_list(conn, limit=OVERVIEW_SET_ASIDE),
        daemons=await store.daemons(conn),
        materialiser=await store.materialiser_state(conn),
        retention=await store.retention_state(conn),
        now=await store.db_now(conn),
    )


@dataclass(frozen=True)
class ChannelPage:
    channel: store.ChannelState
    #: Which rows: "" (every live row), "ready", "waiting" or "claimed".
    status: str
    rows: list[dict[str, Any]]
    trend: list[store.TrendMinute]
    hours: int
    now: datetime
    #: The next page's cursor (source, available_at, id); None: this is the last.
    next_after: tuple[str, datetime, int] | None


async def channel(
    conn: Conn,
    name: str,
    *,
    status: str,
    after: tuple[str, datetime, int] | None,
    hours: int,
) -> ChannelPage | None:
    """A channel's state, trend and one page of its live rows; None: no such channel."""
    known = [c for c in await store.channel_states(conn) if c.name == name]
    if not known:
        return None
    status = status if status in LIVE_STATUSES else ""
    rows = await store.live_page(
        conn, channel=name, statuses=list(LIVE_STATUSES[status]), after=after, limit=PAGE
    )
    last = rows[-1] if len(rows) == PAGE else None
    return ChannelPage(
        channel=known[0],
        status=status,
        rows=rows,
        trend=await store.channel_trend(conn, channel=name, minutes=hours * 60),
        hours=hours,
        now=await store.db_now(conn),
        next_after=(last["source"], last["available_at"], last["id"]) if last else None,
    )


@dataclass(frozen=True)
class WorkPage:
    work: dict[str, Any]
    attempts: list[dict[str, Any]]


async def work(conn: Conn, work_id: int) -> WorkPage | None:
    got = await store.work_get(conn, id=work_id)
    if not got:
        return None
    return WorkPage(got[0], await store.work_attempts(conn, id=work_id))


async def reminder(conn: Conn, source: str, key: str, expire_after: Any) -> History:
    return await reminder_history(conn, source=source, business_key=key, expire_after=expire_after)


@dataclass(frozen=True)
class DeadFilter:
    """What the dead-letter list (and a bulk redrive) selects."""

    channel: str | None = None
    source: str | None = None
    reason: str | None = None
    since: str | None = None

    def items(self) -> dict[str, str | None]:
        return {"channel": self.channel, "source": self.source, "reason": self.reason,
                "since": self.since}  # fmt: skip

    @property
    def any(self) -> bool:
        return any(self.items().values())

    def said(self) -> str:
        return " · ".join(f"{k} {v}" for k, v in self.items().items() if v) or "every dead letter"


@dataclass(frozen=True)
class DeadPage:
    filter: DeadFilter
    rows: list[dict[str, Any]]
    #: The next page's cursor (finished_at, id); None: this is the last.
    next_before: tuple[datetime, int] | None
    #: What a bulk redrive just did (redriven, left dead), shown once after it.
    done: tuple[int, int] | None = None


async def dead(
    conn: Conn,
    f: DeadFilter,
    *,
    since: timedelta | None,
    before: tuple[datetime, int] | None,
    done: tuple[int, int] | None = None,
) -> DeadPage:
    rows = await store.dead_page(
        conn,
        channel=f.channel,
        source=f.source,
        reason_like=f"%{f.reason}%" if f.reason else None,
        before=before,
        limit=PAGE,
        since=since,
    )
    last = rows[-1] if len(rows) == PAGE else None
    return DeadPage(f, rows, (last["finished_at"], last["id"]) if last else None, done)


@dataclass(frozen=True)
class RemindersPage:
    source: str
    prefix: str
    rows: list[dict[str, Any]]
    next_after: str | None


async def reminders(conn: Conn, source: str, prefix: str, after: str) -> RemindersPage:
    rows = await store.reminders_page(conn, source=source, prefix=prefix, after=after, limit=PAGE)
    return RemindersPage(
        source, prefix, rows, rows[-1]["business_key"] if len(rows) == PAGE else None
    )


@dataclass(frozen=True)
class RetryingPage:
    channel: str | None
    rows: list[dict[str, Any]]
    #: The channels of those rows as they stand (a paused one holds its rows past their time).
    channels: dict[str, store.ChannelState] = field(default_factory=dict)
    now: datetime | None = None


async def retrying(conn: Conn, channel: str | None) -> RetryingPage:
    rows = await store.retrying(conn, channel=channel, limit=PAGE)
    states = {c.name: c for c in await store.channel_states(conn)}
    return RetryingPage(channel, rows, states, await store.db_now(conn))
