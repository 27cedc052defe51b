"""One app cannot delay another's deliveries: the noisy-neighbour property.

Many apps share one database. Whatever one app writes (a valid series that asks for a great
deal of work) or holds (an open transaction over its own reminders), another app's reminder is
delivered within a few seconds of its due time. Each neighbour below is one kind of heavy row or
app-held lock; the daemon is real and in this process, the other app's reminder goes through
the python test channel."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import psycopg
import pytest

from . import sink
from .helpers import WORK_NOW, config, python_channel, rows, running, until

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("clean_sink")]

#: How late another app's reminder may be delivered, seconds after its due time. Without a
#: neighbour it is delivered within milliseconds; the bound leaves room for a loaded machine.
BOUND = 3.0

EVERY_MINUTE = "FREQ=DAILY;BYHOUR={};BYMINUTE={}".format(
    ",".join(str(h) for h in range(24)), ",".join(str(m) for m in range(60))
)
#: 16 entries spread over 0-375 days (within the documented limits).
SIXTEEN_UP_TO_375_DAYS = "{" + ", ".join(f"{round(i * 25)} days" for i in range(16)) + "}"

Neighbour = Callable[[psycopg.AsyncConnection[Any], str], Awaitable[None]]


async def _series(
    app: psycopg.AsyncConnection[Any], key: str, recur: str, before: str = "{0}"
) -> None:
    await app.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, "
        "remind_before, channel, recipient) VALUES ('noisy', %s, "
        "date_trunc('minute', now() AT TIME ZONE 'Asia/Kolkata') + interval '1 minute', "
        "'Asia/Kolkata', %s, %s::interval[], 'test', 'r')",
        (key, recur, before),
    )


async def _a_made_series(app: psycopg.AsyncConnection[Any]) -> None:
    """The noisy app's series, its next occurrences made and unsent (the look-ahead is two
    minutes), and a one-off of its own."""
    await _series(app, "series", EVERY_MINUTE)
    await app.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "VALUES ('noisy', 'one-off', now() + interval '1 hour', 'test', 'r')"
    )

    async def made() -> bool:
        got = await rows(
            app,
            "SELECT count(*) AS n FROM pgwork.renewal_work "
            "WHERE business_key = 'series' AND status = 'ready'",
        )
        return bool(got[0]["n"] > 0)

    await until(made, what="the series' next occurrences made")


def _held(edit: str) -> Neighbour:
    """The noisy app makes its series, runs ``edit`` in a transaction it keeps open for the rest
    of the test, and (from another session) writes a reminder due with the other app's: the page
    that makes the other's row makes this one's too, in the noisy app's lane."""

    async def neighbour(app: psycopg.AsyncConnection[Any], dsn: str) -> None:
        await _a_made_series(app)
        await app.set_autocommit(False)
        await app.execute(edit)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as again:
            await again.execute(
                "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
                "VALUES ('noisy', 'due-with-the-other', now() + interval '1 second', 'test', 'r')"
            )

    return neighbour


def _heavy(recur: str, before: str) -> Neighbour:
    async def neighbour(app: psycopg.AsyncConnection[Any], dsn: str) -> None:
        t0 = time.monotonic()
        await _series(app, "heavy", recur, before)
        assert time.monotonic() - t0 < 1.0  # accepted at once

    return neighbour


async def _around_the_triggers(app: psycopg.AsyncConnection[Any], dsn: str) -> None:
    """A row no trigger checked (written with triggers off, or by an older pgwork, or with a
    zone the server's time zone data no longer has): every page that took it failed, for ever."""
    await app.execute("SET session_replication_role = replica")
    await app.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, due_local, due_tz, "
        "remind_before, channel, recipient, next_fire_at) VALUES ('noisy', 'nowhere', now(), "
        "now() AT TIME ZONE 'UTC', 'Nowhere/Land', '{1 minute}', 'test', 'r', "
        "now() - interval '1 minute')"
    )
    await app.execute("RESET session_replication_role")


async def _one_send_twice(app: psycopg.AsyncConnection[Any], dsn: str) -> None:
    """A row no trigger checked whose ``remind_before`` names one send twice: the page's upsert
    meets the same work row twice (a cardinality violation, not a data error)."""
    await app.execute("SET session_replication_role = replica")
    await app.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, remind_before, channel, "
        "recipient) VALUES ('noisy', 'twice', now(), '{0, 00:00:00}', 'test', 'r')"
    )
    await app.execute("RESET session_replication_role")


#: A page may fail on one row with an error of any class a statement can raise (a function that
#: refuses a value, a constraint, a RAISE, a statement timeout, a limit of the server, a row the
#: server cannot read...). The class decides, not a list of errors: one of each, raised by a
#: trigger on the work row the poison reminder makes.
POISON_CLASSES = {
    "data": "22012",  # division_by_zero
    "cardinality": "21000",
    "constraint": "23514",  # check_violation
    "raise": "P0001",
    "timeout": "57014",  # query_canceled
    "program limit": "54000",
    "routine": "2F005",  # function executed no return statement
    "feature": "0A000",
    "corrupt row": "XX001",
}


def _poison(sqlstate: str) -> Neighbour:
    async def neighbour(app: psycopg.AsyncConnection[Any], dsn: str) -> None:
        await app.execute(
            "CREATE FUNCTION pgwork.test_poison() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"RAISE EXCEPTION 'poison row' USING ERRCODE = '{sqlstate}'; END $$"
        )
        await app.execute(
            "CREATE TRIGGER test_poison BEFORE INSERT ON pgwork.renewal_work FOR EACH ROW "
            "WHEN (NEW.business_key = 'poison') EXECUTE FUNCTION pgwork.test_poison()"
        )
        await app.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "VALUES ('noisy', 'poison', now(), 'test', 'r')"
        )

    return neighbour


#: The flood: one-offs due now, written in one statement. Before fair making, 200,000 of them
#: delayed another app's reminder by 7 s, 1,000,000 by 45 s (bench.flood).
FLOOD = 1_000_000


async def _flood(app: psycopg.AsyncConnection[Any], dsn: str) -> None:
    await app.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT 'noisy', 'flood:' || g, now(), 'test', 'r' FROM generate_series(1, %s) g",
        (FLOOD,),
    )


async def _heavy_in_many_zones(app: psycopg.AsyncConnection[Any], dsn: str) -> None:
    """300 series of the largest valid kind, each in its own zone (no two share an evaluation):
    each page evaluated a day of deadlines either side of every entry's window, 2,880 a window,
    whatever the series' share, and passes grew to seconds."""
    await app.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, "
        "remind_before, channel, recipient) "
        "SELECT 'noisy', 'heavy:' || z.name, "
        "date_trunc('minute', now() AT TIME ZONE z.name) + interval '1 minute', z.name, %s, "
        "%s::interval[], 'test', 'r' "
        "FROM (SELECT name FROM pgwork.time_zone ORDER BY name LIMIT 300) AS z",
        (EVERY_MINUTE, SIXTEEN_UP_TO_375_DAYS),
    )
    # The other app's reminder goes in once the heavy series have made a few passes.
    await anyio.sleep(20)


NEIGHBOURS: dict[str, Neighbour] = {
    "300 series every minute with 16 sends up to 375 days ahead, each in its own zone": (
        _heavy_in_many_zones
    ),
    f"a flood of {FLOOD:,} one-offs due now": _flood,
    "a row written around the triggers, in a zone the server does not know": _around_the_triggers,
    "a row written around the triggers, one send twice": _one_send_twice,
    **{f"a poison row, {kind} class": _poison(code) for kind, code in POISON_CLASSES.items()},
    "a series' zone edit, transaction held open": _held(
        "UPDATE pgwork.reminder SET due_tz = 'Asia/Kathmandu' WHERE business_key = 'series'"
    ),
    "a series' skip edit, transaction held open": _held(
        "UPDATE pgwork.reminder SET recur_skip = '{2031-01-01}' WHERE business_key = 'series'"
    ),
    "a series' rule edit, transaction held open": _held(
        "UPDATE pgwork.reminder SET recur = recur || ';INTERVAL=2' WHERE business_key = 'series'"
    ),
    "a series paused, transaction held open": _held(
        "UPDATE pgwork.reminder SET paused = true WHERE business_key = 'series'"
    ),
    "a series deleted, transaction held open": _held(
        "DELETE FROM pgwork.reminder WHERE business_key = 'series'"
    ),
    "a one-off moved, transaction held open": _held(
        "UPDATE pgwork.reminder SET due_at = due_at + interval '1 hour' "
        "WHERE business_key = 'one-off'"
    ),
    "a reminder inserted, transaction held open": _held(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "VALUES ('noisy', 'held', now(), 'test', 'r')"
    ),
    "a series every minute with 16 sends up to 375 days ahead": _heavy(
        EVERY_MINUTE, SIXTEEN_UP_TO_375_DAYS
    ),
    "a series every minute with sends 0 and 50 days ahead": _heavy(EVERY_MINUTE, "{0, 50 days}"),
}


@asynccontextmanager
async def _app(dsn: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """Another app's connection; whatever it holds is rolled back when the test ends."""
    c = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:
        yield c
    finally:
        await c.rollback()
        await c.close()


@pytest.mark.parametrize("neighbour", list(NEIGHBOURS))
async def test_another_apps_reminder_is_delivered_on_time_whatever_one_app_does(
    neighbour: str, dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    cfg = config(python_channel(concurrency=16), lookahead=120.0, lease=5.0)
    async with running(cfg, dsn), _app(dsn) as app:
        await NEIGHBOURS[neighbour](app, dsn)
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "VALUES ('other', 'the-one', now() + interval '1 second', 'test', 'r')"
        )
        due = time.time() + 1.0

        async def delivered() -> bool:
            return any(d.business_key == "the-one" for d in sink.DELIVERED)

        await until(delivered, timeout=BOUND + 30, what="the other app's reminder")
        late = max(time.time() - due, 0.0)
        assert late < BOUND, f"delivered {late:.1f}s after its due time"
    assert [d.business_key for d in sink.DELIVERED].count("the-one") == 1


async def test_outcomes_of_other_apps_are_recorded_while_one_flush_waits_on_a_lock(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """One app's delivered webhook cannot be recorded: another session holds its work row (an
    operator's `SELECT … FOR UPDATE`, or any lock its outcome needs). Another app's eight
    webhooks, answered 200 meanwhile, are recorded within a few seconds all the same; they
    stayed `claimed`, with no ledger row, until the first lock went (a crash then would have
    sent them again). The held one is recorded once the lock goes."""
    import threading

    from .helpers import webhook_channel
    from .receiver import Answer, Receiver

    hold = threading.Event()
    script = lambda r: Answer(hold=hold) if r.body["business_key"] == "held" else Answer()  # noqa: E731
    with Receiver(script) as receiver:
        cfg = config(webhook_channel(receiver.url), lease=30.0)
        async with running(cfg, dsn):
            await conn.execute(
                "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
                "VALUES ('first', 'held', now(), 'hook', 'r')"
            )
            await anyio.to_thread.run_sync(receiver.wait_for, 1)
            async with await psycopg.AsyncConnection.connect(dsn) as ops:
                await ops.execute(
                    "SELECT 1 FROM pgwork.renewal_work WHERE business_key = 'held' FOR UPDATE"
                )
                hold.set()  # answered: its outcome now waits for the lock
                await anyio.sleep(0.3)
                await conn.execute(
                    "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
                    "SELECT 'other', 'k' || g, now(), 'hook', 'r' FROM generate_series(1, 8) g"
                )
                await anyio.to_thread.run_sync(receiver.wait_for, 9)
                answered = time.time()

                async def recorded() -> bool:
                    got = await rows(
                        conn,
                        "SELECT count(*) AS n FROM pgwork.renewal_work w JOIN pgwork.attempt a "
                        "ON a.work_id = w.id WHERE w.source = 'other' AND w.status = 'delivered'",
                    )
                    return bool(got[0]["n"] == 8)

                await until(recorded, timeout=30, what="the other app's outcomes")
                late = time.time() - answered
                held = await rows(
                    conn, f"SELECT status FROM ({WORK_NOW}) AS w WHERE business_key = 'held'"
                )
                await ops.rollback()
            assert late < BOUND, f"recorded {late:.1f}s after the receiver answered"
            assert held[0]["status"] == "claimed"  # its lock was still held then

            async def held_recorded() -> bool:
                got = await rows(
                    conn, "SELECT status FROM pgwork.renewal_work WHERE business_key = 'held'"
                )
                return bool(got[0]["status"] == "delivered")

            await until(held_recorded, timeout=30, what="the held one, once the lock went")
    assert receiver.keys() and set(receiver.keys().values()) == {1}


async def test_a_reminder_set_aside_and_tried_again_costs_one_line_a_try(
    dsn: str, conn: psycopg.AsyncConnection[Any], caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    """Issue 68: each try of a reminder set aside (a row no page can make) cost a failed pass and
    three lines: the page with claims failed ("claiming in pages is off"), the pass failed (with
    a traceback the first time), then the pass without claims set it aside again. A page with
    claims that fails for a row is tried again without them in the same pass: one line a try,
    an error the first time, a warning after."""
    from pgwork.duties import materialise as m

    from .helpers import add_in_an_unknown_zone

    monkeypatch.setattr(m.SetAside, "FIRST", 1.0)
    monkeypatch.setattr(m.SetAside, "LONGEST", 1.0)
    monkeypatch.setattr(m, "CLAIMS_OFF_AFTER_FAILURE", 0.5)
    await add_in_an_unknown_zone(conn)
    with caplog.at_level("INFO", logger="pgwork"):
        async with running(config(tick=0.3), dsn):
            await anyio.sleep(5.0)
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    tries = [r for r in said if "a page failed on reminder" in r.getMessage()]
    assert len(tries) >= 3, [r.getMessage() for r in said]
    assert len(said) == len(tries), [r.getMessage() for r in said]  # nothing else
    assert [r.levelno for r in tries] == [logging.ERROR] + [logging.WARNING] * (len(tries) - 1)
    assert all(" again;" in r.getMessage() for r in tries[1:])
