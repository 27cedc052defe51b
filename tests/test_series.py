"""Recurring reminders (issue 27): a series is one reminder row; each deadline x remind_before
entry is its own occurrence, made as it comes due, sent once, keyed by its local deadline.

Cases that span months run the materialiser's page with explicit cutoffs (the page takes its
cutoff as a parameter) instead of waiting; the production path reads now(). One case runs a
daemon on real time."""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
import pytest

from pgwork import db
from pgwork.queries import Q

from . import sink
from .helpers import add, claim, config, materialise, rows, running, sync_queue, until, utc
from .test_retention import clean

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("clean_sink")]

UTC = dt.UTC


async def series(
    conn: psycopg.AsyncConnection[Any],
    key: str,
    recur: str,
    due_local: str,
    tz: str,
    before: str = "{0}",
    **more: Any,
) -> int:
    cols = ", ".join(more)
    vals = ", ".join(["%s"] * len(more))
    cur = await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, remind_before, "
        f"channel, recipient{', ' + cols if more else ''}) "
        f"VALUES ('app', %s, %s, %s, %s, %s::interval[], 'test', 'r'{', ' + vals if more else ''}) "
        "RETURNING id",
        (key, due_local, tz, recur, before, *more.values()),
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def made(conn: psycopg.AsyncConnection[Any], key: str = "rent") -> list[dict[str, Any]]:
    return await rows(
        conn,
        "SELECT deadline_local, deadline, occurrence, due_at, status, operation_id "
        "FROM pgwork.renewal_work WHERE business_key = %s ORDER BY due_at, id",
        (key,),
    )


async def test_rent_in_berlin_each_send_once_as_it_comes_due(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await series(
        conn, "rent", "FREQ=MONTHLY;BYMONTHDAY=1", "2027-01-01 09:00", "Europe/Berlin",
        "{7 days, 0}",
    )  # fmt: skip
    # Before March's seven-day notice is due, nothing of March exists.
    await materialise(dsn, cutoff=utc("2027-02-22 07:59"))
    assert [r["due_at"] for r in await made(conn)] == [
        utc("2026-12-25 08:00"), utc("2027-01-01 08:00"), utc("2027-01-25 08:00"),
        utc("2027-02-01 08:00"),
    ]  # fmt: skip
    # Across the change to summer time (28 March): the April notice at 09:00 CET, April 1 at
    # 09:00 CEST. Before April 1 only its seven-day notice exists.
    await materialise(dsn, cutoff=utc("2027-04-01 06:55"))
    got = await made(conn)
    assert [r["due_at"] for r in got][4:] == [
        utc("2027-02-22 08:00"), utc("2027-03-01 08:00"), utc("2027-03-25 08:00"),
    ]  # fmt: skip
    await materialise(dsn, cutoff=utc("2027-04-01 07:00"))
    got = await made(conn)
    assert got[-1]["due_at"] == utc("2027-04-01 07:00")
    assert got[-1]["deadline_local"] == dt.datetime(2027, 4, 1, 9, 0)
    assert len(got) == 8 and len({r["operation_id"] for r in got}) == 8
    # Passes again, late or repeated, make nothing more; the series is still one reminder row.
    await materialise(dsn, cutoff=utc("2027-03-01 00:00"))
    await materialise(dsn, cutoff=utc("2027-04-01 07:00"))
    assert len(await made(conn)) == 8
    assert len(await rows(conn, "SELECT id FROM pgwork.reminder")) == 1
    # Nothing beyond the cutoff: May's notice comes with a later pass.
    (r,) = await rows(conn, "SELECT next_fire_at FROM pgwork.reminder")
    assert r["next_fire_at"] == utc("2027-04-24 07:00")


async def test_a_daily_series_through_the_london_gap_and_the_new_york_overlap(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await series(conn, "gap", "FREQ=DAILY", "2027-03-27 01:30", "Europe/London")
    await series(
        conn, "twice", "FREQ=DAILY;BYHOUR=1,2;BYMINUTE=30", "2027-03-27 01:30", "Europe/London"
    )
    await series(conn, "overlap", "FREQ=DAILY", "2027-11-06 01:30", "America/New_York")
    await materialise(dsn, cutoff=utc("2027-03-29 01:00"))
    assert [r["due_at"] for r in await made(conn, "gap")] == [
        utc("2027-03-27 01:30"), utc("2027-03-28 01:30"), utc("2027-03-29 00:30"),
    ]  # fmt: skip
    # 01:30 shifted by the gap is 02:30 BST, also an occurrence: one send.
    assert [r["due_at"] for r in await made(conn, "twice")] == [
        utc("2027-03-27 01:30"), utc("2027-03-27 02:30"), utc("2027-03-28 01:30"),
        utc("2027-03-29 00:30"),
    ]  # fmt: skip
    await materialise(dsn, cutoff=utc("2027-11-08 07:00"))
    assert [r["due_at"] for r in await made(conn, "overlap")] == [
        utc("2027-11-06 05:30"), utc("2027-11-07 05:30"), utc("2027-11-08 06:30"),
    ]  # fmt: skip


async def test_a_sparse_rule_costs_a_few_probes_not_a_row_per_year(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await series(conn, "leap", "FREQ=YEARLY;BYMONTH=2;BYMONTHDAY=29", "2028-02-29 09:00", "UTC")
    visits = 0
    cutoff = utc("2028-03-01 00:00")
    while cutoff < utc("2032-03-01 00:00"):
        await materialise(dsn, cutoff=cutoff)
        visits += 1
        (r,) = await rows(conn, "SELECT next_fire_at FROM pgwork.reminder")
        assert r["next_fire_at"] > cutoff  # progress always moves on
        cutoff = r["next_fire_at"]
    assert [r["due_at"] for r in await made(conn, "leap")] == [
        utc("2028-02-29 09:00"), utc("2032-02-29 09:00"),
    ]  # fmt: skip
    assert visits <= 8


async def test_until_count_and_the_series_end(dsn: str, conn: psycopg.AsyncConnection[Any]) -> None:
    await series(
        conn, "weekdays", "FREQ=WEEKLY;BYDAY=MO,TU,WE,TH,FR", "2027-12-27 08:30",
        "America/New_York", recur_until="2027-12-31 23:59",
    )  # fmt: skip
    await series(conn, "five", "FREQ=DAILY;COUNT=5", "2027-12-27 08:30", "America/New_York")
    await materialise(dsn, cutoff=utc("2028-01-10 00:00"))
    got = await made(conn, "weekdays")
    assert len(got) == 5 and got[-1]["due_at"] == utc("2027-12-31 13:30")
    assert len(await made(conn, "five")) == 5
    # Both ended: progress is 'infinity', out of the materialiser's index.
    ended = await rows(conn, "SELECT next_fire_at = 'infinity' AS done FROM pgwork.reminder")
    assert [r["done"] for r in ended] == [True, True]


REFUSED = [
    ("INSERT INTO pgwork.reminder (source, business_key, due_at, recur, channel, recipient) "
     "VALUES ('app', 'x', now(), 'FREQ=DAILY', 'test', 'r')", "due_local"),
    ("INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, recur_until, channel, recipient) "
     "VALUES ('app', 'x', '2027-01-01 09:00', 'UTC', 'FREQ=DAILY', '2026-12-31', 'test', 'r')", "recur_until"),
    ("INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, channel, recipient) "
     "VALUES ('app', 'x', '2027-01-01 09:00', 'UTC', 'FREQ=HOURLY', 'test', 'r')", "recur"),
    ("INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, channel, recipient) "
     "VALUES ('app', 'x', '2027-01-02 09:00', 'UTC', 'FREQ=MONTHLY;BYMONTHDAY=1', 'test', 'r')", "due_local"),
    ("INSERT INTO pgwork.reminder (source, business_key, due_at, recur_until, channel, recipient) "
     "VALUES ('app', 'x', now(), '2027-01-01', 'test', 'r')", "recur"),
]  # fmt: skip


@pytest.mark.parametrize(("sql", "column"), REFUSED)
async def test_a_series_that_cannot_be_right_is_refused_where_it_is_written(
    conn: psycopg.AsyncConnection[Any], sql: str, column: str
) -> None:
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        await conn.execute(sql)
    assert info.value.diag.column_name == column
    assert await rows(conn, "SELECT id FROM pgwork.reminder") == []


async def _day(conn: psycopg.AsyncConnection[Any], days: int) -> str:
    """Local (UTC) 09:00, ``days`` from today."""
    r = await rows(
        conn, "SELECT (date_trunc('day', now() AT TIME ZONE 'UTC') + %s * interval '1 day' "
        "+ interval '9 hours')::text AS t", (days,),
    )  # fmt: skip
    return str(r[0]["t"])


async def _next(conn: psycopg.AsyncConnection[Any], k: int) -> str:
    """The k-th deadline of a daily series at the hour two hours from now (UTC): with no deadline
    of that series between now and the first in UTC, nor in UTC-1, the zone the test moves it
    to (an hour later), so a daily series moved back in time has none to make before it,
    whatever the time of day the test runs. (At a fixed 09:00, from 09:00 to 10:00 UTC the
    first was tomorrow's while today's 09:00 of UTC-1 was still ahead: the last step made it.)"""
    r = await rows(
        conn, "SELECT (date_trunc('hour', now() AT TIME ZONE 'UTC') + interval '2 hours' "
        "+ (%s - 1) * interval '1 day')::text AS t", (k,),
    )  # fmt: skip
    return str(r[0]["t"])


async def test_edits_never_resend_and_supersede_what_left_the_series(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    d1 = await _next(conn, 1)
    await series(conn, "rent", "FREQ=DAILY", d1, "UTC")
    horizon = utc(d1) + dt.timedelta(days=2, hours=1)  # three deadlines
    await materialise(dsn, cutoff=horizon)
    got = await made(conn)
    assert [r["status"] for r in got] == ["ready"] * 3
    # The first is sent.
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'delivered', finished_at = now() "
        "WHERE deadline_local = %s",
        (d1,),
    )
    await sync_queue(conn)
    # Every other day from the first: the second leaves the series, the first stays sent.
    await conn.execute("UPDATE pgwork.reminder SET recur = 'FREQ=DAILY;INTERVAL=2'")
    assert [r["status"] for r in await made(conn)] == ["delivered", "superseded", "ready"]
    await materialise(dsn, cutoff=horizon)
    assert [r["status"] for r in await made(conn)] == ["delivered", "superseded", "ready"]
    # Another zone: the same local deadlines, the same keys; unsent ones move with the zone (made
    # again at their new instant), the one the series no longer has is gone. West of UTC, without
    # summer time: an hour later at any time of year, so the first deadline is still ahead at any
    # hour the test runs (with Berlin, an hour earlier, it was past between 08:00 and 09:00 UTC and
    # the status view below showed the second).
    before = await made(conn)
    await conn.execute("UPDATE pgwork.reminder SET due_tz = 'Etc/GMT+1'")
    await materialise(dsn, cutoff=horizon)
    after = await made(conn)
    assert [r["operation_id"] for r in after] == [
        before[0]["operation_id"],
        before[2]["operation_id"],
    ]
    assert after[1]["deadline"] == before[2]["deadline"] + dt.timedelta(hours=1)
    assert after[0]["deadline"] == before[0]["deadline"]  # sent: as it was
    # Back to daily: the second deadline is in the series again and is made again, once.
    await conn.execute("UPDATE pgwork.reminder SET recur = 'FREQ=DAILY'")
    await materialise(dsn, cutoff=horizon)
    got = await made(conn)
    assert [r["status"] for r in got] == ["delivered", "ready", "ready"]
    # Skip the third, then end the series after the second, then pause: each closes what left.
    d3 = await _next(conn, 3)
    await conn.execute("UPDATE pgwork.reminder SET recur_skip = ARRAY[%s::timestamp]", (d3,))
    assert [r["status"] for r in await made(conn)] == ["delivered", "ready", "superseded"]
    await materialise(dsn, cutoff=horizon)
    assert len(await made(conn)) == 3
    await conn.execute("UPDATE pgwork.reminder SET paused = true")
    assert [r["status"] for r in await made(conn)] == ["delivered", "superseded", "superseded"]
    # The status view shows the next deadline: the first, sent already (as the test had it).
    (s,) = await rows(conn, "SELECT deadline_local, status FROM pgwork.reminder_status")
    assert (s["deadline_local"].isoformat(sep=" "), s["status"]) == (d1, "delivered")
    await materialise(dsn, cutoff=horizon)
    assert len(await made(conn)) == 3
    # Resumed: from now on; deleted: what is unsent is cancelled.
    await conn.execute("UPDATE pgwork.reminder SET paused = false, recur_skip = NULL")
    await materialise(dsn, cutoff=horizon)
    assert [r["status"] for r in await made(conn)] == ["delivered", "ready", "ready"]
    # The first deadline moved a year back (still an occurrence): nothing is sent for the year.
    await conn.execute("UPDATE pgwork.reminder SET due_local = due_local - interval '365 days'")
    await materialise(dsn, cutoff=horizon)
    assert [r["status"] for r in await made(conn)] == ["delivered", "ready", "ready"]
    await conn.execute("DELETE FROM pgwork.reminder")
    assert [r["status"] for r in await made(conn)] == ["delivered", "cancelled", "cancelled"]


async def test_a_zone_edit_onto_the_instant_of_a_sent_occurrence_is_that_send(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Two deadlines a day, 10:00 and 11:00 Berlin; tomorrow's 10:00 is sent, 11:00 is made and
    unsent. Moved to Helsinki (an hour ahead), 11:00 Helsinki is the instant 10:00 Berlin was
    sent at: the same send, as the page treats two local deadlines on one instant, so it is not
    made again, and the app's UPDATE goes through (it failed on work_occurrence_unique)."""
    d1 = (await _day(conn, 1)).replace("09:00", "10:00")
    await series(conn, "rent", "FREQ=DAILY;BYHOUR=10,11", d1, "Europe/Berlin")
    await materialise(dsn, cutoff=utc(d1) + dt.timedelta(minutes=30))  # 11:00 Berlin is 10:00Z
    got = await made(conn)
    assert [r["status"] for r in got] == ["ready", "ready"]
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'delivered', finished_at = now() "
        "WHERE deadline_local = %s",
        (d1,),
    )
    await sync_queue(conn)
    await conn.execute("UPDATE pgwork.reminder SET due_tz = 'Europe/Helsinki'")
    # 11:00 was made and never tried: removed, for the page to make again at its new instant.
    after = await made(conn)
    assert [(r["deadline_local"].hour, r["status"]) for r in after] == [(10, "delivered")]
    # The page makes no second row for the instant (its rule: one send per instant).
    await materialise(dsn, cutoff=utc(d1) + dt.timedelta(hours=3))
    assert [(r["deadline_local"].hour, r["status"]) for r in await made(conn)] == [
        (10, "delivered")
    ]


async def test_a_zone_edit_that_shifts_one_unsent_deadline_onto_another_makes_one_send(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """01:30 and 02:30 daily, made in UTC for 28 March 2027; moved to London, whose clocks jump
    from 01:00 to 02:00 that night, 01:30 is shifted onto 02:30's instant (01:30Z). The edit goes
    through (it was refused, naming due_tz: the trigger moved both rows itself and hit
    work_occurrence_unique). 01:30's row keeps its instant and stays; 02:30's moves onto it: it
    is removed (made, never tried), and the next pass does not make it again: one send for the
    instant."""
    await series(conn, "rent", "FREQ=DAILY;BYHOUR=1,2;BYMINUTE=30", "2027-03-28 01:30", "UTC")
    await materialise(dsn, cutoff=utc("2027-03-28 02:45"))
    before = await made(conn)
    assert [r["status"] for r in before] == ["ready", "ready"]
    await conn.execute("UPDATE pgwork.reminder SET due_tz = 'Europe/London'")
    for _ in range(2):
        got = {r["deadline_local"].hour: r for r in await made(conn)}
        assert list(got) == [1] and got[1]["status"] == "ready"
        assert got[1]["deadline"] == utc("2027-03-28 01:30")
        assert got[1]["operation_id"] == before[0]["operation_id"]
        await materialise(dsn, cutoff=utc("2027-03-28 02:45"))


async def test_downtime_every_missed_occurrence_accounted_for(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A daily series written ten days ago, every daemon down since: its ten occurrences are
    made, the ones past expire_after closed as expired with the reason, the last sent."""
    first = await _day(conn, -9)
    # Written ten days ago (as the trigger would have set it then), then nothing ran.
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, channel, recipient) "
        "VALUES ('app', 'rent', %s::timestamp + interval '1 day', 'UTC', 'FREQ=DAILY', 'test', 'r')",
        (first,),
    )
    await conn.execute(
        "UPDATE pgwork.reminder SET due_local = %s::timestamp",
        (first,),
    )
    await conn.execute(
        "UPDATE pgwork.reminder SET series_from = %s::timestamptz - interval '1 hour', "
        "next_fire_at = %s::timestamptz - interval '1 day', planned_at = %s::timestamptz - interval '1 hour'",
        (first + "+00", first + "+00", first + "+00"),
    )
    now = dt.datetime.now(UTC)
    await materialise(dsn, cutoff=now)
    got = await made(conn)
    # first is 09:00 nine days ago; today's 09:00 is made only once it has passed.
    today_passed = utc(first) + dt.timedelta(days=9) <= now
    assert len(got) == (10 if today_passed else 9)
    assert len({r["operation_id"] for r in got}) == len(got)
    closed = await claim(dsn, expire_after=86400, limit=100)
    # The last occurrence is within a day of its deadline: sent. Every earlier one is past
    # expire_after: closed as expired, with the reason. None lost, none doubled.
    verdicts = [r["status"] for r in sorted(closed, key=lambda r: r["due_at"])]
    assert verdicts == ["expired"] * (len(got) - 1) + ["claimed"]
    reasons = await rows(
        conn, "SELECT last_error FROM pgwork.renewal_work WHERE status = 'expired'"
    )
    assert reasons and all(r["last_error"].startswith("expired: not sent by") for r in reasons)


async def test_retention_leaves_no_tombstone_for_a_series_deadline_that_passed(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    d1 = await _day(conn, 1)
    await series(conn, "rent", "FREQ=DAILY", d1, "UTC", "{7 days, 0}")
    await materialise(dsn, cutoff=dt.datetime.now(UTC) + dt.timedelta(days=1, hours=12))
    # Everything made was sent long ago (as far as retention is concerned).
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'delivered', finished_at = now() - interval '40 days'"
    )
    await sync_queue(conn)
    # One of them for a deadline that passed a week ago (made before an edit, say).
    await conn.execute(
        "UPDATE pgwork.renewal_work SET deadline = now() - interval '7 days' "
        "WHERE id = (SELECT min(id) FROM pgwork.renewal_work)"
    )
    n = len(await made(conn))
    res = await clean(dsn, keep=30 * 86400.0)
    assert res.deleted == n
    tombs = await rows(conn, "SELECT deadline_local FROM pgwork.retired")
    # The early notices of deadlines still ahead keep a tombstone; the passed one none.
    assert len(tombs) == n - 1


async def test_retention_prunes_a_series_tombstone_once_its_deadline_cannot_come_back(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A series' tombstone is needed only while its deadline may still be made again (an edit
    restarts a series from now; a zone edit moves a deadline by at most about a day): once the
    deadline is two days past, retention deletes it. They were kept as long as the reminder
    lived, one more for every early notice sent. A one-off's tombstone stays (its deadline may
    be moved back to the same instant)."""
    d1 = await _day(conn, 1)
    await series(conn, "rent", "FREQ=DAILY", d1, "UTC", "{7 days, 0}")
    await add(conn, "one-off", "now() + interval '1 day'")
    await materialise(dsn, cutoff=dt.datetime.now(UTC) + dt.timedelta(days=1, hours=12))
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'delivered', finished_at = now() - interval '40 days'"
    )
    await sync_queue(conn)
    await clean(dsn, keep=30 * 86400.0)
    tombs = await rows(conn, "SELECT deadline_local FROM pgwork.retired")
    assert len([t for t in tombs if t["deadline_local"] is not None]) > 1
    assert len([t for t in tombs if t["deadline_local"] is None]) == 1
    # Time passes: every deadline is now more than two days past (the latest was made eight days
    # ahead at 09:00: ten days back left it short of two days past before 09:00 UTC).
    await conn.execute("UPDATE pgwork.retired SET deadline = deadline - interval '20 days'")
    await clean(dsn, keep=30 * 86400.0)
    left = await rows(conn, "SELECT deadline_local FROM pgwork.retired")
    assert [t["deadline_local"] for t in left] == [None]


async def test_a_daily_series_on_real_time_is_delivered_once_with_its_local_deadline(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, channel, recipient) "
        "VALUES ('app', 'standup', date_trunc('second', now() AT TIME ZONE 'Europe/Berlin') + interval '3 seconds', "
        "'Europe/Berlin', 'FREQ=DAILY', 'test', 'team')"
    )
    async with running(config(lookahead=300.0), dsn):

        async def sent() -> bool:
            return len(sink.DELIVERED) >= 1

        await until(sent, timeout=20, what="the first occurrence delivered")
        await until(lambda: _status(conn, "delivered"), timeout=10, what="its outcome recorded")
    (d,) = sink.DELIVERED
    assert d.time_zone == "Europe/Berlin" and d.deadline_local is not None
    assert d.document()["deadline_local"] == d.deadline_local.isoformat()
    assert d.document()["time_zone"] == "Europe/Berlin"
    # Tomorrow's occurrence is not made (it is beyond the look-ahead): one row in all.
    assert len(await made(conn, "standup")) == 1
    (s,) = await rows(conn, "SELECT deadline_local, status FROM pgwork.reminder_status")
    assert s["deadline_local"] == d.deadline_local + dt.timedelta(days=1)
    assert s["status"] == "scheduled"


async def _status(conn: psycopg.AsyncConnection[Any], status: str) -> bool:
    got = await rows(conn, "SELECT status FROM pgwork.renewal_work")
    return [r["status"] for r in got] == [status]


@pytest.mark.parametrize(("catch_up", "status"), [("all", "ready"), ("none", "expired")])
async def test_an_early_send_already_past_when_written_is_judged_by_catch_up(
    dsn: str, conn: psycopg.AsyncConnection[Any], catch_up: str, status: str
) -> None:
    """A daily series written today whose first deadline is tomorrow: the two-day notices of
    tomorrow's and the next day's deadlines fell due before the write. Their deadlines are
    ahead, so the channel's catch_up judges them (sent at once under `all`, closed as expired
    under `none`); nothing else is due yet."""
    await conn.execute("UPDATE pgwork.channel SET catch_up = %s WHERE name = 'test'", (catch_up,))
    d1 = await _day(conn, 1)
    await series(conn, "rent", "FREQ=DAILY", d1, "UTC", "{2 days, 0}")
    await materialise(dsn, cutoff=dt.datetime.now(UTC))
    got = await made(conn)
    d2 = await _day(conn, 2)  # its notice is due today at 09:00: past or not yet
    expected = [d for d in (d1, d2) if utc(d) - dt.timedelta(days=2) <= dt.datetime.now(UTC)]
    assert [
        (r["deadline_local"].isoformat(sep=" "), r["occurrence"], r["status"]) for r in got
    ] == [(d, dt.timedelta(days=2), status) for d in expected]
    if status == "expired":
        for r in await rows(conn, "SELECT last_error FROM pgwork.renewal_work"):
            assert r["last_error"].startswith("skipped by catch_up = none")


async def test_a_series_page_probes_by_key_whatever_the_statistics_say(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """materialise_series checks each occurrence it makes against the work rows of other local
    deadlines on the same instant. With statistics taken while renewal_work was empty, that
    probe was a scan of the whole table: each page of a crunch scanned every row the pages
    before it had made, once per occurrence (the bench's 100,000-series crunch: 5.3 s pages)."""
    await conn.execute("VACUUM ANALYZE pgwork.renewal_work, pgwork.retired")
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, channel, recipient) "
        "SELECT 'app', 'rent' || g, '2027-01-01 09:00', 'UTC', 'FREQ=MONTHLY', 'test', 'r' "
        "FROM generate_series(1, 2000) g"
    )
    params = {
        "coordinate": True, "cutoff": utc("2027-01-01 09:01"), "lookahead": dt.timedelta(0),
        "after_at": None, "after_id": 0, "limit": 1000, "origin": "d1", "take": "[]",
        "lease": dt.timedelta(seconds=60), "daemon_id": "d1", "aside": [], "turn_after": None,
    }  # fmt: skip
    async with await db.connect(dsn) as daemon:
        cur = await daemon.execute(Q["materialise_page"], params)  # the first 1,000
        (first,) = await cur.fetchall()
        assert first[2] == 1000
        params.update(after_at=first[7], after_id=first[8])
        async with daemon.transaction():
            cur = await daemon.execute(Q["materialise_page"], params)
            (page,) = await cur.fetchall()
            assert page[2] == 1000
            got = await rows(
                daemon,
                "SELECT pg_stat_get_xact_tuples_returned('pgwork.renewal_work'::regclass) AS seq",
            )
            raise psycopg.Rollback()
    # A thousand probes of the key, not a thousand scans of the first page's thousand rows.
    assert got[0]["seq"] <= 1000, got


async def test_a_series_page_works_out_each_rule_s_density_inline(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The page budgets each series by its rule's density and times of day (pgwork.recur_density,
    pgwork.recur_times), worked out in its own plan for each series: expressions only, inlined.
    With a subquery, recur_density ran as a function of its own, so the page asked it once per
    distinct rule (a DISTINCT over the page's rules and a join back to each series: ~3 us a
    series, the rent-day crunch's page ~10% slower than 993e7db's)."""
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, channel, recipient) "
        "SELECT 'app', 'rent' || g, '2027-01-01 09:00', 'UTC', "
        "CASE WHEN g % 2 = 0 THEN 'FREQ=MONTHLY' ELSE 'FREQ=MONTHLY;BYHOUR=9,18' END, 'test', 'r' "
        "FROM generate_series(1, 40) g"
    )
    params = {
        "coordinate": True, "cutoff": utc("2027-01-01 09:01"), "lookahead": dt.timedelta(0),
        "after_at": None, "after_id": 0, "limit": 1000, "origin": "d1", "take": "[]",
        "lease": dt.timedelta(seconds=60), "daemon_id": "d1", "aside": [], "turn_after": None,
    }  # fmt: skip
    async with await db.connect(dsn) as daemon:
        async with daemon.transaction():
            await daemon.execute("SET LOCAL track_functions = 'all'")
            cur = await daemon.execute(Q["materialise_page"], params)
            (page,) = await cur.fetchall()
            called = await rows(
                daemon,
                "SELECT funcname FROM pg_stat_xact_user_functions WHERE schemaname = 'pgwork'",
            )
            raise psycopg.Rollback()
    assert page[2] == 40  # each series' first deadline made
    assert {"materialise_series"} <= {c["funcname"] for c in called}
    assert not {"recur_density", "recur_times", "recur_list"} & {c["funcname"] for c in called}


EVERY_MINUTE = "FREQ=DAILY;BYHOUR={};BYMINUTE={}".format(
    ",".join(str(h) for h in range(24)), ",".join(str(m) for m in range(60))
)


@pytest.mark.parametrize("catch_up", ["all", "latest"])
async def test_a_dense_series_is_made_in_bounded_pages_and_whole_in_the_end(
    catch_up: str, dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A series every minute with sends at the deadline and a day before, written now: the
    day-ahead sends of the next day's 1,440 deadlines fired before it was written (catch_up
    judges them). A pass makes at most about the series' share of its page (the page size, 100
    here) and leaves the rest to the next pass; at the end each deadline's day-ahead send was made
    exactly once, and with catch_up = latest only the latest missed one is sent, though the
    missed ones spanned many passes. (A page used to evaluate and make all of them in one
    statement: 4.3 million rows for sixteen entries up to 375 days, past the statement timeout,
    retried for ever.)"""
    await conn.execute("UPDATE pgwork.channel SET catch_up = %s WHERE name = 'test'", (catch_up,))
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, remind_before, "
        "channel, recipient) VALUES ('app', 'dense', date_trunc('minute', now() AT TIME ZONE 'UTC') "
        "+ interval '1 minute', 'UTC', %s, '{0, 1 day}', 'test', 'r')",
        (EVERY_MINUTE,),
    )
    passes = 0
    while True:
        res = await materialise(dsn, page_size=100)
        passes += 1
        assert res.made <= 2 * 100, res
        if not res.unfinished:
            break
        assert passes < 100
    assert passes > 10  # the day's 1,440 sends took many passes
    (r,) = await rows(conn, "SELECT due_local, planned_at FROM pgwork.reminder")
    ahead = await rows(
        conn,
        "SELECT deadline_local, status FROM pgwork.renewal_work "
        "WHERE occurrence = '1 day' ORDER BY deadline_local",
    )
    minutes = [r["due_local"] + dt.timedelta(minutes=i) for i in range(len(ahead))]
    assert [a["deadline_local"] for a in ahead] == minutes  # each once, none missing
    assert minutes[-1] >= (res.cutoff + dt.timedelta(days=1)).replace(tzinfo=None) - dt.timedelta(
        minutes=1
    )
    missed = [
        a for a in ahead if a["deadline_local"] - dt.timedelta(days=1) < _naive(r["planned_at"])
    ]
    assert len(missed) > 1400
    sent = [a for a in missed if a["status"] == "ready"]
    if catch_up == "all":
        assert len(sent) == len(missed)
    else:
        assert sent == [missed[-1]]  # the latest missed one
        assert {a["status"] for a in missed[:-1]} == {"expired"}


async def _every_pass(dsn: str, **kw: Any) -> None:
    """Passes until none leaves a series unfinished (a daemon runs the next at once)."""
    for _ in range(50):
        if not (await materialise(dsn, **kw)).unfinished:
            return
    raise AssertionError("a series was still unfinished after 50 passes")


def _naive(t: dt.datetime) -> dt.datetime:
    return t.astimezone(UTC).replace(tzinfo=None)


async def test_a_null_among_the_skipped_deadlines_is_refused_naming_recur_skip(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """deadline <> ALL ('{2031-01-01, NULL}') is NULL for every deadline: the series made nothing,
    silently, and left reminder_status."""
    d1 = await _day(conn, 1)
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        await series(conn, "rent", "FREQ=DAILY", d1, "UTC", recur_skip=["2031-01-01 09:00", None])
    assert info.value.diag.column_name == "recur_skip"
    await series(conn, "rent", "FREQ=DAILY", d1, "UTC")
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        await conn.execute("UPDATE pgwork.reminder SET recur_skip = ARRAY[NULL::timestamp]")
    assert info.value.diag.column_name == "recur_skip"


async def test_a_zone_edit_never_sends_a_deadline_it_moves_before_the_edit(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Every minute in Kolkata, the next twenty minutes made; moved to Kathmandu, fifteen minutes
    ahead, the deadlines of the next quarter of an hour are before the edit: history, never sent
    (they stayed ready and were sent at once, 13-14.5 minutes late). The others are made again
    at their new instants, with their keys."""
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, channel, recipient) "
        "VALUES ('app', 'rent', date_trunc('minute', now() AT TIME ZONE 'Asia/Kolkata') + interval '1 minute', "
        "'Asia/Kolkata', %s, 'test', 'r')",
        (EVERY_MINUTE,),
    )
    await _every_pass(dsn, lookahead=20 * 60)
    before = {r["deadline_local"]: r for r in await made(conn)}
    assert len(before) >= 19
    await conn.execute("UPDATE pgwork.reminder SET due_tz = 'Asia/Kathmandu'")
    (edit,) = await rows(conn, "SELECT series_from FROM pgwork.reminder")
    await _every_pass(dsn, lookahead=20 * 60)
    after = {r["deadline_local"]: r for r in await made(conn)}
    kathmandu = dt.timedelta(hours=5, minutes=45)
    history = [k for k in before if k - kathmandu < _naive(edit["series_from"])]
    assert len(history) >= 13
    assert not [k for k in history if k in after]  # removed, never made again
    ahead = [k for k in before if k not in history]
    assert ahead and all(after[k]["status"] == "ready" for k in ahead)
    assert all(after[k]["deadline"] == (k - kathmandu).replace(tzinfo=UTC) for k in ahead)
    assert all(after[k]["operation_id"] == before[k]["operation_id"] for k in ahead)


async def test_reminder_status_shows_the_next_deadline_of_a_dense_series(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """A series every minute since the start of the year: the view looked at 64 deadlines from a
    day before now, all past, and showed no row at all."""
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, channel, recipient) "
        "VALUES ('app', 'dense', '2026-01-01 00:00', 'UTC', %s, 'test', 'r')",
        (EVERY_MINUTE,),
    )
    got = await rows(conn, "SELECT deadline, now() AS now FROM pgwork.reminder_status")
    assert len(got) == 1
    assert dt.timedelta(0) <= got[0]["deadline"] - got[0]["now"] <= dt.timedelta(minutes=1)
