"""Many apps on one database, tried as a hostile app would (issue 25): row-level security and what
apps may read, the daemon's cost under it, and the locks an app's open transaction holds against
the daemon. Real PostgreSQL, real roles, real connections."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import anyio
import psycopg
import pytest

from .helpers import add

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("clean_sink")]

BILLING_KEY = "customer:4711/invoice:overdue"


class Apps:
    """Two app roles with row-level security on: `a` is granted `leases`, `b` `billing`."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.a = f"app_a_{os.getpid()}"
        self.b = f"app_b_{os.getpid()}"

    async def connect(self, role: str) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(self.dsn, user=role, autocommit=True)

    async def run(self, role: str, sql: str, params: Any = None) -> tuple[list[Any], list[str]]:
        """Rows and the NOTICEs the statement raised, as that role."""
        notices: list[str] = []
        async with await self.connect(role) as c:
            c.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
            cur = await c.execute(sql, params)
            got = await cur.fetchall() if cur.description else []
        return got, notices


@pytest.fixture
async def apps(dsn: str, conn: psycopg.AsyncConnection[Any]) -> AsyncIterator[Apps]:
    it = Apps(dsn)
    for role, source in ((it.a, "leases"), (it.b, "billing")):
        await conn.execute(f'CREATE ROLE "{role}" LOGIN IN ROLE pgwork_app')
        await conn.execute("INSERT INTO pgwork.app_source VALUES (%s, %s)", (role, source))
    try:
        await conn.execute("ALTER TABLE pgwork.reminder ENABLE ROW LEVEL SECURITY")
        await add(conn, "42", source="leases", channel="log")
        await add(conn, BILLING_KEY, source="billing", channel="log")
        yield it
    finally:
        for role in (it.a, it.b):
            await conn.execute(f'DROP OWNED BY "{role}"')
            await conn.execute(f'DROP ROLE "{role}"')


async def test_reminder_status_does_not_leak_through_a_failing_cast(apps: Apps) -> None:
    """The cast runs only on the app's own rows: billing's key never reaches an error message."""
    got, _ = await apps.run(
        apps.a, "SELECT business_key FROM pgwork.reminder_status WHERE business_key::int = 42"
    )
    assert got == [("42",)]


async def test_reminder_status_does_not_leak_to_a_noisy_function(apps: Apps) -> None:
    """A cheap pg_temp function that raises a NOTICE for every row it is shown sees only the
    app's own rows."""
    async with await apps.connect(apps.a) as c:
        notices: list[str] = []
        c.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        await c.execute(
            "CREATE FUNCTION pg_temp.peek(k text) RETURNS boolean LANGUAGE plpgsql COST 0.0001 AS "
            "$$ BEGIN RAISE NOTICE 'saw %', k; RETURN true; END $$"
        )
        cur = await c.execute(
            "SELECT business_key FROM pgwork.reminder_status WHERE pg_temp.peek(business_key)"
        )
        assert await cur.fetchall() == [("42",)]
        # Directly on the table too (row-level security's own quals come first).
        cur = await c.execute(
            "SELECT business_key FROM pgwork.reminder WHERE pg_temp.peek(business_key)"
        )
        assert await cur.fetchall() == [("42",)]
    assert notices and not [n for n in notices if BILLING_KEY in n], notices


async def test_reminder_status_does_not_leak_to_an_operator_of_the_apps_own(apps: Apps) -> None:
    async with await apps.connect(apps.a) as c:
        notices: list[str] = []
        c.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        await c.execute(
            "CREATE FUNCTION pg_temp.leaky_eq(x text, y text) RETURNS boolean LANGUAGE plpgsql "
            "COST 0.0001 AS $$ BEGIN RAISE NOTICE 'saw % %', x, y; RETURN x = y; END $$"
        )
        await c.execute(
            "CREATE OPERATOR pg_temp.=== (LEFTARG = text, RIGHTARG = text, FUNCTION = pg_temp.leaky_eq)"
        )
        cur = await c.execute(
            "SELECT business_key FROM pgwork.reminder_status "
            "WHERE business_key OPERATOR(pg_temp.===) '42'"
        )
        assert await cur.fetchall() == [("42",)]
    assert notices and not [n for n in notices if BILLING_KEY in n], notices


async def test_apps_cannot_learn_who_may_use_which_source(apps: Apps) -> None:
    """The role -> source mapping: an app sees its own rows, no one else's, and no function
    answers for another role."""
    got, _ = await apps.run(apps.a, "SELECT role::text, source FROM pgwork.app_source")
    assert got == [(apps.a, "leases")]
    got, _ = await apps.run(
        apps.a,
        "SELECT p.proname FROM pg_proc p WHERE p.pronamespace = 'pgwork'::regnamespace"
        " AND 'name'::regtype = ANY (p.proargtypes::regtype[])"
        " AND has_function_privilege(p.oid, 'EXECUTE')",
    )
    assert got == []  # no function of a role name (source_allowed(source, who) is gone)


async def test_apps_read_only_what_they_need_of_a_channel(
    apps: Apps, conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(
        "UPDATE pgwork.channel SET throttle_reason = %s, not_before = now() WHERE name = 'log'",
        (f"HTTP 429: slow down, {BILLING_KEY}",),
    )
    got, _ = await apps.run(apps.a, "SELECT name, kind, paused FROM pgwork.channel ORDER BY name")
    assert ("log", "log", False) in got
    for column in ("throttle_reason", "failures", "tokens", "*"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            await apps.run(apps.a, f"SELECT {column} FROM pgwork.channel")


async def test_the_daemon_pays_no_policy_call_per_row(
    apps: Apps, dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """With row-level security on and the daemon connected as a pgwork_daemon member, the
    policy's daemon branch is evaluated once per statement (an InitPlan), not once per row."""
    role = f"daemon_{os.getpid()}"
    await conn.execute(f'CREATE ROLE "{role}" LOGIN IN ROLE pgwork_daemon')
    try:
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 'leases', 'k' || i, now() + interval '1 day', 'log', 'r' "
            "FROM generate_series(1, 2000) AS i"
        )
        async with await psycopg.AsyncConnection.connect(dsn, user=role, autocommit=True) as c:
            cur = await c.execute(
                "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF)"
                " SELECT count(*) FROM pgwork.reminder"
            )
            plan = "\n".join(r[0] for r in await cur.fetchall())
            cur = await c.execute("SELECT count(*) FROM pgwork.reminder")
            seen = (await cur.fetchone() or [0])[0]
        assert seen == 2002
        assert "InitPlan" in plan, plan
        assert "SubPlan" not in plan, plan
        assert "source_allowed" not in plan
    finally:
        await conn.execute(f'DROP OWNED BY "{role}"')
        await conn.execute(f'DROP ROLE "{role}"')


async def test_rls_still_keeps_writes_to_the_apps_own_sources(apps: Apps) -> None:
    insert = (
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "VALUES (%s, 'x', now() + interval '1 day', 'log', 'r')"
    )
    await apps.run(apps.a, insert, ("leases",))
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
        await apps.run(apps.a, insert, ("billing",))
    got, _ = await apps.run(apps.b, "SELECT business_key FROM pgwork.reminder_status")
    assert got == [(BILLING_KEY,)]


async def test_rows_of_the_status_view_are_found_by_key_through_the_barrier(
    apps: Apps,
) -> None:
    """The barrier keeps leakproof conditions (text equality) pushed into the view: an app's
    lookup by key reads the key's index, not every reminder."""
    got, _ = await apps.run(
        apps.a,
        "EXPLAIN (COSTS OFF) SELECT status FROM pgwork.reminder_status"
        " WHERE source = 'leases' AND business_key = '42'",
    )
    plan = "\n".join(r[0] for r in got)
    assert "reminder_business_key_unique" in plan, plan


async def test_an_apps_open_insert_does_not_stop_a_daemon_starting_or_the_channel_controls(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """An app's uncommitted INSERT of a reminder holds FOR KEY SHARE on its channel's row (the
    foreign key). Registering channels at start, pausing, resuming and a claim must not wait for
    it: every daemon statement on pgwork.channel locks without touching the key."""
    from .helpers import config, count, delivered, python_channel, running, until

    await add(conn, "due-before", "now()")
    async with await psycopg.AsyncConnection.connect(dsn) as app:
        await app.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "VALUES ('test', 'open', now(), 'test', 'r')"
        )  # left open: a transaction in progress
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as op:
            await op.execute("SET lock_timeout = '1s'")
            await op.execute("SELECT pgwork.pause_channel('test')")
            await op.execute("SELECT pgwork.resume_channel('test')")
        with anyio.fail_after(20):
            async with running(config(python_channel()), dsn):
                await until(lambda: delivered(conn, 1), what="the committed reminder delivered")
        await app.rollback()
    assert await count(conn, "status = 'delivered'") == 1
