"""Retention: bounded keyset batches, only terminal rows past their keep, pause switch, stalls,
and never a second send after cleanup."""

from __future__ import annotations

import math
from typing import Any

import anyio
import psycopg
import pytest

from pgwork import db
from pgwork.config import RetentionPolicy
from pgwork.duties.retention import Retention, RetentionResult

from . import sink
from .helpers import WORK_NOW, add, config, count, materialise, rows, running, sync_queue, until

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("clean_sink")]


async def seed(
    conn: psycopg.AsyncConnection[Any], n: int, status: str, age: str, *, start: int = 0
) -> None:
    """``n`` work rows in ``status``, finished ``age`` ago (live statuses get no finished_at), with a
    ledger row each. A claimed one is a live record held by a lease row (lease 1, an hour)."""
    terminal = status in ("delivered", "dead", "cancelled", "superseded")
    held = status == "claimed"
    await conn.execute(
        "INSERT INTO pgwork.renewal_work (reminder_id, source, business_key, deadline, occurrence, due_at, "
        "channel, operation_id, status, available_at, attempts, lease, claimed_at, claimed_by, finished_at, dead_reason) "
        "SELECT -g, 'seed', %(status)s || g, now() - %(age)s::interval, '0', now() - %(age)s::interval, 'test', "
        "md5(%(status)s || g)::uuid, %(record)s, now() + interval '1 hour', %(n0)s, %(n0)s, now(), 'd', "
        "CASE WHEN %(terminal)s THEN now() - %(age)s::interval + g * interval '1 microsecond' END, "
        "CASE WHEN %(status)s = 'dead' THEN 'seeded' END "
        "FROM generate_series(%(start)s + 1, %(start)s + %(n)s) g",
        {
            "status": status,
            "record": "ready" if held else status,
            "n0": 0 if held else 1,
            "age": age,
            "n": n,
            "terminal": terminal,
            "start": start,
        },
    )
    if held:
        await conn.execute(
            "INSERT INTO pgwork.work_lease (work_id, lease, attempts, channel, source, due_at, "
            "expires_at, claimed_by, claimed_at) SELECT w.id, 1, 1, w.channel, w.source, w.due_at, "
            "now() + interval '1 hour', 'd', now() FROM pgwork.renewal_work w "
            "WHERE w.business_key LIKE 'claimed%%' "
            "AND NOT EXISTS (SELECT FROM pgwork.work_lease l WHERE l.work_id = w.id)"
        )
    await sync_queue(conn)
    await conn.execute(
        "INSERT INTO pgwork.attempt (work_id, lease, attempt, daemon_id, host, pid, started_at, finished_at, outcome) "
        "SELECT id, 1, 1, 'd', 'h', 1, now(), now(), 'retry' FROM pgwork.renewal_work w "
        "WHERE business_key LIKE %s AND NOT EXISTS (SELECT 1 FROM pgwork.attempt a WHERE a.work_id = w.id)",
        (status + "%",),
    )


async def clean(dsn: str, **policy: Any) -> RetentionResult:
    r = Retention(RetentionPolicy(**{"pause": 0.0, **policy}))
    async with await db.connect(dsn) as c:
        return await r.run_once(c)


async def by_status(conn: psycopg.AsyncConnection[Any]) -> dict[str, int]:
    got = await rows(conn, f"SELECT status, count(*) AS n FROM ({WORK_NOW}) AS w GROUP BY status")
    return {r["status"]: r["n"] for r in got}


async def test_deletes_only_terminal_rows_past_their_keep(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    for status in ("delivered", "cancelled", "superseded"):
        await seed(conn, 30, status, "40 days")
    await seed(conn, 30, "dead", "40 days")  # younger than dead_keep (90 days): kept
    await seed(conn, 30, "delivered", "10 days", start=100)  # younger than keep: kept
    await seed(conn, 30, "ready", "400 days")  # live, however old
    await seed(conn, 30, "claimed", "400 days")
    res = await clean(dsn, batch_size=25)
    assert (res.deleted, res.ledger_deleted) == (90, 90)
    assert await by_status(conn) == {"dead": 30, "delivered": 30, "ready": 30, "claimed": 30}
    orphans = await rows(
        conn,
        "SELECT count(*) AS n FROM pgwork.attempt a "
        "WHERE NOT EXISTS (SELECT 1 FROM pgwork.renewal_work w WHERE w.id = a.work_id)",
    )
    assert orphans[0]["n"] == 0
    # Dead letters go after their own, longer keep.
    assert (await clean(dsn, dead_keep=30 * 86400)).deleted == 30


async def test_batches_are_bounded(dsn: str, conn: psycopg.AsyncConnection[Any]) -> None:
    await seed(conn, 5000, "delivered", "40 days")
    res = await clean(dsn, batch_size=700)
    assert res.deleted == 5000
    assert res.largest_batch == 700
    assert res.batches == math.ceil(5000 / 700)


async def test_a_backlog_of_200k_is_cleared_in_bounded_batches(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await seed(conn, 200_000, "delivered", "40 days")
    res = await clean(dsn)  # default batch size
    assert res.deleted == 200_000 and res.largest_batch <= RetentionPolicy().batch_size
    assert res.batches >= 200_000 / RetentionPolicy().batch_size
    assert await count(conn) == 0


async def test_pause_switch(dsn: str, conn: psycopg.AsyncConnection[Any]) -> None:
    await seed(conn, 100, "delivered", "40 days")
    await conn.execute("UPDATE pgwork.config SET retention_paused = true")
    res = await clean(dsn)
    assert (res.paused, res.deleted) == (True, 0)
    await conn.execute("UPDATE pgwork.config SET retention_paused = false")
    assert (await clean(dsn)).deleted == 100


async def test_a_locked_row_shrinks_batches_then_stalls_the_pass(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await seed(conn, 100, "delivered", "40 days")
    async with await psycopg.AsyncConnection.connect(dsn) as locker:
        # Row 50 in deletion order is locked by someone else's long transaction.
        await locker.execute(
            "SELECT * FROM pgwork.renewal_work WHERE business_key = 'delivered50' FOR UPDATE"
        )
        res = await clean(dsn, batch_size=40, min_batch=10, lock_timeout=0.05)
        assert (res.deleted, res.stalled) == (40, True) and res.timeouts >= Retention.STALL_AFTER
        await locker.rollback()
    assert (await clean(dsn, batch_size=40)).deleted == 60


async def test_retention_during_delivery_never_touches_live_rows(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    from pgwork.channels import Delivery, Retry

    async def flaky(d: Delivery) -> Retry | None:
        return (
            Retry(error="again", delay=0.05) if d.attempt < 3 and hash(d.business_key) % 2 else None
        )

    sink.DEFAULT.append(flaky)
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT 's', 'k' || g, now(), 'test', 'r' FROM generate_series(1, 300) g"
    )
    stop = anyio.Event()
    passes = 0

    async def retention_loop() -> None:
        nonlocal passes
        while not stop.is_set():
            await clean(dsn, keep=0, dead_keep=0, batch_size=50)
            passes += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(retention_loop)
        async with running(config(), dsn):
            await until(lambda: _all_delivered(300), timeout=30, what="300 delivered")
        stop.set()
    assert passes > 1
    # Each key was called exactly as often as its script says: 3 times for the flaky ones (two
    # retries, then success), once for the others. A row retention deleted too early, or an
    # occurrence materialised again after retention, would show up as an extra call.
    calls: dict[str, int] = {}
    for d in sink.DELIVERED:
        calls[d.business_key] = calls.get(d.business_key, 0) + 1
    assert len(calls) == 300
    assert all(n == (3 if hash(k) % 2 else 1) for k, n in calls.items()), calls


async def _all_delivered(n: int) -> bool:
    return (
        len(
            {
                d.business_key
                for d in sink.DELIVERED
                if d.attempt == 3 or not hash(d.business_key) % 2
            }
        )
        == n
    )


async def test_no_second_send_after_retention(dsn: str, conn: psycopg.AsyncConnection[Any]) -> None:
    await add(conn, "k", before="{0, 1 hour}")  # both occurrences due (one overdue)
    async with running(config(), dsn):
        await until(lambda: _delivered(conn, 2), what="delivered")
    assert (await clean(dsn, keep=0)).deleted == 2
    assert await count(conn) == 0
    res = await materialise(dsn, lookahead=86400)  # a full rescan, far ahead
    assert res.made == 0
    async with running(config(), dsn):
        await anyio.sleep(1.0)  # ticks, claims: nothing to send
    assert len(sink.DELIVERED) == 2


async def _delivered(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    return await count(conn, "status = 'delivered'") == n


async def test_daemon_runs_retention_and_honours_pause(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await seed(conn, 50, "delivered", "40 days")
    await conn.execute("UPDATE pgwork.config SET retention_paused = true")
    cfg = config(retention_interval=0.2)
    async with running(cfg, dsn) as d:
        await add(conn, "still-delivered")
        await until(lambda: _delivered(conn, 51), what="delivery while retention is paused")
        await anyio.sleep(1.5)
        assert await count(conn, "status = 'delivered'") == 51
        await conn.execute("UPDATE pgwork.config SET retention_paused = false")
        await until(lambda: _delivered(conn, 1), what="retention resumed")
        assert d.metrics.registry.get_sample_value("pgwork_retention_deleted_rows_total") == 50


async def test_retention_runs_under_a_role_with_only_the_documented_grants(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """docs/operations.md lists what a separate retention role (retention.dsn) needs; exactly that works,
    tombstones included."""
    rid = await add(conn, "live", "now() - interval '40 days'")
    await materialise(dsn)
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'delivered', finished_at = now() - interval '40 days'"
    )
    await sync_queue(conn)
    await seed(conn, 50, "delivered", "40 days")
    await conn.execute("CREATE ROLE cleanup_probe LOGIN")
    try:
        for sql in (
            "GRANT USAGE ON SCHEMA pgwork TO cleanup_probe",
            "GRANT SELECT, DELETE ON pgwork.renewal_work, pgwork.attempt TO cleanup_probe",
            "GRANT SELECT, INSERT, DELETE ON pgwork.retired TO cleanup_probe",
            "GRANT SELECT ON pgwork.reminder, pgwork.config TO cleanup_probe",
            "GRANT SELECT, UPDATE ON pgwork.materialiser_state, pgwork.retention_state "
            "TO cleanup_probe",
        ):
            await conn.execute(sql)
        from psycopg.conninfo import make_conninfo

        res = await clean(make_conninfo(dsn, user="cleanup_probe"))
        assert res.deleted == 51 and not res.stalled
        tomb = await rows(conn, "SELECT reminder_id FROM pgwork.retired")
        assert [t["reminder_id"] for t in tomb] == [rid]
    finally:
        await conn.execute("DROP OWNED BY cleanup_probe")
        await conn.execute("DROP ROLE cleanup_probe")
