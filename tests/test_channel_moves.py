"""No channel move loses a send: an app moves a reminder to another channel while one of its
sends waits for a retry, or is in flight, and that send is delivered once, on the channel the
reminder now names, with the same idempotency key. Real daemon, real HTTP receivers."""

from __future__ import annotations

import json
import threading
from typing import Any

import anyio
import psycopg
import pytest

from pgwork import store
from pgwork.config import RetryPolicy

from .helpers import config, rows, running, until, webhook_channel
from .receiver import Answer, Receiver
from .test_cli import pgwork

pytestmark = pytest.mark.anyio

#: A failing channel's backoff: long enough that a send is seen waiting for its retry.
SLOW_RETRY = RetryPolicy(max_attempts=20, base=1.0, cap=1.0)
#: The property test's channels' backoff.
WAITING_RETRY = RetryPolicy(max_attempts=50, base=0.5, cap=1.0)


async def _status(conn: psycopg.AsyncConnection[Any], key: str) -> list[dict[str, Any]]:
    return await rows(
        conn,
        "SELECT status, channel, attempts FROM pgwork.renewal_work WHERE business_key = %s "
        "ORDER BY id",
        (key,),
    )


async def test_a_series_moved_off_a_failing_channel_sends_its_retry_on_the_new_one(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A series' send failed on its channel and waits for a retry; the app moves the series to
    a working channel. The edit restarted the series from now and superseded that send: it was
    never sent (docs/sql.md says unsent work is made again on the new channel). It is now
    delivered once on the new channel, with the key of its first attempt."""
    with Receiver(lambda r: Answer(status=500)) as old, Receiver() as new:
        cfg = config(
            webhook_channel(old.url, "old", retry=SLOW_RETRY),
            webhook_channel(new.url, "new"),
            lookahead=120.0,
        )
        async with running(cfg, dsn):
            await conn.execute(
                "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, "
                "channel, recipient) VALUES ('app', 'rent', "
                "(now() + interval '1 second') AT TIME ZONE 'UTC', 'UTC', 'FREQ=DAILY', 'old', 'r')"
            )
            (first,) = await anyio.to_thread.run_sync(old.wait_for, 1)
            await conn.execute(
                "UPDATE pgwork.reminder SET channel = 'new' WHERE business_key = 'rent'"
            )
            (got,) = await anyio.to_thread.run_sync(new.wait_for, 1)
            assert got.key == first.key
            await anyio.sleep(1.5)  # nothing else comes, on either channel
            assert new.keys() == {first.key: 1}
            assert all(r.key == first.key for r in old.requests)
    states = await _status(conn, "rent")
    assert [(s["status"], s["channel"]) for s in states] == [("delivered", "new")], states


async def test_a_one_off_moved_while_in_flight_retries_on_the_new_channel_and_retire_spares_it(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A one-off's request is in flight on ``old2`` when the app moves it to ``new``; the answer
    is a 500. Its retry stayed on ``old2``, and `pgwork channel retire old2 --cancel` (which
    reported deleting 0 reminders) then cancelled it: the reminder, on ``new``, was never
    delivered. The retry now follows the reminder, and retire closes only what the channel's
    own reminders hold, reporting every row it closed and the ones it left to their channel."""
    hold = threading.Event()
    with Receiver(lambda r: Answer(status=500, hold=hold)) as old, Receiver() as new:
        cfg = config(webhook_channel(old.url, "old2"), webhook_channel(new.url, "new"), lease=30.0)
        async with running(cfg, dsn):
            await conn.execute(
                "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
                "VALUES ('app', 'notice', now(), 'old2', 'r'), "
                "('app', 'stays', now() + interval '1 day', 'old2', 'r')"
            )
            (first,) = await anyio.to_thread.run_sync(old.wait_for, 1)
            await conn.execute(
                "UPDATE pgwork.reminder SET channel = 'new' WHERE business_key = 'notice'"
            )
            use = await store.channel_retire(conn, channel="old2", cancel=True)
            assert use is not None
            assert (use.reminders, use.live, use.moved) == (1, 0, 1), use
            hold.set()
            (got,) = await anyio.to_thread.run_sync(new.wait_for, 1)
            assert got.key == first.key and got.body["business_key"] == "notice"
            await until(
                lambda: _delivered(conn, "notice"), what="the moved reminder's delivery recorded"
            )
    assert new.keys() == {first.key: 1}
    status = await rows(
        conn, "SELECT business_key, status FROM pgwork.reminder_status ORDER BY business_key"
    )
    assert status == [{"business_key": "notice", "status": "delivered"}], status


async def _delivered(conn: psycopg.AsyncConnection[Any], key: str) -> bool:
    return [s["status"] for s in await _status(conn, key)] == ["delivered"]


#: One-offs and series of the property test, and how long its app keeps editing them, seconds.
REMINDERS = 12
SERIES = 4
EDITING = 6.0
EDITS = (
    "UPDATE pgwork.reminder SET due_at = now() + %(s)s * interval '1 second' WHERE business_key = %(k)s",
    "UPDATE pgwork.reminder SET channel = CASE channel WHEN 'a' THEN 'b' ELSE 'a' END "
    "WHERE business_key = %(k)s",
    "UPDATE pgwork.reminder SET remind_before = %(b)s::interval[] WHERE business_key = %(k)s",
)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_edits_against_a_flaky_receiver_send_each_wanted_occurrence_once(
    seed: int, dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """An app moves its one-offs' deadlines, swaps their channels and changes their sends, and
    swaps its series' channels, at random moments of those sends' lives (not yet made, waiting
    to be claimed, in flight, waiting for a retry), while the receiver behind both channels
    fails two requests in five. At the end every occurrence the final reminder wants (a
    one-off's deadline with each of its remind_before entries; a series' first deadline) is
    delivered, and no idempotency key was ever answered 2xx twice; every key answered 2xx is a
    work row recorded delivered. (Before, a series' send waiting for a retry when its channel
    changed was never sent.)"""
    import hashlib
    import random

    rnd = random.Random(seed)

    def flaky(r: Any) -> Answer:
        h = hashlib.sha256(f"{seed}/{r.key}/{r.n}".encode()).digest()[0]
        return Answer(status=500 if h < 102 else 200)

    with Receiver(flaky) as receiver:
        cfg = config(
            # Retries half a second to a second apart: sends spend time waiting for one.
            webhook_channel(receiver.url, "a", retry=WAITING_RETRY),
            webhook_channel(receiver.url, "b", retry=WAITING_RETRY),
            lookahead=2.0,
        )
        async with running(cfg, dsn):
            for i in range(REMINDERS):
                await conn.execute(
                    "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, "
                    "recipient) VALUES ('app', %s, now() + %s * interval '1 second', %s, 'r')",
                    (f"k{i}", rnd.uniform(0.2, 3.0), rnd.choice("ab")),
                )
            for i in range(SERIES):
                await conn.execute(
                    "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, "
                    "channel, recipient) VALUES ('app', %s, date_trunc('second', "
                    "now() AT TIME ZONE 'UTC') + %s * interval '1 second', 'UTC', 'FREQ=DAILY', "
                    "%s, 'r')",
                    (f"s{i}", rnd.randint(1, 3), rnd.choice("ab")),
                )
            t0 = anyio.current_time()
            while anyio.current_time() - t0 < EDITING:
                await anyio.sleep(rnd.uniform(0.0, 0.15))
                if rnd.random() < 0.3:
                    await conn.execute(EDITS[1], {"k": f"s{rnd.randrange(SERIES)}"})
                    continue
                await conn.execute(
                    rnd.choice(EDITS),
                    {
                        "k": f"k{rnd.randrange(REMINDERS)}",
                        "s": rnd.uniform(0.0, 3.0),
                        "b": rnd.choice(["{0}", "{0, 1 second}", "{2 seconds}"]),
                    },
                )

            async def settled() -> bool:
                left = await rows(
                    conn,
                    "SELECT count(*) AS n FROM pgwork.reminder r "
                    "CROSS JOIN LATERAL unnest(r.remind_before) AS b(before) "
                    "WHERE r.recur IS NULL AND NOT EXISTS (SELECT FROM pgwork.renewal_work w "
                    "WHERE w.reminder_id = r.id AND w.deadline = r.due_at "
                    "AND w.occurrence = b.before AND w.status = 'delivered')",
                )
                series = await rows(
                    conn,
                    "SELECT count(*) AS n FROM pgwork.reminder r WHERE r.recur IS NOT NULL "
                    "AND NOT EXISTS (SELECT FROM pgwork.renewal_work w WHERE w.reminder_id = r.id "
                    "AND w.deadline_local = r.due_local AND w.status = 'delivered')",
                )
                return bool(left[0]["n"] == 0 and series[0]["n"] == 0)

            await until(settled, timeout=60, what="every wanted occurrence delivered")
    ok: dict[str, int] = {}
    for r in receiver.requests:
        if flaky(r).status == 200:
            ok[r.key] = ok.get(r.key, 0) + 1
    assert all(n == 1 for n in ok.values()), {k: n for k, n in ok.items() if n > 1}
    delivered = await rows(
        conn, "SELECT operation_id::text AS k FROM pgwork.renewal_work WHERE status = 'delivered'"
    )
    assert set(ok) == {d["k"] for d in delivered}
    stranded = await rows(
        conn,
        "SELECT w.id FROM pgwork.renewal_work w JOIN pgwork.reminder r ON r.id = w.reminder_id "
        "WHERE w.status IN ('ready', 'claimed') AND w.channel <> r.channel",
    )
    assert stranded == []


async def test_retire_fences_a_send_in_flight_and_moves_live_rows_to_their_reminder_s_channel(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """`channel retire test --cancel` with work of every kind on the channel: a send in flight
    of a reminder it deletes is fenced (its lease goes; the late answer is written to the
    ledger as fenced and changes nothing), its unsent work is cancelled, and live rows whose
    reminder another channel names now (one in flight, one waiting: the app moved them) go to
    that channel, the waiting one into its queue. The queue's invariant holds throughout (the
    conn fixture checks it at the end)."""
    from .helpers import WORK_NOW, add, claim, materialise, statement

    await conn.execute(
        "INSERT INTO pgwork.channel (name, kind) VALUES ('log', 'log') ON CONFLICT DO NOTHING"
    )
    for key, ago in (("held", 4), ("moved-held", 3), ("moved-ready", 2), ("waiting", 1)):
        await add(conn, key, f"now() - interval '{ago} minutes'")
    await materialise(dsn)
    held = {r["business_key"]: r for r in await claim(dsn, limit=2)}
    assert set(held) == {"held", "moved-held"}
    # The app moves two reminders to 'log': the one in flight keeps its lease; the waiting one
    # is moved as if its edit raced the trigger (no trigger runs in this session).
    await conn.execute(
        "UPDATE pgwork.reminder SET channel = 'log' WHERE business_key = 'moved-held'"
    )
    await conn.execute("SET session_replication_role = replica")
    await conn.execute(
        "UPDATE pgwork.reminder SET channel = 'log' WHERE business_key = 'moved-ready'"
    )
    await conn.execute("SET session_replication_role = DEFAULT")
    use = await store.channel_retire(conn, channel="test", cancel=True)
    assert use is not None and (use.reminders, use.live, use.moved) == (2, 2, 2), use

    async def answer(key: str) -> list[dict[str, Any]]:
        r = held[key]
        rec = {"work_id": r["id"], "lease": r["lease"], "attempt": 1, "channel": "test",
               "outcome": "delivered", "status": "delivered"}  # fmt: skip
        return await statement(
            conn, "record_outcomes",
            {"outcomes": json.dumps([rec]), "daemon_id": "d", "host": "h", "pid": 1},
        )  # fmt: skip

    assert [f["fenced_id"] for f in await answer("held")] == [held["held"]["id"]]
    assert await answer("moved-held") == []  # its send, finished on its new channel
    got = await rows(
        conn,
        f"SELECT business_key, status, channel FROM ({WORK_NOW}) AS w ORDER BY business_key",
    )
    assert [(g["business_key"], g["status"], g["channel"]) for g in got] == [
        ("held", "cancelled", "test"),
        ("moved-held", "delivered", "log"),
        ("moved-ready", "ready", "log"),
        ("waiting", "cancelled", "test"),
    ]
    queued = await rows(conn, "SELECT channel FROM pgwork.work_ready")
    assert queued == [{"channel": "log"}]
    lanes = await rows(conn, "SELECT channel, source FROM pgwork.lane WHERE channel = 'log'")
    assert lanes == [{"channel": "log", "source": "test"}]  # its lane woken on the new channel
    ledger = await rows(
        conn,
        "SELECT a.outcome FROM pgwork.attempt a JOIN pgwork.renewal_work w ON w.id = a.work_id "
        "WHERE w.business_key = 'held'",
    )
    assert [x["outcome"] for x in ledger] == ["fenced"]


async def test_retire_names_the_daemons_serving_the_channel_and_they_drop_it(
    dsn: str, conn: psycopg.AsyncConnection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """`channel retire gone --cancel` while a daemon served `gone` was accepted without a word
    about it; the daemon logged "channel resumed" and kept exporting the channel until
    restarted. Retire now names the live daemons that registered it, and each says it was
    retired, claims none of its work and drops its gauges."""
    from .helpers import add, python_channel

    cfg = config(
        python_channel(), python_channel("gone"), metrics_enabled=True, metrics_listen="127.0.0.1:0"
    )
    async with running(cfg, dsn) as d:

        def paused_gauge() -> float | None:
            return d.metrics.registry.get_sample_value("pgwork_channel_paused", {"channel": "gone"})

        async def exported() -> bool:
            return paused_gauge() == 0

        await until(exported, what="the channel's gauges")
        await add(conn, "later", "now() + interval '1 day'", channel="gone")
        r = await anyio.to_thread.run_sync(
            lambda: pgwork("channel", "retire", "gone", "--cancel", dsn=dsn)
        )
        assert r.returncode == 0, r.stderr
        assert f"Still served by {d.identity.daemon_id} (" in r.stdout, r.stdout

        async def dropped() -> bool:
            return paused_gauge() is None and "gone was retired" in caplog.text

        await until(dropped, what="the daemon dropping the channel")
        assert "channel gone resumed" not in caplog.text
        assert (
            d.metrics.registry.get_sample_value("pgwork_channel_paused", {"channel": "test"}) == 0
        )
    # Without a daemon serving it, retire says only what to do with the configs.
    await conn.execute("INSERT INTO pgwork.channel (name, kind) VALUES ('old', 'log')")
    r = pgwork("channel", "retire", "old", dsn=dsn)
    assert r.returncode == 0 and "Still served" not in r.stdout, r.stdout


def _two_channels(url: str, serve: tuple[str, ...]) -> str:
    """A daemon process's config serving ``serve`` of channels ``old`` and ``new`` (one
    receiver behind both), with a 2 s lease and a 1 s grace."""
    from .processes import toml

    chans = "".join(
        f'[channels.{c}]\nkind = "webhook"\nurl = "{url}"\nbackoff_base = "50ms"\n'
        'backoff_cap = "200ms"\n'
        for c in serve
    )
    return toml(channel=chans, grace="1s")


@pytest.mark.slow
@pytest.mark.parametrize(
    "death",
    ["SIGKILL, restarted serving only new", "SIGKILL, old still served", "SIGTERM"],
)
async def test_a_send_moved_while_in_flight_goes_to_its_new_channel_when_its_daemon_dies(
    death: str, dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    """Issue 67: a one-off's and a daily series' sends are in flight on ``old`` when the app
    moves both reminders to ``new``; then their daemon dies. Nothing was sent in 30 s when the
    daemon came back serving only ``new`` (both rows ready with an expired lease on ``old``),
    and once ``old`` was served again both went out there, none on ``new``: the reclaim
    re-issued the lease on the lease's channel. Each now goes out on ``new`` under its key
    within its lease after the death, and never again on ``old`` — whichever channels the
    daemon that comes back serves, and when a clean stop gives the rows back instead."""
    import signal
    import time

    hold = threading.Event()

    def script(r: Any) -> Answer:
        return Answer(hold=hold) if r.body["channel"] == "old" else Answer()

    with Receiver(script) as receiver:
        first = procs(dsn, _two_channels(receiver.url, ("old", "new")))
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "VALUES ('app', 'once', now(), 'old', 'r')"
        )
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, channel, "
            "recipient) VALUES ('app', 'daily', date_trunc('second', now() AT TIME ZONE 'UTC') "
            "+ interval '1 second', 'UTC', 'FREQ=DAILY', 'old', 'r')"
        )
        held = await anyio.to_thread.run_sync(receiver.wait_for, 2)
        keys = {r.body["business_key"]: r.key for r in held}
        await conn.execute("UPDATE pgwork.reminder SET channel = 'new' WHERE source = 'app'")
        moved = time.time()
        first.signal(signal.SIGTERM if death == "SIGTERM" else signal.SIGKILL)
        await anyio.to_thread.run_sync(lambda: first.wait(20))
        died = time.time()
        hold.set()  # the held answers go to a daemon that is gone
        serve = ("old", "new") if death == "SIGKILL, old still served" else ("new",)
        procs(dsn, _two_channels(receiver.url, serve))

        def sent_on_new() -> dict[str, Any]:
            return {
                r.body["business_key"]: r for r in receiver.requests if r.body["channel"] == "new"
            }

        await until(lambda: _true(len(sent_on_new()) == 2), timeout=30, what="both on new")
        await anyio.sleep(1.0)  # nothing more comes, on either channel
    on_new = sent_on_new()
    assert {k: r.key for k, r in on_new.items()} == keys  # each under its key
    late = {k: round(r.at - died, 1) for k, r in on_new.items()}
    assert all(s < 2.0 + 3.0 for s in late.values()), late  # the lease (2 s), and a claim
    again = [r.body["business_key"] for r in receiver.requests if r.body["channel"] == "old"
             and r.at > moved]  # fmt: skip
    assert again == [], again
    states = await rows(
        conn,
        "SELECT business_key, status, channel FROM pgwork.renewal_work ORDER BY business_key",
    )
    assert [(s["business_key"], s["status"], s["channel"]) for s in states] == [
        ("daily", "delivered", "new"),
        ("once", "delivered", "new"),
    ], states
    assert await rows(conn, "SELECT * FROM pgwork.work_moved") == []


async def _true(value: bool) -> bool:
    return value


async def test_a_dead_letter_whose_reminder_moved_is_redriven_on_its_new_channel(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Found by the nemesis on dfd1b96: a send went dead on ``test``, the app moved its reminder
    to ``log``, the operator redrove it: it went back to ``test``'s queue (sent there, against
    the move, or never, with nobody serving ``test``). A redrive now queues it on the channel
    its reminder names."""
    from .helpers import add, materialise, sync_queue

    await add(conn, "moved", "now() - interval '1 minute'")
    await materialise(dsn)
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'dead', finished_at = now(), "
        "dead_reason = 'permanent failure' WHERE business_key = 'moved'"
    )
    await sync_queue(conn)
    await conn.execute("UPDATE pgwork.reminder SET channel = 'log' WHERE business_key = 'moved'")
    got = await store.dlq_redrive(conn, all=True, ids=[], channel=None, operator="t")
    assert [g.verdict for g in got] == ["ok"]
    queued = await rows(conn, "SELECT channel FROM pgwork.work_ready")
    record = await rows(conn, "SELECT status, channel FROM pgwork.renewal_work")
    assert queued == [{"channel": "log"}]
    assert record == [{"status": "ready", "channel": "log"}]
