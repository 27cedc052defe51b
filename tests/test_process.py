"""Real daemon processes, real signals: the failure matrix from the brief.

Every process a test starts is killed at teardown, even when the test fails."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

from .helpers import add, count, rows, until, work
from .processes import DaemonProcess, hook, toml
from .receiver import Answer, Receiver, Request

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent


async def _delivered(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    return await count(conn, "status = 'delivered'") == n


async def test_end_to_end_run_then_sigterm_exits_0(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    with Receiver() as receiver:
        d = procs(dsn, toml(channel=hook(receiver.url)))
        await add(conn, "now", channel="hook")
        await add(conn, "soon", "now() + interval '1 second'", channel="hook")
        await until(lambda: _delivered(conn, 2), what="both delivered")
        d.signal(signal.SIGTERM)
        assert d.wait() == 0
    assert sorted(r.body["business_key"] for r in receiver.requests) == ["now", "soon"]
    events = [e.get("event") for e in d.lines()]
    assert "pgwork stopped" in events
    # The process ran on uvloop (a dependency here): what `daemon.event_loop = "auto"` picks.
    (running,) = [e for e in d.lines() if e.get("event") == "pgwork running"]
    assert running["event_loop"].startswith("uvloop "), running


@pytest.mark.parametrize(
    ("setting", "loop"), [("asyncio", "asyncio"), ("uvloop", "uvloop "), ("auto", "uvloop ")]
)
async def test_the_event_loop_is_the_one_configured(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any, setting: str, loop: str
) -> None:
    with Receiver() as receiver:
        d = procs(dsn, toml(channel=hook(receiver.url)), env={"PGWORK_DAEMON_EVENT_LOOP": setting})
        await add(conn, "k", channel="hook")
        await until(lambda: _delivered(conn, 1), what="delivered")
        d.signal(signal.SIGTERM)
        assert d.wait() == 0
    (running,) = [e for e in d.lines() if e.get("event") == "pgwork running"]
    assert running["event_loop"].startswith(loop), running


async def test_sigkill_after_send_retries_with_the_same_key(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    hold = threading.Event()

    def script(r: Request) -> Answer:
        return Answer(hold=hold) if r.n == 1 else Answer()

    with Receiver(script) as receiver:
        first = procs(dsn, toml(channel=hook(receiver.url), lease="1s"))
        await add(conn, "k", channel="hook")
        receiver.wait_for(1)  # sent...
        first.signal(signal.SIGKILL)  # ...and the worker dies before recording anything
        assert first.wait() == -signal.SIGKILL
        hold.set()
        procs(dsn, toml(channel=hook(receiver.url), lease="1s"))
        await until(lambda: _delivered(conn, 1), what="delivered by the second daemon")
        assert list(receiver.keys().values()) == [2]  # same key twice: one logical send
    ledger = await rows(conn, "SELECT lease, outcome FROM pgwork.attempt ORDER BY lease")
    assert [(x["lease"], x["outcome"]) for x in ledger] == [(1, "lease_expired"), (2, "delivered")]


async def test_worker_paused_past_its_lease_is_fenced(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    hold = threading.Event()

    def script(r: Request) -> Answer:
        return Answer(hold=hold) if r.n == 1 else Answer()

    with Receiver(script) as receiver:
        zombie = procs(dsn, toml(channel=hook(receiver.url, read_timeout="30s"), lease="1s"))
        await add(conn, "k", channel="hook")
        receiver.wait_for(1)
        zombie.signal(signal.SIGSTOP)  # paused mid-delivery, past its lease
        procs(dsn, toml(channel=hook(receiver.url), lease="1s"))
        await until(lambda: _delivered(conn, 1), what="delivered by the second daemon")
        hold.set()  # the zombie's request now succeeds too...
        zombie.signal(signal.SIGCONT)
        await until(lambda: _fenced_logged(zombie), what="the zombie's late outcome refused")
    (w,) = await work(conn)
    assert w["status"] == "delivered" and w["lease"] >= 2
    ledger = await rows(conn, "SELECT lease, outcome, error FROM pgwork.attempt ORDER BY lease")
    # The zombie's lease 1 was refused; the second daemon delivered once (normally at lease 2; a
    # connection error on its first attempt means a retry first, which is as correct).
    assert (ledger[0]["lease"], ledger[0]["outcome"]) == (1, "fenced")
    assert ledger[0]["error"].startswith("late outcome delivered")
    assert [x["outcome"] for x in ledger[1:]] == ["retry"] * (len(ledger) - 2) + ["delivered"]
    assert ledger[-1]["lease"] == w["lease"]


async def _fenced_logged(p: DaemonProcess) -> bool:
    return any(
        e.get("event") == "late outcome refused: the lease passed to another worker"
        for e in p.lines()
    )


async def test_workers_down_while_ticks_continue_then_drain(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    # A daemon without the hook channel keeps materialising; nobody delivers hook work.
    ticker = procs(dsn, toml(channel='[channels.log]\nkind = "log"'))
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT 's', 'k' || g, now(), 'hook', 'r' FROM generate_series(1, 50) g"
    )
    await until(lambda: _ready(conn, 50), what="50 ready rows")
    with Receiver() as receiver:
        procs(dsn, toml(channel=hook(receiver.url)))
        await until(lambda: _delivered(conn, 50), what="drained")
        assert len(receiver.keys()) == 50
    ticker.signal(signal.SIGTERM)
    assert ticker.wait() == 0


async def _ready(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    return await count(conn, "status = 'ready'") == n


async def test_worker_exiting_mid_batch_loses_nothing(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any, tmp_path: Path
) -> None:
    channel = '[channels.test]\nkind = "python"\ntarget = "tests.crashy:deliver"\nconcurrency = 8\n'
    with Receiver() as receiver:
        env = {
            "PGWORK_TEST_RECEIVER": receiver.url,
            "PGWORK_TEST_MARKER": str(tmp_path / "crashed"),
        }
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 's', CASE WHEN g = 5 THEN 'crash' ELSE 'k' || g END, now(), 'test', 'r' "
            "FROM generate_series(1, 40) g"
        )
        first = procs(dsn, toml(channel=channel, lease="1s"), env=env, ready=False)
        assert first.wait(30) == 3  # died mid-batch with claims held
        procs(dsn, toml(channel=channel, lease="1s"), env=env)
        await until(lambda: _delivered(conn, 40), what="all 40 delivered")
        keys = receiver.keys()
    assert len(keys) == 40  # every occurrence reached the receiver, 'crash' on its second attempt
    reclaimed = await rows(
        conn, "SELECT count(*) AS n FROM pgwork.attempt WHERE outcome = 'lease_expired'"
    )
    assert reclaimed[0]["n"] >= 1


async def test_several_daemon_processes_deliver_each_key_once(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    with Receiver() as receiver:
        for _ in range(3):
            procs(dsn, toml(channel=hook(receiver.url, concurrency=4)))
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 's', 'k' || g, now(), 'hook', 'r' FROM generate_series(1, 600) g"
        )
        await until(lambda: _delivered(conn, 600), timeout=60, what="600 delivered")
        keys = receiver.keys()
    assert len(keys) == 600 and set(keys.values()) == {1}
    per = await rows(
        conn,
        "SELECT count(DISTINCT daemon_id) AS daemons, max(lease) AS leases FROM pgwork.attempt",
    )
    assert per[0]["leases"] == 1  # no row was claimed twice
    assert per[0]["daemons"] >= 2


async def test_sigterm_with_deliveries_in_flight(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    # Grace shorter than the receiver's answer: deliveries are cancelled, leases released.
    with Receiver(lambda r: Answer(delay=4.0)) as receiver:
        d = procs(
            dsn, toml(channel=hook(receiver.url, read_timeout="30s"), grace="500ms", lease="60s")
        )
        for i in range(5):
            await add(conn, f"k{i}", channel="hook")
        receiver.wait_for(5)
        t0 = time.monotonic()
        d.signal(signal.SIGTERM)
        assert d.wait() == 0
        assert time.monotonic() - t0 < 4.0  # within grace, not after the receiver answered
    got = await work(conn)
    assert [(x["status"], x["attempts"]) for x in got] == [("ready", 0)] * 5
    ledger = await rows(conn, "SELECT outcome, count(*) AS n FROM pgwork.attempt GROUP BY outcome")
    assert ledger == [{"outcome": "released", "n": 5}]


async def test_sigterm_lets_short_deliveries_finish(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    with Receiver(lambda r: Answer(delay=1.0)) as receiver:
        d = procs(dsn, toml(channel=hook(receiver.url), grace="10s"))
        for i in range(3):
            await add(conn, f"k{i}", channel="hook")
        receiver.wait_for(3)
        d.signal(signal.SIGTERM)
        assert d.wait() == 0
    assert [x["status"] for x in await work(conn)] == ["delivered"] * 3


async def test_sigterm_during_a_claim_releases_what_that_claim_took(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any, admin_dsn: str
) -> None:
    """A stop while a claim statement runs: the stop waits for it and gives back its rows;
    none stays claimed until its lease expires, none is charged an attempt, none is sent. The
    claim is held up on purpose: the channel has a global concurrency, so its claim first
    locks the channel's row, which this test holds until after the SIGTERM."""
    with Receiver() as receiver:
        d = procs(dsn, toml(channel=hook(receiver.url, global_concurrency=5), lease="60s"))
        async with await psycopg.AsyncConnection.connect(dsn) as blocker:
            await blocker.execute(
                "SELECT 1 FROM pgwork.channel WHERE name = 'hook' FOR NO KEY UPDATE"
            )
            for i in range(10):
                await add(conn, f"k{i}", channel="hook")

            async def claim_waits() -> bool:
                got = await rows(
                    conn,
                    "SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query LIKE '%%pgwork.claim_lanes(%%' AND pid <> %s",
                    (blocker.info.backend_pid,),
                )
                return bool(got[0]["n"])

            await until(claim_waits, what="the daemon's claim to wait for the channel's row")
            d.signal(signal.SIGTERM)
            await anyio.sleep(0.5)
            await blocker.rollback()  # the claim goes on, after the stop began
        assert d.wait(30) == 0
    got = await rows(conn, "SELECT status, attempts FROM pgwork.renewal_work ORDER BY id")
    assert {r["status"] for r in got} == {"ready"}, got
    assert {r["attempts"] for r in got} == {0}
    assert receiver.requests == []


async def test_sigterm_under_continuous_load_does_not_wait_out_the_grace(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    # A no-op channel under a steady stream of due reminders: nothing takes long, so a stop must
    # not sit out the (long) grace period, and every row ends delivered or back to ready.
    channel = '[channels.test]\nkind = "python"\ntarget = "tests.sink:deliver"\nconcurrency = 8\n'
    d = procs(dsn, toml(channel=channel, grace="60s", lease="60s"))
    for i in range(40):
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 's', %s || g, now(), 'test', 'r' FROM generate_series(1, 300) g",
            (f"b{i}_",),
        )
        await anyio.sleep(0.05)
    t0 = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.wait(70) == 0
    assert time.monotonic() - t0 < 20
    left = await rows(conn, "SELECT status, count(*) AS n FROM pgwork.renewal_work GROUP BY 1")
    assert {r["status"] for r in left} <= {"delivered", "ready"}
    stuck = await count(conn, "status = 'ready' AND attempts > 0")
    assert stuck == 0  # released rows were not charged an attempt
