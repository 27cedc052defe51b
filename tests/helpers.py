"""Small helpers shared by the tests."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pgwork import db, store
from pgwork.duties import materialise as materialiser

# Test servers trade durability for speed; benchmarks (bench/) run durable.
FAST_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",
    "shared_buffers": "128MB",
}


def utc(text: str) -> datetime:
    """An ISO time without a zone, read as UTC."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


async def add(
    conn: psycopg.AsyncConnection[Any],
    key: str,
    due: str = "now()",
    *,
    source: str = "test",
    channel: str = "test",
    recipient: str = "r@example.com",
    before: str = "{0}",
    payload: str = "{}",
) -> int:
    """Insert a reminder due at SQL expression ``due``; returns its id."""
    cur = await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient, remind_before, payload) "
        f"VALUES (%s, %s, {due}, %s, %s, %s::interval[], %s::jsonb) RETURNING id",
        (source, key, channel, recipient, before, payload),
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def add_in_an_unknown_zone(
    conn: psycopg.AsyncConnection[Any], source: str = "mars", key: str = "base:1"
) -> None:
    """A reminder written around the triggers (as a table's owner can) in a zone the server
    does not know, due a minute ago: the row the materialiser sets aside."""
    await conn.execute("SET session_replication_role = replica")
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, due_local, due_tz, "
        "channel, recipient, next_fire_at) VALUES (%s, %s, now(), now() AT TIME ZONE 'UTC', "
        "'Mars/Olympus', 'log', 'r', now() - interval '1 minute')",
        (source, key),
    )
    await conn.execute("RESET session_replication_role")


async def statement(
    conn: psycopg.AsyncConnection[Any], name: str, params: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """One of pgwork's named statements, run by name with rows as dicts: for tests that probe a
    statement directly (pgwork itself goes through the typed ``pgwork.store``)."""
    from pgwork.queries import Q

    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(Q[name], params or {})
        return await cur.fetchall()


async def rows(
    conn: psycopg.AsyncConnection[Any], sql: str, params: Any = None
) -> list[dict[str, Any]]:
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(sql, params)
        return await cur.fetchall()


#: Work rows as they stand: a record with its lease row applied (status 'claimed' while held).
WORK_NOW = (
    "SELECT n.* FROM pgwork.renewal_work r LEFT JOIN pgwork.work_lease l ON l.work_id = r.id "
    "CROSS JOIN LATERAL pgwork.work_now(r, l) AS n"
)


async def work(conn: psycopg.AsyncConnection[Any]) -> list[dict[str, Any]]:
    return await rows(conn, f"SELECT * FROM ({WORK_NOW}) AS w ORDER BY id")


async def unclaim(conn: psycopg.AsyncConnection[Any], work_id: int) -> None:
    """What a database crash leaves of a claim committed asynchronously: none of it (the row is
    ready again under its old numbers)."""
    await conn.execute(
        "WITH gone AS (DELETE FROM pgwork.work_lease WHERE work_id = %(id)s RETURNING work_id) "
        "INSERT INTO pgwork.work_ready (work_id, channel, source, available_at, due_at) "
        "SELECT w.id, w.channel, w.source, now(), w.due_at FROM pgwork.renewal_work w "
        "JOIN gone g ON g.work_id = w.id",
        {"id": work_id},
    )


async def sync_queue(conn: psycopg.AsyncConnection[Any]) -> None:
    """What pgwork's own statements do to the queue when they change a work record, for a test
    that wrote records directly to set a state up: a closed record leaves work_ready and
    work_lease; a live one no lease holds is ready in work_ready as its record says (inserted
    again, so its lane is woken)."""
    for sql in (
        "DELETE FROM pgwork.work_ready q USING pgwork.renewal_work w"
        " WHERE q.work_id = w.id AND (w.status <> 'ready' OR (q.channel, q.source, q.available_at,"
        " q.due_at) IS DISTINCT FROM (w.channel, w.source, w.available_at, w.due_at))",
        "DELETE FROM pgwork.work_lease l USING pgwork.renewal_work w"
        " WHERE l.work_id = w.id AND w.status <> 'ready'",
        "INSERT INTO pgwork.work_ready (work_id, channel, source, available_at, due_at)"
        " SELECT w.id, w.channel, w.source, w.available_at, w.due_at FROM pgwork.renewal_work w"
        " WHERE w.status = 'ready'"
        " AND NOT EXISTS (SELECT FROM pgwork.work_ready q WHERE q.work_id = w.id)"
        " AND NOT EXISTS (SELECT FROM pgwork.work_lease l WHERE l.work_id = w.id)",
    ):
        await conn.execute(sql)


async def assert_invariant(conn: psycopg.AsyncConnection[Any]) -> None:
    """The queue's invariant holds (pgwork.work_invariant finds no row that breaks it)."""
    assert await rows(conn, "SELECT * FROM pgwork.work_invariant()") == []


async def materialise(
    dsn: str, *, lookahead: float = 0.0, page_size: int = 1000, cutoff: datetime | None = None
) -> materialiser.PassResult:
    """One materialiser pass on a daemon connection (waits if another pass holds the lock);
    ``cutoff``: what a pass at that instant would make (default: now plus the look-ahead)."""
    c = await db.connect(dsn)
    try:
        while True:
            res = await materialiser.run_once(
                c, lookahead=lookahead, page_size=page_size, cutoff=cutoff
            )
            if res is not None:
                return res
    finally:
        await c.close()


async def claim(
    dsn: str,
    *,
    lease: float = 30.0,
    max_attempts: int = 5,
    limit: int = 100,
    expire_after: float | None = None,
    on: psycopg.AsyncConnection[Any] | None = None,
) -> list[dict[str, Any]]:
    """Claim rows of the `test` channel by hand, as a worker of daemon `d` would (the daemon's
    own statements, in its own transaction). ``on``: a connection to claim on (in its open
    transaction, if it has one), instead of a fresh one."""
    from datetime import timedelta

    req = store.ClaimRequest(
        channel="test",
        limit=limit,
        max_attempts=max_attempts,
        lease=timedelta(seconds=lease),
        daemon_id="d",
        expire_after=None if expire_after is None else timedelta(seconds=expire_after),
    )
    if on is not None:
        return [r._asdict() for r in await store.claim_work(on, req)]
    async with await db.connect(dsn) as c:
        return [r._asdict() for r in await store.claim_work(c, req)]


# -- in-process daemon -----------------------------------------------------------------------

import time  # noqa: E402
from collections.abc import AsyncIterator, Awaitable, Callable  # noqa: E402
from contextlib import asynccontextmanager  # noqa: E402
from dataclasses import fields  # noqa: E402

import anyio  # noqa: E402

from pgwork.channels.python import PythonOptions  # noqa: E402
from pgwork.channels.webhook import WebhookOptions  # noqa: E402
from pgwork.config import ChannelConfig, Config, RetryPolicy  # noqa: E402
from pgwork.daemon import Daemon  # noqa: E402


def python_channel(
    name: str = "test",
    *,
    concurrency: int = 16,
    max_attempts: int = 5,
    base: float = 0.05,
    cap: float = 0.2,
) -> ChannelConfig:
    return ChannelConfig(
        name=name,
        kind="python",
        options=PythonOptions(target="tests.sink:deliver"),
        concurrency=concurrency,
        retry=RetryPolicy(max_attempts=max_attempts, base=base, cap=cap),
    )


def webhook_channel(
    url: str,
    name: str = "hook",
    *,
    max_attempts: int = 5,
    read_timeout: float = 2.0,
    headers: dict[str, str] | None = None,
    concurrency: int = 16,
    retry: RetryPolicy | None = None,
    **more: Any,
) -> ChannelConfig:
    """A webhook channel with short timeouts and backoff; ``more``: other fields of
    ChannelConfig or of WebhookOptions, each given to the one that has it."""
    own = {f.name for f in fields(WebhookOptions)}
    return ChannelConfig(
        name=name,
        kind="webhook",
        options=WebhookOptions(
            url=url,
            read_timeout=read_timeout,
            connect_timeout=1.0,
            headers=headers or {},
            **{k: v for k, v in more.items() if k in own},
        ),
        concurrency=concurrency,
        retry=retry or RetryPolicy(max_attempts=max_attempts, base=0.05, cap=0.2),
        **{k: v for k, v in more.items() if k not in own},
    )


def config(*channels: ChannelConfig, **kw: Any) -> Config:
    base: dict[str, Any] = {
        "tick": 0.5,
        "lookahead": 0.0,
        "lease": 5.0,
        "shutdown_grace": 1.0,
        "metrics_enabled": False,
        "metrics_interval": 0.2,
    }
    base.update(kw)
    chans = channels or (python_channel(),)
    return Config(channels={c.name: c for c in chans}, **base)


@asynccontextmanager
async def running(cfg: Config, dsn: str, **daemon: Any) -> AsyncIterator[Daemon]:
    """A daemon running in this event loop; stopped gracefully on exit, even when the test fails.
    ``daemon``: further Daemon fields (e.g. tracer_provider)."""
    d = Daemon(cfg, dsn, **daemon)
    async with anyio.create_task_group() as tg:
        await tg.start(d.run)
        try:
            yield d
        finally:
            d.request_stop()


async def until(
    check: Callable[[], Awaitable[bool]], timeout: float = 15.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await anyio.sleep(0.05)


async def count(conn: psycopg.AsyncConnection[Any], where: str = "true") -> int:
    r = await rows(conn, f"SELECT count(*) AS n FROM ({WORK_NOW}) AS w WHERE {where}")
    return int(r[0]["n"])


async def delivered(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    """Exactly ``n`` work rows are delivered."""
    return await count(conn, "status = 'delivered'") == n


async def settled(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    """Exactly ``n`` work rows are delivered or dead."""
    return await count(conn, "status IN ('delivered', 'dead')") == n
