"""Loops that must neither spin, stall nor get killed, and health and metrics that tell the truth
(issue 8, items 5-13)."""

from __future__ import annotations

import json
import logging
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgwork.channels import Delivery
from pgwork.clock import Clock
from pgwork.daemon import Daemon

from . import sink
from .helpers import (
    add,
    config,
    count,
    delivered,
    materialise,
    python_channel,
    rows,
    running,
    statement,
    until,
    webhook_channel,
    work,
)
from .processes import DaemonProcess, toml
from .proxy import Proxy
from .receiver import Answer, Receiver
from .test_cli import pgwork
from .test_operations import NotifySocket

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("clean_sink")]


def _wakeups(d: Daemon, duty: str) -> float:
    total = 0.0
    for fam in d.metrics.registry.collect():
        if fam.name == "pgwork_wakeups":
            for s in fam.samples:
                if s.name == "pgwork_wakeups_total" and s.labels["duty"] == duty:
                    total += s.value
    return total


# -- item 5: no spinning -----------------------------------------------------------------------


async def test_claim_loop_does_not_spin_on_a_due_row_locked_by_an_app(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await add(conn, "locked")
    await materialise(dsn)
    async with await psycopg.AsyncConnection.connect(dsn) as app, running(config(), dsn) as d:
        await app.execute("SELECT 1 FROM pgwork.renewal_work FOR UPDATE")
        await anyio.sleep(0.3)
        before = _wakeups(d, "claim:test")
        await anyio.sleep(1.0)
        passes = _wakeups(d, "claim:test") - before
        await app.rollback()
        await until(lambda: _status_is(conn, "delivered"), what="delivered once unlocked")
    assert passes <= 25, f"{passes} claim passes in one second"


async def _status_is(conn: psycopg.AsyncConnection[Any], *status: str) -> bool:
    return [w["status"] for w in await work(conn)] == list(status)


async def test_materialiser_pages_from_the_earliest_accepted_deadline_without_spinning(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    # Accepted by the CHECKs; its 30-day occurrence fires in 1969.
    await add(conn, "early", "'1970-01-02 00:00+00'", before="{30 days, 0}")
    async with running(config(), dsn) as d:
        await until(lambda: _made(conn, 2), what="both 1970 occurrences materialised")
        before = _wakeups(d, "materialiser")
        await anyio.sleep(1.0)
        passes = _wakeups(d, "materialiser") - before
    assert passes <= 5, f"{passes} materialiser passes in one second"


async def _made(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    return len(await work(conn)) == n


# -- item 8: app row locks ---------------------------------------------------------------------


async def test_materialiser_skips_reminders_locked_by_an_app_and_comes_back(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    for i in range(5):
        await add(conn, f"k{i}", "now() - interval '1 minute'")
    async with await psycopg.AsyncConnection.connect(dsn) as app:
        await app.execute("SELECT 1 FROM pgwork.reminder WHERE business_key = 'k2' FOR UPDATE")
        with anyio.fail_after(3):  # the daemon's lock_timeout is 5 s: no waiting on the app
            res = await materialise(dsn)
        assert res.made == 4 and res.left_locked
        (st,) = await rows(conn, "SELECT last_cutoff FROM pgwork.materialiser_state")
        (k2,) = await rows(conn, "SELECT due_at FROM pgwork.reminder WHERE business_key = 'k2'")
        assert st["last_cutoff"] < k2["due_at"]  # the evidence stops short of the skipped one
        await app.rollback()
    res = await materialise(dsn)
    assert res.made == 1 and not res.left_locked
    assert await count(conn) == 5


async def test_materialiser_and_an_app_bulk_update_do_not_deadlock(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    n = 3000
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT 's', 'k' || g, now() - interval '1 minute', 'test', 'r' "
        "FROM generate_series(1, %s) g",
        (n,),
    )
    done = anyio.Event()

    async def app_updates() -> None:
        # Row locks in the opposite order to the materialiser's pages, then a reschedule that
        # makes every reminder due for materialisation again.
        async with await psycopg.AsyncConnection.connect(dsn) as app:
            for _ in range(8):
                await app.execute("SELECT id FROM pgwork.reminder ORDER BY id DESC FOR UPDATE")
                await app.execute("UPDATE pgwork.reminder SET due_at = due_at - interval '1s'")
                await app.commit()
        done.set()

    async def materialise_meanwhile() -> None:
        while not done.is_set():
            await materialise(dsn, page_size=500)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:  # DeadlockDetected would raise here
            tg.start_soon(app_updates)
            tg.start_soon(materialise_meanwhile)
    await materialise(dsn)
    made = await rows(
        conn, "SELECT count(*) AS n FROM pgwork.reminder_status WHERE status <> 'scheduled'"
    )
    assert made[0]["n"] == n


# -- item 7: an overall deadline per attempt ---------------------------------------------------


async def test_attempt_timeout_bounds_a_dripping_receiver(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    def script(r: Any) -> Answer:
        # Headers at once, then a byte every 0.2 s: never idle long enough for a read timeout.
        return Answer(body=b'{"ok": true, "pad": "' + b"x" * 100 + b'"}', drip=0.2)

    with Receiver(script) as receiver:
        ch = webhook_channel(receiver.url, max_attempts=2, read_timeout=2.0)
        from dataclasses import replace

        cfg = config(replace(ch, attempt_timeout=0.5))
        async with running(cfg, dsn):
            await add(conn, "drip", channel="hook")
            await until(lambda: _status_is(conn, "dead"), timeout=20, what="dead after 2 attempts")
    ledger = await rows(conn, "SELECT outcome, error_class, error FROM pgwork.attempt")
    assert [x["error_class"] for x in ledger] == ["AttemptTimeout"] * 2
    assert "attempt_timeout" in ledger[0]["error"]


async def test_attempt_timeout_bounds_a_hung_python_target(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    async def hang(d: Delivery) -> None:
        if d.attempt == 1:
            await anyio.sleep_forever()

    sink.BEHAVIOUR["hung"] = hang
    from dataclasses import replace

    cfg = config(replace(python_channel(), attempt_timeout=0.3))
    async with running(cfg, dsn):
        await add(conn, "hung")
        await until(lambda: _status_is(conn, "delivered"), what="delivered on the second attempt")
    ledger = await rows(conn, "SELECT outcome, error_class FROM pgwork.attempt ORDER BY lease")
    assert [(x["outcome"], x["error_class"]) for x in ledger] == [
        ("retry", "AttemptTimeout"),
        ("delivered", None),
    ]


async def test_a_target_that_swallows_its_timeout_leaves_the_next_attempt_alone(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A target that catches the cancellation of its overdue attempt and returns keeps that
    answer, and the worker's next attempt runs its full time: the timeout ends one attempt."""
    started = anyio.Event()

    async def swallow(d: Delivery) -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        except BaseException:  # what a careless target does with the cancellation
            return

    async def slow(d: Delivery) -> None:
        await anyio.sleep(0.5)  # longer than a reaper tick, shorter than the limit

    sink.BEHAVIOUR["swallow"] = swallow
    sink.BEHAVIOUR["next"] = slow
    from dataclasses import replace

    cfg = config(replace(python_channel(concurrency=1), attempt_timeout=0.8))
    async with running(cfg, dsn):
        await add(conn, "swallow")
        await started.wait()
        await add(conn, "next")
        await until(lambda: _status_is(conn, "delivered", "delivered"), what="both delivered")
    ledger = await rows(
        conn,
        "SELECT w.business_key, a.outcome, a.error_class FROM pgwork.attempt a "
        "JOIN pgwork.renewal_work w ON w.id = a.work_id ORDER BY a.finished_at",
    )
    assert [(x["business_key"], x["outcome"], x["error_class"]) for x in ledger] == [
        ("swallow", "delivered", None),
        ("next", "delivered", None),
    ]


# -- item 6: the watchdog measures progress, not pass length -----------------------------------


@pytest.mark.slow
async def test_watchdog_is_fed_through_a_retention_pass_longer_than_its_interval(
    dsn: str, conn: psycopg.AsyncConnection[Any], tmp_path: Path
) -> None:
    await conn.execute(
        "INSERT INTO pgwork.renewal_work (reminder_id, source, business_key, deadline, occurrence, "
        "due_at, channel, operation_id, status, available_at, attempts, lease, finished_at) "
        "SELECT -g, 's', 'k' || g, now(), '0', now(), 'log', md5(g::text)::uuid, 'delivered', now(), "
        "1, 1, now() - interval '40 days' FROM generate_series(1, 30000) g"
    )
    ns = NotifySocket(tmp_path / "notify.sock")
    extra = '[retention]\nbatch_size = 200\npause = "30ms"\ninterval = "1h"\n'
    d = DaemonProcess(
        dsn,
        tmp_path,
        toml(channel='[channels.log]\nkind = "log"', extra=extra),
        "wd",
        env={"NOTIFY_SOCKET": str(ns.path), "WATCHDOG_USEC": "1000000"},
    )
    try:
        await anyio.to_thread.run_sync(d.wait_ready)
        await anyio.to_thread.run_sync(ns.pump, 1.5)  # the first retention pass begins
        left_at_start = await count(conn)
        during = await anyio.to_thread.run_sync(ns.pump, 3.0)
        left_after = await count(conn)
        # The pass was running throughout (rows still going), and the watchdog was fed.
        assert 0 < left_after < left_at_start
        pings = [x for _, x in during if x == "WATCHDOG=1"]
        assert len(pings) >= 4, during
        assert not any("not feeding the watchdog" in e.get("event", "") for e in d.lines())
        d.signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(d.wait) == 0
    finally:
        d.kill()
        ns.close()


# -- item 9: back within a second or so after an outage ----------------------------------------


@pytest.mark.slow
async def test_duties_look_again_soon_after_a_long_outage(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    d = conninfo_to_dict(dsn)
    with Proxy(str(d["host"]), int(str(d["port"]))) as proxy:
        via = make_conninfo(dsn, host="127.0.0.1", port=str(proxy.port))
        async with running(config(tick=120.0, connect_timeout=1.0), via):
            await add(conn, "before")
            await until(lambda: delivered(conn, 1), what="first delivery")
            proxy.cut()
            await anyio.sleep(30)  # every duty's backoff grows to 8-30 s
            await add(conn, "after")  # due now; its NOTIFY is lost with the listener
            proxy.restore()
            back = time.monotonic()
            await until(lambda: delivered(conn, 2), timeout=30, what="delivery after recovery")
            took = time.monotonic() - back
            print(f"first delivery {took:.2f}s after the database came back")
    assert took < 4.0, f"first delivery {took:.1f}s after the database came back"


# -- item 10: lag without a daemon -------------------------------------------------------------


async def test_status_lag_counts_overdue_reminders_with_no_daemon(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT 's', 'k' || g, now() - interval '120 seconds', 'log', 'r' "
        "FROM generate_series(1, 200) g"
    )
    st = await anyio.to_thread.run_sync(lambda: pgwork("status", "--json", dsn=dsn))
    assert st.returncode == 0, st.stderr
    lag = json.loads(st.stdout)["lag"]
    assert lag["lag_seconds"] >= 120 and lag["unmaterialised_seconds"] >= 120
    r = await anyio.to_thread.run_sync(lambda: pgwork("status", "--max-lag", "1s", dsn=dsn))
    assert r.returncode == 1 and "exceeds --max-lag" in r.stderr


# -- item 11: gauges cost O(live rows) ---------------------------------------------------------


async def test_gauge_queries_read_no_retained_rows(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(
        "INSERT INTO pgwork.renewal_work (reminder_id, source, business_key, deadline, occurrence, "
        "due_at, channel, operation_id, status, available_at, attempts, lease, finished_at) "
        "SELECT -g, 's', 'k' || g, now(), '0', now(), 'log', md5(g::text)::uuid, 'delivered', now(), "
        "1, 1, now() - interval '1 day' FROM generate_series(1, 50000) g"
    )
    await conn.execute("ANALYZE pgwork.renewal_work")
    from pgwork.queries import Q

    for name in ("work_states", "lag", "retention_state"):
        plan = await rows(conn, "EXPLAIN (FORMAT JSON) " + Q[name])
        assert "renewal_work" not in _seq_scanned(plan[0]["QUERY PLAN"]), (name, plan)


async def test_lag_by_source_reads_one_probe_per_source_not_the_reminders(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """The per-source lag gauge reads each source's earliest occurrence by key: 20,000 reminders
    of two apps, all made, and 50,000 retained rows are not read."""
    for src in ("a", "b"):
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT %s, 'k' || g, now() - interval '1 day', 'log', 'r' "
            "FROM generate_series(1, 10000) g",
            (src,),
        )
    await conn.execute("UPDATE pgwork.reminder SET next_fire_at = 'infinity'")
    await add(conn, "late", "now() - interval '1 hour'", source="b", channel="log")
    await conn.execute("ANALYZE pgwork.reminder")
    from pgwork.queries import Q

    plan = await rows(conn, "EXPLAIN (FORMAT JSON) " + Q["lag_by_source"])
    assert not _seq_scanned(plan[0]["QUERY PLAN"]) & {"reminder", "renewal_work"}, plan
    got = await statement(conn, "lag_by_source")
    assert [(r["source"], r["unmaterialised"]) for r in got] == [("b", True)]
    assert got[0]["lag_seconds"] >= 3600


def _seq_scanned(plan: Any) -> set[str]:
    """The relations a JSON plan reads with a Seq Scan."""
    found: set[str] = set()
    if isinstance(plan, dict):
        if plan.get("Node Type") == "Seq Scan":
            found.add(plan["Relation Name"])
        for v in plan.values():
            found |= _seq_scanned(v)
    elif isinstance(plan, list):
        for v in plan:
            found |= _seq_scanned(v)
    return found


async def test_no_gauge_duty_without_metrics(dsn: str) -> None:
    async with running(config(metrics_enabled=False, metrics_interval=0.05), dsn) as d:
        await anyio.sleep(0.5)
        assert _wakeups(d, "metrics") == 0
        assert _wakeups(d, "heartbeat") + _wakeups(d, "materialiser") > 0


# -- item 12: one clock ------------------------------------------------------------------------


async def test_a_skewed_host_clock_is_reported_at_start(
    dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import pgwork.clock

    class Fast(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.now(tz) + timedelta(seconds=2)

    monkeypatch.setattr(pgwork.clock, "datetime", Fast)
    caplog.set_level(logging.WARNING, logger="pgwork.clock")
    async with running(config(), dsn) as d:
        assert -2.5 < d.clock.skew < -1.5
        # Times still come out by the database's clock.
        assert abs((d.clock.now() - datetime.now(UTC)).total_seconds()) < 0.5
        assert abs(d.clock.seconds_since(datetime.now(UTC), time.monotonic())) < 0.5
    assert any("2.0s ahead of the database's" in r.getMessage() for r in caplog.records)


def test_clock_maps_monotonic_time() -> None:
    c = Clock()
    t = time.monotonic()
    assert abs((c.db_time(t + 10) - c.db_time(t)).total_seconds() - 10) < 1e-6
    for instant in (c.db_time(t - 3.5), datetime(2020, 2, 29, 12, tzinfo=UTC), c.db_time(t + 1)):
        want = (c.db_time(t) - instant).total_seconds()
        assert abs(c.seconds_since(instant, t) - want) < 1e-5


# -- item 13: daemons that are gone ------------------------------------------------------------


async def test_status_marks_gone_daemons_and_heartbeats_forget_them(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    # Killed with their listener up: its last heartbeat said so (issue 68: a GONE daemon showed
    # its listener up, in status and its JSON).
    await conn.execute(
        "INSERT INTO pgwork.daemon (id, host, pid, version, heartbeat_at, heartbeat_every, "
        "listener_up) VALUES "
        "('recent-gone', 'h', 1, 'x', now() - interval '2 minutes', '20 seconds', true), "
        "('long-gone', 'h', 2, 'x', now() - interval '2 hours', '20 seconds', true)"
    )
    st = await anyio.to_thread.run_sync(lambda: pgwork("status", dsn=dsn))
    assert st.returncode == 0, st.stderr
    gone = [ln.split() for ln in st.stdout.splitlines() if "GONE" in ln]
    assert sorted(g[0] for g in gone) == ["long-gone", "recent-gone"], st.stdout
    assert not any("True" in g for g in gone), st.stdout
    doc = await anyio.to_thread.run_sync(lambda: pgwork("status", "--json", dsn=dsn))
    assert [d["listener_up"] for d in json.loads(doc.stdout)["daemons"]] == [False, False]
    async with running(config(lease=0.6), dsn):
        await until(lambda: _daemons(conn, {"recent-gone"}), what="the long-gone daemon forgotten")


async def _daemons(conn: psycopg.AsyncConnection[Any], expected: set[str]) -> bool:
    ids = {r["id"] for r in await rows(conn, "SELECT id FROM pgwork.daemon")}
    return expected <= ids and "long-gone" not in ids


async def test_status_says_ahead_by_for_a_cutoff_in_the_future(dsn: str) -> None:
    await materialise(dsn, lookahead=300)
    st = await anyio.to_thread.run_sync(lambda: pgwork("status", dsn=dsn))
    assert st.returncode == 0, st.stderr
    (line,) = [ln for ln in st.stdout.splitlines() if ln.startswith("materialiser:")]
    assert "ahead by 29" in line or "ahead by 30" in line, line
    assert "-" not in line.split("(")[1].split(")")[0]  # no negative age


async def test_the_daemon_row_shows_the_listener_up_from_the_start(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """`pgwork status` showed `listener_up False` for a whole heartbeat interval after a start
    (20 s at the default lease): the row was written before the LISTEN connection was made, and
    only the next heartbeat corrected it. The heartbeat now writes as soon as the listener's
    state changes."""
    async with running(config(lease=60.0), dsn) as d:
        await until(
            lambda: _listener_up(conn, d.daemon_id),
            timeout=5,
            what="the daemon row to show the listener up (heartbeat every 20 s)",
        )


async def _listener_up(conn: psycopg.AsyncConnection[Any], daemon_id: str) -> bool:
    got = await rows(conn, "SELECT listener_up FROM pgwork.daemon WHERE id = %s", (daemon_id,))
    return bool(got) and got[0]["listener_up"] is True
