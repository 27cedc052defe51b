"""Claim and deliver, in-process: exactly one send per occurrence, fencing, retries, dead
letters, concurrency limits and the two-stage stop. Real Postgres, real daemon code."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import anyio
import psycopg
import pytest

from pgwork import channels, db
from pgwork.channels import Delivered, Delivery, Failed, Outcome, Retry
from pgwork.config import ChannelConfig, ConfigError
from pgwork.daemon import Daemon
from pgwork.store import ClaimKey, Identity

from . import sink
from .helpers import (
    add,
    claim,
    config,
    count,
    materialise,
    python_channel,
    rows,
    running,
    statement,
    unclaim,
    until,
    work,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("clean_sink")]


async def test_due_reminders_are_delivered_exactly_once(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient, payload) "
        "SELECT 's', 'k' || g, now() - g * interval '1 second', 'test', 'r' || g, jsonb_build_object('n', g) "
        "FROM generate_series(1, 300) g"
    )
    async with running(config(), dsn):
        await until(lambda: _eq(conn, 300), what="300 delivered")
    keys = [d.operation_id for d in sink.DELIVERED]
    assert len(keys) == len(set(keys)) == 300
    d = next(x for x in sink.DELIVERED if x.business_key == "k7")
    assert (d.recipient, d.payload, d.attempt, d.occurrence) == ("r7", {"n": 7}, 1, timedelta(0))
    ledger = await rows(conn, "SELECT outcome, count(*) AS n FROM pgwork.attempt GROUP BY outcome")
    assert ledger == [{"outcome": "delivered", "n": 300}]


async def test_a_new_kind_of_channel_needs_no_migration(
    dsn: str, conn: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A channel's kind was a CHECK in the database (log, webhook, python): a new kind of
    channel needed a schema version and a migration before a daemon could register it. A kind
    is its channel module's own declaration now: one the database never heard of registers and
    delivers."""
    sent: list[str] = []

    @dataclass
    class Sms:  # a new module of pgwork/channels/ declares it as its KIND's make
        config: ChannelConfig

        async def deliver(self, d: Delivery) -> Outcome:
            sent.append(d.business_key)
            return Delivered()

        async def aclose(self) -> None:
            return None

    def read(*_: Any) -> None:
        return None

    monkeypatch.setitem(
        channels.KINDS, "sms", channels.Kind(name="sms", options=type(None), read=read, make=Sms)
    )
    async with running(config(ChannelConfig(name="sms", kind="sms")), dsn):
        await add(conn, "text:1", channel="sms")  # the daemon registered the channel
        await until(lambda: _eq(conn, 1), what="the text sent")
    assert sent == ["text:1"]
    assert await rows(conn, "SELECT kind FROM pgwork.channel WHERE name = 'sms'") == [
        {"kind": "sms"}
    ]


async def _eq(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    return await count(conn, "status = 'delivered'") == n


async def test_two_daemons_share_the_work_without_double_claims(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT 's', 'k' || g, now(), 'test', 'r' FROM generate_series(1, 1000) g"
    )

    async def slowish(d: Delivery) -> None:
        await anyio.sleep(0.002)

    sink.DEFAULT.append(slowish)
    cfg = config(python_channel(concurrency=8), claim_batch=10)
    async with running(cfg, dsn) as a, running(cfg, dsn) as b:
        await until(lambda: _eq(conn, 1000), what="1000 delivered")
    assert len(sink.DELIVERED) == len({d.operation_id for d in sink.DELIVERED}) == 1000
    per_daemon = await rows(
        conn, "SELECT daemon_id, count(*) AS n FROM pgwork.attempt GROUP BY daemon_id"
    )
    assert {r["daemon_id"] for r in per_daemon} == {a.daemon_id, b.daemon_id}
    assert (await rows(conn, "SELECT max(lease) AS m FROM pgwork.renewal_work"))[0]["m"] == 1


async def test_retry_with_backoff_then_success(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    async def flaky(d: Delivery) -> Retry | None:
        return Retry(error="try later", delay=0.2) if d.attempt < 3 else None

    sink.BEHAVIOUR["k"] = flaky
    await add(conn, "k")
    async with running(config(), dsn):
        await until(lambda: _eq(conn, 1), what="delivered")
    ledger = await rows(
        conn, "SELECT attempt, outcome, started_at, finished_at FROM pgwork.attempt ORDER BY lease"
    )
    assert [(x["attempt"], x["outcome"]) for x in ledger] == [
        (1, "retry"),
        (2, "retry"),
        (3, "delivered"),
    ]
    # The retry was not attempted before its delay.
    assert ledger[1]["started_at"] - ledger[0]["finished_at"] >= timedelta(seconds=0.19)
    assert len({d.operation_id for d in sink.DELIVERED}) == 1


async def test_exception_in_channel_is_a_retry(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    async def boom(d: Delivery) -> None:
        if d.attempt == 1:
            raise ConnectionResetError("receiver went away")

    sink.BEHAVIOUR["k"] = boom
    await add(conn, "k")
    async with running(config(), dsn):
        await until(lambda: _eq(conn, 1), what="delivered")
    ledger = await rows(
        conn, "SELECT outcome, error_class, error FROM pgwork.attempt ORDER BY lease"
    )
    assert ledger[0]["outcome"] == "retry" and ledger[0]["error_class"] == "ConnectionResetError"
    assert "receiver went away" in ledger[0]["error"]


async def test_a_dead_letter_is_logged_as_one(
    dsn: str, conn: psycopg.AsyncConnection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Its line said `"attempt retry"` with outcome retry, like any retry: the attempt that spent
    the budget is logged as a dead letter, at warning, with the attempt's own outcome."""

    async def always(d: Delivery) -> Retry:
        return Retry(error="down", delay=0)

    sink.BEHAVIOUR["k"] = always
    await add(conn, "k")
    caplog.set_level("INFO", logger="pgwork")
    async with running(config(python_channel(max_attempts=2)), dsn):
        await until(lambda: _dead(conn, 1), what="dead")
        await anyio.sleep(0.2)
    lines = [
        r for r in caplog.records if r.name.startswith("pgwork") and getattr(r, "work_id", None)
    ]
    assert [r.getMessage() for r in lines] == ["attempt retry", "dead letter after attempt retry"]
    dead = lines[-1]
    assert (dead.levelname, dead.__dict__["outcome"], dead.__dict__["status"]) == (
        "WARNING",
        "retry",
        "dead",
    )


async def test_budget_spent_goes_dead_then_redrive_delivers_once(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    async def always(d: Delivery) -> Retry:
        return Retry(error="down", delay=0)

    sink.BEHAVIOUR["k"] = always
    await add(conn, "k")
    async with running(config(python_channel(max_attempts=3)), dsn):
        await until(lambda: _dead(conn, 1), what="dead")
        (w,) = await work(conn)
        assert (w["attempts"], w["dead_reason"]) == (
            3,
            "attempt budget spent (3 attempts); last error: down",
        )
        del sink.BEHAVIOUR["k"]
        async with await db.connect(dsn) as c:
            redriven = await statement(
                c,
                "dlq_redrive",
                {
                    "all": True,
                    "ids": [],
                    "channel": None,
                    "source": None,
                    "operator": "op@test",
                    "since": None,
                    "reason_like": None,
                },
            )
        assert [r["verdict"] for r in redriven] == ["ok"]
        await until(lambda: _eq(conn, 1), what="delivered after redrive")
    (w,) = await work(conn)
    assert (w["attempts"], w["attempts_base"], w["redriven_by"]) == (4, 3, "op@test")
    assert len({d.operation_id for d in sink.DELIVERED}) == 1  # same key on every attempt


async def _dead(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    return await count(conn, "status = 'dead'") == n


async def test_permanent_failure_dead_letters_at_once(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    async def bad(d: Delivery) -> Failed:
        return Failed(error="recipient unknown")

    sink.BEHAVIOUR["k"] = bad
    await add(conn, "k")
    async with running(config(), dsn):
        await until(lambda: _dead(conn, 1), what="dead")
    (w,) = await work(conn)
    assert (w["attempts"], w["dead_reason"]) == (1, "permanent failure: recipient unknown")


async def test_redrive_refuses_cancelled_and_moved(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    async def bad(d: Delivery) -> Failed:
        return Failed(error="no")

    sink.DEFAULT.append(bad)
    await add(conn, "gone")
    await add(conn, "moved")
    async with running(config(), dsn):
        await until(lambda: _dead(conn, 2), what="dead")
    await conn.execute("DELETE FROM pgwork.reminder WHERE business_key = 'gone'")
    await conn.execute(
        "UPDATE pgwork.reminder SET due_at = due_at + interval '1 day' WHERE business_key = 'moved'"
    )
    async with await db.connect(dsn) as c:
        got = await statement(
            c,
            "dlq_redrive",
            {
                "all": True,
                "ids": [],
                "channel": None,
                "source": None,
                "operator": "op",
                "since": None,
                "reason_like": None,
            },
        )
    assert sorted(r["verdict"] for r in got) == ["cancelled", "superseded"]
    assert await count(conn, "status = 'dead'") == 2


async def test_claim_rereads_business_state(dsn: str, conn: psycopg.AsyncConnection[Any]) -> None:
    # Rows already claimed (so the reminder triggers leave them alone), then their lease expires
    # after the reminder was deleted or moved: the next claim closes them; nothing is sent.
    await add(conn, "gone")
    await add(conn, "moved")
    await materialise(dsn)
    assert len(await claim(dsn, lease=0.2)) == 2
    await conn.execute("DELETE FROM pgwork.reminder WHERE business_key = 'gone'")
    await conn.execute(
        "UPDATE pgwork.reminder SET due_at = due_at + interval '1 day' WHERE business_key = 'moved'"
    )
    await anyio.sleep(0.3)
    got = await claim(dsn, lease=5)
    assert sorted((r["business_key"], r["status"]) for r in got) == [
        ("gone", "cancelled"),
        ("moved", "superseded"),
    ]
    assert (
        sorted(x["outcome"] for x in await rows(conn, "SELECT outcome FROM pgwork.attempt"))
        == ["lease_expired"] * 2
    )


async def test_expired_lease_on_last_attempt_goes_dead(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await add(conn, "k")
    await materialise(dsn)
    await claim(dsn, lease=0.1, max_attempts=1)
    await anyio.sleep(0.2)
    (r,) = await claim(dsn, lease=5, max_attempts=1)
    assert (r["status"], r["attempts"]) == ("dead", 1)


async def test_fencing_refuses_a_late_outcome(dsn: str, conn: psycopg.AsyncConnection[Any]) -> None:
    await add(conn, "k")
    await materialise(dsn)
    (first,) = await claim(dsn, lease=0.1)
    await anyio.sleep(0.2)
    (second,) = await claim(dsn, lease=30)
    assert (first["lease"], second["lease"], second["prev_status"]) == (1, 2, "claimed")

    async with await db.connect(dsn) as c:

        def outcome(lease: int, status: str, ledger: str | None = None) -> dict[str, Any]:
            import json
            from datetime import UTC, datetime

            now = datetime.now(UTC).isoformat()
            rec = {
                "work_id": second["id"],
                "lease": lease,
                "attempt": lease,
                "outcome": ledger or status,
                "status": status,
                "started_at": now,
                "finished_at": now,
            }
            return {"outcomes": json.dumps([rec]), "daemon_id": "d", "host": "h", "pid": 1}

        # The zombie (lease 1) reports late: refused, and the ledger says so.
        fenced = await statement(c, "record_outcomes", outcome(1, "dead", "failed"))
        assert [r["fenced_id"] for r in fenced] == [second["id"]]
        # Its heartbeat is refused too.
        assert (
            await statement(
                c,
                "extend_leases",
                {"work_id": [second["id"]], "lease_no": [1], "lease": timedelta(seconds=60)},
            )
            == []
        )
        # The current holder's outcome is accepted.
        assert await statement(c, "record_outcomes", outcome(2, "delivered")) == []
    (w,) = await work(conn)
    assert (w["status"], w["lease"]) == ("delivered", 2)
    ledger = await rows(conn, "SELECT lease, outcome, error FROM pgwork.attempt ORDER BY lease")
    assert [(x["lease"], x["outcome"]) for x in ledger] == [(1, "fenced"), (2, "delivered")]
    assert ledger[0]["error"].startswith("late outcome failed")


async def test_a_claim_lost_with_a_crash_does_not_hide_its_successor_s_outcome(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A claim committed asynchronously can vanish in a database crash while its request is
    out: the row is claimed again under the same lease number. When the first claim's late
    outcome is fenced before the second claim's outcome lands, the ledger must still say the
    occurrence was delivered (seen in tests/test_crash.py's asynchronous case, by chance)."""
    await add(conn, "k")
    await materialise(dsn)
    (first,) = await claim(dsn, lease=30)
    # What the crash leaves: the claim never happened.
    await unclaim(conn, first["id"])

    def outcome(status: str) -> dict[str, Any]:
        rec = {"work_id": first["id"], "lease": 1, "attempt": 1, "outcome": status}
        rec["status"] = status
        return {"outcomes": json.dumps([rec]), "daemon_id": "d", "host": "h", "pid": 1}

    async with await db.connect(dsn) as c:
        # The lost claim's answer comes back: refused, the row is not claimed.
        fenced = await statement(c, "record_outcomes", outcome("delivered"))
        assert [r["fenced_id"] for r in fenced] == [first["id"]]
        (second,) = await claim(dsn, lease=30)
        assert second["lease"] == 1
        assert await statement(c, "record_outcomes", outcome("delivered")) == []
    (w,) = await work(conn)
    assert (w["status"], w["lease"]) == ("delivered", 1)
    ledger = await rows(conn, "SELECT lease, outcome FROM pgwork.attempt")
    assert [(x["lease"], x["outcome"]) for x in ledger] == [(1, "delivered")]


async def test_concurrency_limit_per_channel(dsn: str, conn: psycopg.AsyncConnection[Any]) -> None:
    live = 0
    peak = 0

    async def slow(d: Delivery) -> None:
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        await anyio.sleep(0.1)
        live -= 1

    sink.DEFAULT.append(slow)
    for i in range(12):
        await add(conn, f"k{i}")
    async with running(config(python_channel(concurrency=3)), dsn):
        await until(lambda: _eq(conn, 12), what="12 delivered")
    assert peak == 3


async def test_a_stuck_channel_does_not_starve_another(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    stuck = anyio.Event()

    async def hang(d: Delivery) -> None:
        await stuck.wait()

    sink.DEFAULT.append(hang)
    await conn.execute("INSERT INTO pgwork.channel (name, kind) VALUES ('other', 'python')")
    for i in range(5):
        await add(conn, f"stuck{i}", channel="test")

    async def fine(d: Delivery) -> None:
        return None

    for i in range(5):
        await add(conn, f"fine{i}", channel="other")
        sink.BEHAVIOUR[f"fine{i}"] = fine
    cfg = config(python_channel("test", concurrency=2), python_channel("other", concurrency=2))
    async with running(cfg, dsn):
        await until(lambda: _eq(conn, 5), what="the other channel's five")
        assert await count(conn, "channel = 'test' AND status = 'delivered'") == 0
        stuck.set()


async def test_graceful_stop_finishes_in_flight(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    started = anyio.Event()

    async def slow(d: Delivery) -> None:
        started.set()
        await anyio.sleep(0.3)

    sink.DEFAULT.append(slow)
    await add(conn, "k")
    async with running(config(shutdown_grace=5), dsn):
        await started.wait()
    # Stopped while the delivery ran: it was allowed to finish and its outcome was written.
    (w,) = await work(conn)
    assert w["status"] == "delivered"


async def test_stop_past_grace_releases_without_counting(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    started = anyio.Event()

    async def forever(d: Delivery) -> None:
        started.set()
        await anyio.sleep_forever()

    sink.DEFAULT.append(forever)
    await add(conn, "k")
    async with running(config(shutdown_grace=0.3), dsn):
        await started.wait()
    (w,) = await work(conn)
    assert (w["status"], w["attempts"], w["lease"]) == ("ready", 0, 1)
    ledger = await rows(conn, "SELECT outcome FROM pgwork.attempt")
    assert ledger == [{"outcome": "released"}]


async def test_second_stop_request_cancels_at_once(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    started = anyio.Event()

    async def forever(d: Delivery) -> None:
        started.set()
        await anyio.sleep_forever()

    sink.DEFAULT.append(forever)
    await add(conn, "k")
    d = Daemon(config(shutdown_grace=60), dsn)
    with anyio.fail_after(10):  # far less than the 60 s grace
        async with anyio.create_task_group() as tg:
            await tg.start(d.run)
            await started.wait()
            d.request_stop()
            await anyio.sleep(0.2)
            d.request_stop()
    assert [x["status"] for x in await work(conn)] == ["ready"]


async def test_python_channel_target_errors_name_the_option(dsn: str) -> None:
    from pgwork.channels import make_channel
    from pgwork.channels.python import PythonOptions
    from pgwork.config import ChannelConfig

    for target, message in [
        ("tests.nope:deliver", "cannot import module 'tests.nope'"),
        ("tests.sink:missing", "has no attribute 'missing'"),
        ("tests.sink:not_async", "is not an async function"),
    ]:
        with pytest.raises(ConfigError, match=r"channels\.py\.target: .*" + message.split("'")[0]):
            make_channel(
                ChannelConfig(name="py", kind="python", options=PythonOptions(target=target))
            )


async def test_heartbeat_keeps_a_slow_live_delivery_from_being_raced(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    async def slow(d: Delivery) -> None:
        await anyio.sleep(2.5)  # 2.5 leases

    sink.DEFAULT.append(slow)
    await add(conn, "k")
    cfg = config(lease=1.0, tick=0.2, shutdown_grace=5)
    async with running(cfg, dsn), running(cfg, dsn):
        await until(lambda: _eq(conn, 1), what="delivered")
    assert len(sink.DELIVERED) == 1
    ledger = await rows(conn, "SELECT lease, outcome FROM pgwork.attempt")
    assert ledger == [{"lease": 1, "outcome": "delivered"}]


async def test_drain_waits_for_a_flush_under_way(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    # Shutdown releases held rows only after drain(): a flush still under way must count, or the
    # release would hand back a row whose 'delivered' outcome is about to be written.
    import time as _time

    from pgwork.duties.outcomes import OutcomeWriter, Record
    from pgwork.metrics import Metrics

    await add(conn, "k")
    await materialise(dsn)
    (row,) = await claim(dsn, lease=30)
    pool = db.make_pool(dsn, 2, 5.0)
    await pool.open(wait=True)
    try:
        writer = OutcomeWriter(pool, Metrics(), Identity("d", "h", 1))
        async with (
            await psycopg.AsyncConnection.connect(dsn) as locker,
            anyio.create_task_group() as tg,
        ):
            await locker.execute(
                "SELECT 1 FROM pgwork.renewal_work WHERE id = %s FOR UPDATE", (row["id"],)
            )
            tg.start_soon(writer.run)
            writer.submit(
                Record(
                    work_id=row["id"],
                    lease=row["lease"],
                    attempt=1,
                    channel="test",
                    outcome="delivered",
                    status="delivered",
                    retry_after=None,
                    started=_time.monotonic(),
                    finished=_time.monotonic(),
                )
            )
            await anyio.sleep(0.3)  # the flush has started and waits for the row lock
            released_at = _time.monotonic() + 0.5

            async def unlock_later() -> None:
                await anyio.sleep(0.5)
                await locker.rollback()

            tg.start_soon(unlock_later)
            await writer.drain()
            assert _time.monotonic() >= released_at - 0.05
            tg.cancel_scope.cancel()
    finally:
        await pool.close()
    (w,) = await work(conn)
    assert w["status"] == "delivered"


async def test_rows_made_ahead_arm_the_claim_timer(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    # The look-ahead materialises a row before it is due; the claim loop must learn of it and
    # wake at its due instant, not at its next tick (30 s here).
    async with running(config(tick=30.0, lookahead=600.0), dsn) as d:
        await until(lambda: _listening(d), what="listener up")
        await anyio.sleep(0.5)  # the claim loop is asleep until its next tick
        await add(conn, "soon", "now() + interval '1 second'")
        await until(lambda: _eq(conn, 1), timeout=10, what="delivery long before the 30 s tick")
    (w,) = await work(conn)
    assert w["status"] == "delivered"


async def _listening(d: Daemon) -> bool:
    return d.metrics.registry.get_sample_value("pgwork_listener_up") == 1


async def test_heartbeat_and_outcome_flush_do_not_deadlock(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    import json
    import random
    from datetime import UTC, datetime

    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT 's', 'k' || g, now(), 'test', 'r' FROM generate_series(1, 2000) g"
    )
    await materialise(dsn)
    claimed: list[dict[str, Any]] = []
    async with await db.connect(dsn) as c:
        while len(claimed) < 2000:
            claimed += await claim(dsn, limit=500, lease=60, on=c)
    now = datetime.now(UTC).isoformat()

    async def heartbeats() -> None:
        async with await db.connect(dsn) as c:
            for _ in range(5):
                rs = random.sample(claimed, len(claimed))
                await statement(
                    c,
                    "extend_leases",
                    {
                        "work_id": [r["id"] for r in rs],
                        "lease_no": [r["lease"] for r in rs],
                        "lease": timedelta(seconds=60),
                    },
                )

    async def flush() -> None:
        async with await db.connect(dsn) as c:
            rs = random.sample(claimed, len(claimed))
            outcomes = [
                {
                    "work_id": r["id"],
                    "lease": r["lease"],
                    "attempt": 1,
                    "outcome": "delivered",
                    "status": "delivered",
                    "started_at": now,
                    "finished_at": now,
                }
                for r in rs
            ]
            await statement(
                c,
                "record_outcomes",
                {"outcomes": json.dumps(outcomes), "daemon_id": "d", "host": "h", "pid": 1},
            )

    async with anyio.create_task_group() as tg:  # a deadlock would raise DeadlockDetected here
        tg.start_soon(heartbeats)
        tg.start_soon(flush)
    assert await count(conn, "status = 'delivered'") == 2000


async def test_a_heartbeat_passes_over_a_row_being_written_and_still_holds_it(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """An outcome flush holds its rows' locks until it commits: the heartbeat does not wait for
    it (nor deadlock with it), does not push that row's lease, and does not call it lost; the
    rows it could lock get their lease pushed. A row another lease took is lost."""
    for k in ("a", "b", "c"):
        await add(conn, k)
    await materialise(dsn)
    async with await db.connect(dsn) as c:
        held = await claim(dsn, limit=10, lease=60, on=c)
    assert len(held) == 3
    busy, free, taken = sorted(r["id"] for r in held)
    await conn.execute(
        "UPDATE pgwork.work_lease SET lease = lease + 1 WHERE work_id = %s", (taken,)
    )  # as a reclaim by another daemon would
    before = {r["id"]: r["available_at"] for r in await work(conn)}
    async with await db.connect(dsn) as writer, await db.connect(dsn) as hb:
        async with writer.transaction():
            await writer.execute(
                "SELECT 1 FROM pgwork.work_lease WHERE work_id = %s FOR UPDATE", (busy,)
            )
            with anyio.fail_after(3):  # waiting for the lock would take lock_timeout (5 s)
                kept = await statement(
                    hb,
                    "extend_leases",
                    {
                        "work_id": [r["id"] for r in held],
                        "lease_no": [r["lease"] for r in held],
                        "lease": timedelta(seconds=600),
                    },
                )
    assert sorted(r["id"] for r in kept) == [busy, free]
    after = {r["id"]: r["available_at"] for r in await work(conn)}
    assert after[busy] == before[busy]
    assert after[free] > before[free] + timedelta(seconds=300)
    assert after[taken] == before[taken]


async def test_rows_waiting_for_their_outcome_leave_the_prefetch_to_claims(
    dsn: str, conn: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delivered row whose outcome is still being written cannot be taken by another daemon,
    so it does not count against the prefetch (one batch is written while the next is
    delivered); but a writer that falls behind stops the claims after two more batches (or
    what it gathers for two flushes), and nothing is lost or sent twice when it catches up. With a no-op channel, concurrency 2 and
    batches of 10, the prefetch holds at most 2 + 2 * 10 = 22 undelivered rows; delivered rows
    waiting for the writer may add 2 * 10 more, or what the writer gathers for two flushes,
    if more (ChannelState.WRITING_LEAST)."""
    from pgwork.duties.deliver.state import ChannelState
    from pgwork.duties.outcomes import OutcomeWriter

    writing = max(2 * 10, ChannelState.WRITING_LEAST)
    n = 22 + writing + 30

    gate = anyio.Event()
    write = OutcomeWriter._statement

    async def held_writer(self: OutcomeWriter, rs: list[Any]) -> set[ClaimKey]:
        await gate.wait()  # the database is slow to take outcomes
        return await write(self, rs)

    monkeypatch.setattr(OutcomeWriter, "_statement", held_writer)
    for i in range(n):
        await add(conn, f"k{i}")
    cfg = config(python_channel(concurrency=2), claim_batch=10, metrics_enabled=True)
    async with running(cfg, dsn) as daemon:
        reg = daemon.metrics.registry

        def held() -> float:
            return reg.get_sample_value("pgwork_rows_held", {"channel": "test"}) or 0.0

        async def stalled() -> bool:
            before = len(sink.DELIVERED)
            await anyio.sleep(0.5)
            return before == len(sink.DELIVERED) > 0

        await until(stalled, what="the claims to stop while no outcome is written")
        # Everything held was delivered: the rows wait for the writer, not for a worker.
        assert held() == len(sink.DELIVERED)
        assert 22 < len(sink.DELIVERED) <= 22 + writing
        gate.set()
        await until(lambda: _eq(conn, n), what=f"{n} delivered")
    keys = [d.business_key for d in sink.DELIVERED]
    assert len(keys) == len(set(keys)) == n


async def test_a_cancel_in_an_open_transaction_delays_no_claim_and_wins(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """An app deletes a reminder whose work is ready and keeps its transaction open: its trigger
    holds that work's ready row, and a claim meanwhile passes over it (SKIP LOCKED) and takes the
    others at once; the app commits, and the occurrence is cancelled, never claimed."""
    for key in ("cancelled", "other"):
        await add(conn, key, "now() - interval '1 minute'" if key == "cancelled" else "now()")
    await materialise(dsn)
    async with await psycopg.AsyncConnection.connect(dsn) as app:
        await app.execute("DELETE FROM pgwork.reminder WHERE business_key = 'cancelled'")
        with anyio.fail_after(3):
            got = await claim(dsn, limit=10)
        assert [r["business_key"] for r in got] == ["other"]
        await app.commit()
    assert await claim(dsn, limit=10) == []
    states = {w["business_key"]: w["status"] for w in await work(conn)}
    assert states == {"cancelled": "cancelled", "other": "claimed"}


async def test_a_claim_in_flight_holds_a_cancel_until_it_commits_and_its_send_goes_on(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A claim has taken a row and not committed yet when the app deletes its reminder: the
    app's trigger waits for the claim (the ready row is locked), then finds the row claimed and
    leaves it (a send in flight is never recalled); the app's statement ends as soon as the
    claim commits, and the lease is the worker's to report."""
    await add(conn, "k")
    await materialise(dsn)
    deleted = anyio.Event()

    async def app_delete() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as app:
            await app.execute("DELETE FROM pgwork.reminder WHERE business_key = 'k'")
        deleted.set()

    async with await db.connect(dsn) as daemon, anyio.create_task_group() as tg:
        async with daemon.transaction():
            (row,) = await claim(dsn, limit=1, on=daemon)
            tg.start_soon(app_delete)
            await anyio.sleep(0.5)
            assert not deleted.is_set()  # waiting for the claim's lock
        with anyio.fail_after(3):  # the claim committed
            await deleted.wait()
    (w,) = await work(conn)
    assert (w["status"], w["lease"]) == ("claimed", row["lease"])
