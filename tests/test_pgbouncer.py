"""pgwork through a real PgBouncer in transaction-pooling mode: the delivery path, retention,
the commands, and daemon processes killed mid-delivery. With ``database.pooler = "transaction"``
pgwork keeps no session state, prepares no statement, and LISTENs only on ``listen_dsn``."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import anyio
import psycopg
import pytest

from pgwork.config import RetentionPolicy

from .helpers import add, config, count, rows, running, until
from .pgbouncer import PgBouncer
from .processes import hook, toml
from .receiver import Receiver
from .test_cli import pgwork

pytestmark = pytest.mark.anyio


async def _delivered(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    return await count(conn, "status = 'delivered'") == n


async def test_without_pooler_mode_pgbouncer_refuses_the_connection(
    dsn: str, pgbouncer: PgBouncer
) -> None:
    """What the option is for: pgwork's session settings travel as a startup parameter, which a
    transaction pooler refuses; the command says so in one line, naming the setting (issue 68:
    it said only "unsupported startup parameter: options"), and `pgwork run` does not retry."""
    r = pgwork("status", dsn=pgbouncer.dsn(dsn))
    assert r.returncode == 3 and "options" in r.stderr, r.stderr
    assert 'database.pooler = "transaction"' in r.stderr, r.stderr
    r = pgwork("run", dsn=pgbouncer.dsn(dsn))
    assert r.returncode == 3 and 'database.pooler = "transaction"' in r.stderr, r.stderr[-2000:]
    r = pgwork("status", dsn=pgbouncer.dsn(dsn), env={"PGWORK_DATABASE_POOLER": "transaction"})
    assert r.returncode == 0, r.stderr


async def test_daemon_through_pgbouncer_with_a_direct_listener(
    dsn: str, conn: psycopg.AsyncConnection[Any], pgbouncer: PgBouncer
) -> None:
    """The pool goes through PgBouncer, LISTEN goes direct: a reminder due now is delivered
    long before the tick, and retention's per-batch limits work without session state."""
    cfg = config(
        pooler="transaction",
        listen_dsn=dsn,
        tick=30.0,
        retention_interval=0.2,
        retention=RetentionPolicy(keep=0.0, pause=0.0),
    )
    async with running(cfg, pgbouncer.dsn(dsn)) as d:
        await anyio.sleep(0.5)  # the first materialiser pass is over: only NOTIFY can wake it
        t0 = time.monotonic()
        await add(conn, "now")
        await until(
            lambda: _retired(conn, 1), timeout=10, what="delivered, then retired by retention"
        )
        assert time.monotonic() - t0 < 5, "woken by the tick, not by NOTIFY"
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 's', 'k' || g, now(), 'test', 'r' FROM generate_series(1, 300) g"
        )
        await until(lambda: _retired(conn, 301), timeout=30, what="300 more")
        assert d.metrics.registry.get_sample_value("pgwork_listener_up") == 1
        # No pass of any duty failed: no prepared statement met another client's server
        # connection, no session setting was missing.
        failures = [
            s
            for m in d.metrics.registry.collect()
            if m.name == "pgwork_duty_failures"
            for s in m.samples
            if s.name.endswith("_total") and s.value
        ]
        assert failures == []
    assert await count(conn) == 0  # every work row went through retention, through PgBouncer


async def _retired(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    got = await rows(conn, "SELECT count(*) AS n FROM pgwork.retired")
    return int(got[0]["n"]) == n


async def test_without_listen_dsn_the_tick_finds_the_work(
    dsn: str, conn: psycopg.AsyncConnection[Any], pgbouncer: PgBouncer
) -> None:
    cfg = config(pooler="transaction", tick=0.3)
    async with running(cfg, pgbouncer.dsn(dsn)):
        await add(conn, "k")
        await until(lambda: _delivered(conn, 1), what="delivered by the tick")
        daemon = await rows(conn, "SELECT listener_up FROM pgwork.daemon")
        assert daemon == [{"listener_up": None}]
        r = pgwork(
            "status",
            "--json",
            dsn=pgbouncer.dsn(dsn),
            env={"PGWORK_DATABASE_POOLER": "transaction"},
        )
        assert r.returncode == 0, r.stderr
        assert [x["listener_up"] for x in json.loads(r.stdout)["daemons"]] == [None]
        assert (
            "off"
            in pgwork(
                "status", dsn=pgbouncer.dsn(dsn), env={"PGWORK_DATABASE_POOLER": "transaction"}
            ).stdout
        )


@pytest.mark.slow
async def test_daemon_processes_through_pgbouncer_one_killed_mid_delivery(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any, pgbouncer: PgBouncer
) -> None:
    """Three daemon processes through PgBouncer, one SIGKILLed while delivering: every
    occurrence reaches the receiver, a repeat only with the same key."""
    with Receiver() as receiver:
        extra = f'[database]\npooler = "transaction"\nlisten_dsn = "{dsn}"\n'
        cfg = toml(channel=hook(receiver.url, concurrency=4), lease="2s", extra=extra)
        daemons = [procs(pgbouncer.dsn(dsn), cfg) for _ in range(3)]
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 's', 'k' || g, now(), 'hook', 'r' FROM generate_series(1, 600) g"
        )
        await until(lambda: _some_delivered(conn), what="deliveries under way")
        daemons[0].signal(signal.SIGKILL)
        await until(lambda: _delivered(conn, 600), timeout=60, what="600 delivered")
        keys = receiver.keys()
    assert len(keys) == 600  # none lost; a repeat (the killed daemon's) has the same key
    assert await count(conn, "status <> 'delivered'") == 0
    for d in daemons[1:]:
        logged = d.log.read_text(errors="replace")
        assert "prepared statement" not in logged, logged[-2000:]


async def _some_delivered(conn: psycopg.AsyncConnection[Any]) -> bool:
    return await count(conn, "status = 'delivered'") >= 50
