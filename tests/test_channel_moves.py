"""No channel move loses a send: an app moves a reminder to another channel while one of its
sends waits for a retry, or is in flight, and that send is delivered once, on the channel the
reminder now names, with the same idempotency key. Real daemon, real HTTP receivers."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import psycopg
import pytest

from pgwork import store
from pgwork.config import RetryPolicy

from .helpers import config, rows, running, until, webhook_channel
from .receiver import Answer, Receiver

pytestmark = pytest.mark.anyio

#: A failing channel's backoff: long enough that a send is seen waiting for its retry.
SLOW_RETRY = RetryPolicy(max_attempts=20, base=1.0, cap=1.0)


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
