"""Materialiser invariants: every eligible occurrence gets exactly one work row; nothing else does."""

from __future__ import annotations

import itertools
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgwork import db, store
from pgwork.duties import materialise as materialiser

from .helpers import add, count, materialise, rows, sync_queue, work

pytestmark = pytest.mark.anyio


async def test_due_reminder_gets_one_row_and_far_one_none(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await add(conn, "due", "now() - interval '1 second'")
    await add(conn, "far", "now() + interval '30 days'")
    res = await materialise(dsn)
    assert (res.made, res.made_due) == (1, 1)
    w = await work(conn)
    assert [(r["business_key"], r["status"], r["attempts"]) for r in w] == [("due", "ready", 0)]
    state = await rows(conn, "SELECT * FROM pgwork.materialiser_state")
    assert state[0]["last_cutoff"] == res.cutoff and state[0]["total_inserted"] == 1


async def test_lookahead_materialises_early_but_not_claimable_early(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await add(conn, "soon", "now() + interval '2 minutes'")
    assert (await materialise(dsn, lookahead=0)).made == 0
    res = await materialise(dsn, lookahead=300)
    assert (res.made, res.made_due) == (1, 0)
    w = await work(conn)
    assert w[0]["available_at"] == w[0]["due_at"]  # claimable only at its due instant


async def test_same_tick_twice_and_delayed_tick(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    # Due long before this (late) tick: a delayed tick covers everything up to its cutoff.
    for i in range(5):
        await add(conn, f"k{i}", f"now() - interval '{i} days'")
    first = await materialise(dsn)
    c = await db.connect(dsn)
    try:
        again = await materialiser.run_once(c, lookahead=0, page_size=100, cutoff=first.cutoff)
    finally:
        await c.close()
    assert (first.made, again.made if again else None) == (5, 0)
    assert len(await work(conn)) == 5


async def test_two_uncoordinated_materialisers_same_cutoff(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient, remind_before) "
        "SELECT 'race', 'k' || g, now() - (g % 100) * interval '1 second', 'test', 'r', '{0, 1 hour}' "
        "FROM generate_series(1, 2000) g"
    )
    cutoff = (await rows(conn, "SELECT now() AS t"))[0]["t"]
    made: list[int] = []

    async def one() -> None:
        c = await db.connect(dsn)
        try:
            res = await materialiser.run_once(
                c, lookahead=0, page_size=97, cutoff=cutoff, coordinate=False
            )
            assert res is not None
            made.append(res.made)
        finally:
            await c.close()

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(one)
    counts = await rows(
        conn,
        "SELECT count(*) AS n, count(DISTINCT (reminder_id, deadline, occurrence)) AS keys FROM pgwork.renewal_work",
    )
    assert counts[0]["n"] == counts[0]["keys"] == 4000
    assert sum(made) == 4000


async def test_paging_covers_everything_in_bounded_pages(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT 'p', 'k' || g, now() - interval '1 minute', 'test', 'r' FROM generate_series(1, 1050) g"
    )
    res = await materialise(dsn, page_size=100)
    assert (res.made, res.pages) == (1050, 11)


async def test_overdue_insert_is_materialised_once(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await materialise(dsn)  # a tick before the insert
    await add(conn, "overdue", "now() - interval '3 hours'")
    assert (await materialise(dsn)).made == 1
    assert (await materialise(dsn)).made == 0


async def test_late_committing_insert_is_not_lost(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as late:
        await add(late, "late", "now() - interval '1 minute'")  # transaction open, not committed
        assert (await materialise(dsn)).made == 0  # the tick cannot see it
        await late.commit()
    assert (await materialise(dsn)).made == 1
    assert [r["business_key"] for r in await work(conn)] == ["late"]


async def test_move_before_materialisation(dsn: str, conn: psycopg.AsyncConnection[Any]) -> None:
    await add(conn, "k", "now() + interval '1 day'")
    await conn.execute("UPDATE pgwork.reminder SET due_at = now() - interval '1 minute'")
    await materialise(dsn)
    w = await work(conn)
    r = await rows(conn, "SELECT due_at FROM pgwork.reminder")
    assert [(x["deadline"], x["status"]) for x in w] == [(r[0]["due_at"], "ready")]


async def test_move_after_materialisation_supersedes_then_back_revives(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await add(conn, "k", "now() - interval '1 minute'")
    await materialise(dsn)
    (old,) = await work(conn)
    await conn.execute("UPDATE pgwork.reminder SET due_at = now() - interval '10 seconds'")
    await materialise(dsn)
    w = await work(conn)
    assert [(x["id"], x["status"]) for x in w] == [
        (old["id"], "superseded"),
        (old["id"] + 1, "ready"),
    ]
    # Moving it back to the first deadline makes that occurrence current again (same operation id).
    await conn.execute("UPDATE pgwork.reminder SET due_at = %s", (old["deadline"],))
    await materialise(dsn)
    w = await work(conn)
    assert [(x["operation_id"], x["status"]) for x in w] == [
        (old["operation_id"], "ready"),
        (w[1]["operation_id"], "superseded"),
    ]


@pytest.mark.parametrize("kind", ["one-off", "series"])
async def test_an_apps_channel_edit_moves_the_unsent_work_to_the_new_channel(
    dsn: str, conn: psycopg.AsyncConnection[Any], kind: str
) -> None:
    """An app that changes a reminder's channel means the new one: its made and unsent work rows
    are closed by the edit and made again on the new channel by the next page (with the same
    operation id, so a receiver that saw the old channel's send can tell). They stayed on the
    old channel: sent there, or waiting for ever if no daemon serves it. What was sent stays."""
    if kind == "one-off":
        await add(conn, "k", "now() + interval '1 minute'", before="{1 hour, 0}")
    else:
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, channel, recipient) "
            "VALUES ('test', 'k', date_trunc('second', now() AT TIME ZONE 'UTC') + interval '1 minute', "
            "'UTC', 'FREQ=DAILY', 'test', 'r')"
        )
    await materialise(dsn, cutoff=datetime.now(UTC) + timedelta(hours=36))
    before = await work(conn)
    assert before and {w["channel"] for w in before} == {"test"}
    # The first is sent on the old channel before the edit.
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'delivered', finished_at = now() WHERE id = %s",
        (before[0]["id"],),
    )
    await sync_queue(conn)
    await conn.execute("UPDATE pgwork.reminder SET channel = 'log'")
    await materialise(dsn, cutoff=datetime.now(UTC) + timedelta(hours=36))
    after = {w["operation_id"]: (w["channel"], w["status"]) for w in await work(conn)}
    assert after[before[0]["operation_id"]] == ("test", "delivered")
    for w in before[1:]:
        assert after[w["operation_id"]] == ("log", "ready"), w
    live = [v for v in after.values() if v[1] == "ready"]
    assert live and all(ch == "log" for ch, _ in live)


async def test_moving_a_local_deadline_supersedes_its_unsent_work_at_once(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A move through due_local (the app never names due_at) closes the old occurrence's ready
    row in the same statement, as a move through due_at does; it used to wait for a claim."""
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, channel, recipient) "
        "VALUES ('test', 'k', (now() AT TIME ZONE 'UTC') - interval '1 minute', 'UTC', 'test', 'r')"
    )
    await materialise(dsn)
    await conn.execute("UPDATE pgwork.reminder SET due_local = due_local + interval '1 day'")
    assert [x["status"] for x in await work(conn)] == ["superseded"]


async def test_move_far_away_leaves_no_current_work(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await add(conn, "k", "now() - interval '1 minute'")
    await materialise(dsn)
    await conn.execute("UPDATE pgwork.reminder SET due_at = now() + interval '30 days'")
    assert (await materialise(dsn)).made == 0
    assert [x["status"] for x in await work(conn)] == ["superseded"]


async def test_cancel_after_materialisation(dsn: str, conn: psycopg.AsyncConnection[Any]) -> None:
    await add(conn, "k", "now() - interval '1 minute'")
    await materialise(dsn)
    await conn.execute("DELETE FROM pgwork.reminder")
    await materialise(dsn)
    w = await work(conn)
    assert [x["status"] for x in w] == ["cancelled"] and w[0]["finished_at"] is not None


async def test_offsets_each_fire_once_as_they_come_due(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    # Deadline in 90 minutes; sends 2 hours (overdue), 1 hour (in 30 min) and 0 before.
    await add(conn, "k", "now() + interval '90 minutes'", before="{2 hours, 1 hour, 0}")
    assert (await materialise(dsn)).made == 1
    assert (await materialise(dsn, lookahead=45 * 60)).made == 1
    assert (await materialise(dsn, lookahead=45 * 60)).made == 0
    assert (await materialise(dsn, lookahead=2 * 3600)).made == 1
    occ = sorted(x["occurrence"] for x in await work(conn))
    assert occ == [timedelta(0), timedelta(hours=1), timedelta(hours=2)]
    nxt = await rows(conn, "SELECT next_fire_at = 'infinity' AS done FROM pgwork.reminder")
    assert nxt[0]["done"]  # all done: retention can never make it fire again


async def test_dst_local_offsets_keep_wall_clock(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    # Clocks go forward at 02:00 on 2026-03-08 in New York: 09:00 that day is EDT (13:00 UTC);
    # one day before is 09:00 EST on 2026-03-07 (14:00 UTC), not 24 hours before.
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, remind_before, channel, recipient) "
        "VALUES ('s', 'k', '2026-03-08 09:00', 'America/New_York', '{1 day, 0}', 'test', 'r')"
    )
    await materialise(dsn)
    got = sorted(x["due_at"].isoformat() for x in await work(conn))
    assert got == ["2026-03-07T14:00:00+00:00", "2026-03-08T13:00:00+00:00"]


async def test_notify_once_per_statement_and_never_for_far_future(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as listener:
        await listener.execute("LISTEN pgwork_reminder")

        async def drain() -> int:
            return len([n async for n in listener.notifies(timeout=0.3)])

        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 'bulk', 'k' || g, now() + interval '90 days' + g * interval '1 second', 'test', 'r' "
            "FROM generate_series(1, 100000) g"
        )
        assert await drain() == 0
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 'near', 'k' || g, now() + interval '1 minute', 'test', 'r' FROM generate_series(1, 50) g"
        )
        assert await drain() == 1
        # Per statement, over the rows it wrote: one near row among far ones asks once; a far
        # deadline whose first send falls within the hour asks; rows not written do not.
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 'mixed', 'k' || g, now() + CASE WHEN g = 500 THEN interval '59 minutes' "
            "ELSE interval '61 minutes' END, 'test', 'r' FROM generate_series(1, 1000) g"
        )
        assert await drain() == 1
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, remind_before, channel, recipient) "
            "VALUES ('early', 'k', now() + interval '30 days', '{30 days, 0}', 'test', 'r')"
        )
        assert await drain() == 1
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "VALUES ('near', 'k1', now(), 'test', 'r') ON CONFLICT DO NOTHING"
        )
        assert await drain() == 0
        # Moving a far one into the window notifies too; the daemon's own writes never do.
        await conn.execute(
            "UPDATE pgwork.reminder SET due_at = now() WHERE source = 'bulk' AND business_key = 'k1'"
        )
        assert await drain() == 1
        await materialise(dsn)
        assert await drain() == 0
    assert (
        await rows(conn, "SELECT count(*) AS n FROM pgwork.renewal_work WHERE source = 'bulk'")
    )[0]["n"] == 1


# -- property: random interleavings of insert / move / cancel / tick ---------------------------

_example = itertools.count()
KEYS = ["a", "b", "c"]
op = st.one_of(
    st.tuples(
        st.just("insert"),
        st.sampled_from(KEYS),
        st.integers(-48, 48),
        st.sampled_from(["{0}", "{0, 1 day}", "{2 hours}"]),
    ),
    st.tuples(st.just("move"), st.sampled_from(KEYS), st.integers(-48, 48)),
    st.tuples(st.just("cancel"), st.sampled_from(KEYS)),
    st.tuples(st.just("tick"), st.sampled_from([0, 3600 * 3])),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(op, min_size=1, max_size=14))
def test_random_interleavings_keep_one_row_per_eligible_occurrence(
    dsn: str, ops: list[tuple[Any, ...]]
) -> None:
    source = f"ex{next(_example)}"

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
            for o in ops:
                if o[0] == "insert":
                    await c.execute(
                        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient, remind_before) "
                        "VALUES (%s, %s, now() + %s * interval '1 hour', 'test', 'r', %s::interval[]) "
                        "ON CONFLICT (source, business_key) DO NOTHING",
                        (source, o[1], o[2], o[3]),
                    )
                elif o[0] == "move":
                    await c.execute(
                        "UPDATE pgwork.reminder SET due_at = now() + %s * interval '1 hour' WHERE source = %s AND business_key = %s",
                        (o[2], source, o[1]),
                    )
                elif o[0] == "cancel":
                    await c.execute(
                        "DELETE FROM pgwork.reminder WHERE source = %s AND business_key = %s",
                        (source, o[1]),
                    )
                else:
                    await materialise(dsn, lookahead=o[1])
            await materialise(dsn)  # the final tick: cutoff = now
            # Every current occurrence due by now: exactly one live row. Nothing else is live.
            expected = await rows(
                c,
                "SELECT r.id, r.due_at, b FROM pgwork.reminder r, unnest(r.remind_before) b "
                "WHERE r.source = %s AND pgwork.fire_at(r.due_at, r.due_local, r.due_tz, b) <= now()",
                (source,),
            )
            live = await rows(
                c,
                "SELECT reminder_id, deadline, occurrence FROM pgwork.renewal_work "
                "WHERE source = %s AND status IN ('ready', 'claimed')",
                (source,),
            )
            # Live rows may also exist for occurrences materialised early by a look-ahead tick.
            early = await rows(
                c,
                "SELECT w.reminder_id FROM pgwork.renewal_work w JOIN pgwork.reminder r ON r.id = w.reminder_id "
                "WHERE w.source = %s AND w.status = 'ready' AND w.deadline = r.due_at AND w.due_at > now()",
                (source,),
            )
            want = sorted((e["id"], e["due_at"], e["b"]) for e in expected)
            have = sorted((x["reminder_id"], x["deadline"], x["occurrence"]) for x in live)
            assert len(have) == len(set(have)), "two live rows for one occurrence"
            assert set(want) <= set(have), "an eligible occurrence has no live row"
            assert len(have) - len(want) == len(early), "a live row that is neither due nor early"
            stale = await rows(
                c,
                "SELECT w.id FROM pgwork.renewal_work w LEFT JOIN pgwork.reminder r ON r.id = w.reminder_id "
                "WHERE w.source = %s AND w.status = 'ready' AND (r.id IS NULL OR r.due_at <> w.deadline)",
                (source,),
            )
            assert stale == [], "live work for a cancelled or moved reminder"

    anyio.run(main)


async def test_a_reminder_a_page_fails_on_is_set_aside_and_the_others_are_made(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A page failed as a whole on one reminder it could not make (here: a zone the server does
    not know, in a row written around the triggers), and every pass after it too. The pass
    retries the page in halves, sets that reminder aside for a while (named in the log), makes
    the others, and the next pass leaves it out; once its time is up it is tried again."""
    for i in range(20):
        await add(conn, f"k{i:02d}", "now() - interval '1 minute'")
    await conn.execute("SET session_replication_role = replica")
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, due_local, due_tz, "
        "remind_before, channel, recipient, next_fire_at) VALUES ('test', 'nowhere', now(), "
        "now() AT TIME ZONE 'UTC', 'Nowhere/Land', '{1 minute}', 'test', 'r', "
        "now() - interval '2 minutes')"
    )
    await conn.execute("RESET session_replication_role")
    (bad,) = await rows(conn, "SELECT id FROM pgwork.reminder WHERE business_key = 'nowhere'")
    aside = materialiser.SetAside()
    async with await db.connect(dsn) as c:
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            await materialiser.run_once(c, lookahead=0, page_size=8)
        res = await materialiser.run_once(c, lookahead=0, page_size=8, aside=aside)
        assert res is not None and (res.set_aside, res.made) == (1, 20)
        assert aside.ids(time.monotonic()) == [bad["id"]]
        again = await materialiser.run_once(c, lookahead=0, page_size=8, aside=aside)
        assert again is not None and (again.set_aside, again.made) == (0, 0)
        # Nothing holds a lock: no pass is said to have left a locked reminder (which would
        # pass again every half second and export a lock wait), and nothing else is due.
        assert not res.left_locked and not again.left_locked
        assert again.next_fire_at is None
        # The evidence stops short of the reminder that was not made.
        (state,) = await rows(
            c,
            "SELECT m.last_cutoff < r.next_fire_at AS short FROM pgwork.materialiser_state m, "
            "pgwork.reminder r WHERE r.business_key = 'nowhere'",
        )
        assert state["short"]
        # Its time is up: tried again, failed again, set aside for twice as long.
        later = time.monotonic() + materialiser.SetAside.FIRST + 1
        assert aside.ids(later) == []
        assert aside.add(bad["id"], later) == 2 * materialiser.SetAside.FIRST
    assert await count(conn) == 20


@pytest.mark.parametrize("sqlstate", ["21000", "23514", "P0001", "57014", "54000", "XX001"])
async def test_a_page_failing_on_one_row_sets_it_aside_whatever_the_error_class(
    sqlstate: str, dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The class of the error decides, not a list that can miss one: a reminder whose work row
    a trigger refuses with a cardinality violation, a constraint, a RAISE, a statement timeout,
    a limit of the server or a corrupt row is set aside, and the others are made."""
    for i in range(10):
        await add(conn, f"k{i:02d}", "now() - interval '1 minute'")
    await add(conn, "poison", "now() - interval '30 seconds'")
    await conn.execute(
        "CREATE FUNCTION pgwork.test_poison() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"RAISE EXCEPTION 'poison row' USING ERRCODE = '{sqlstate}'; END $$"
    )
    await conn.execute(
        "CREATE TRIGGER test_poison BEFORE INSERT ON pgwork.renewal_work FOR EACH ROW "
        "WHEN (NEW.business_key = 'poison') EXECUTE FUNCTION pgwork.test_poison()"
    )
    aside = materialiser.SetAside()
    async with await db.connect(dsn) as c:
        res = await materialiser.run_once(c, lookahead=0, page_size=4, aside=aside)
    assert res is not None and (res.set_aside, res.made) == (1, 10)
    assert await count(conn) == 10


async def test_a_page_that_fails_without_any_row_sets_nothing_aside(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A page that fails for no reminder's sake (here: the session's isolation level, refused by
    the page with a RAISE, a class a row can cause too) fails the pass: a page of no reminder
    fails as well, so no reminder is blamed for it."""
    for i in range(5):
        await add(conn, f"k{i:02d}", "now() - interval '1 minute'")
    aside = materialiser.SetAside()
    async with await db.connect(dsn) as c:
        await c.execute("SET default_transaction_isolation = 'repeatable read'")
        with pytest.raises(psycopg.errors.RaiseException):
            await materialiser.run_once(c, lookahead=0, page_size=4, aside=aside)
    assert aside.ids(time.monotonic()) == []
    assert await count(conn) == 0


async def test_a_full_page_serves_every_source_with_due_reminders_in_turn(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """One source's flood, due first, filled every page in due order: another source's reminder,
    due a moment later, was made only after all of it. A page that cannot take every due
    reminder now gives each due source a turn; the pass still makes every reminder once, and
    the other pages go on in due order from where the first left off."""
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT 'flood', 'f' || g, now() - interval '1 hour' + g * interval '1 ms', 'test', 'r' "
        "FROM generate_series(1, 500) g"
    )
    for source, n in (("small", 3), ("one", 1)):
        for i in range(n):
            await add(conn, f"{source}{i}", "now() - interval '1 minute'", source=source)
    async with await db.connect(dsn) as c:
        page, _ = await store.materialise_page(
            c,
            coordinate=True,
            cutoff=None,
            lookahead=timedelta(0),
            after_at=None,
            after_id=0,
            limit=40,
        )
    assert page is not None and page.made == 40
    made = await rows(
        conn, "SELECT source, count(*) AS n FROM pgwork.renewal_work GROUP BY 1 ORDER BY 1"
    )
    assert made == [
        {"source": "flood", "n": 36},
        {"source": "one", "n": 1},
        {"source": "small", "n": 3},
    ], made
    res = await materialise(dsn, page_size=40)
    assert res.made == 504 - 40
    assert await count(conn) == 504
    dup = await rows(
        conn, "SELECT reminder_id FROM pgwork.renewal_work GROUP BY 1 HAVING count(*) > 1"
    )
    assert dup == []


@given(
    sizes=st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=5),
    page=st.integers(min_value=2, max_value=30),
)
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_turns_by_source_make_every_due_reminder_once_whatever_the_mix(
    dsn: str, sizes: list[int], page: int
) -> None:
    """Sources of random sizes and due times, pages of a random size: every due reminder made
    once in one pass, whether its pages ran in turns or in due order, nothing not yet due."""

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
            await c.execute(
                "TRUNCATE pgwork.attempt, pgwork.renewal_work, pgwork.reminder, pgwork.retired, "
                "pgwork.lane"
            )
            for i, n in enumerate(sizes):
                await c.execute(
                    "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, "
                    "recipient) SELECT %s, 'k' || g, now() - interval '1 hour' "
                    "+ ((g * 7919 + %s) %% 600) * interval '1 second', 'test', 'r' "
                    "FROM generate_series(1, %s) g",
                    (f"s{i}", i, n),
                )
            await add(c, "later", "now() + interval '1 hour'", source="s0")
            res = await materialise(dsn, page_size=page)
            assert res.made == sum(sizes)
            assert await count(c) == sum(sizes)
            dup = await rows(
                c, "SELECT reminder_id FROM pgwork.renewal_work GROUP BY 1 HAVING count(*) > 1"
            )
            assert dup == []

    anyio.run(main)


async def test_the_exported_cutoff_is_the_recorded_one_and_ages_while_a_reminder_is_set_aside(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 68, item 2: while a reminder was set aside, `status` showed the recorded cutoff
    frozen and ageing, but pgwork_materialiser_cutoff_timestamp_seconds exported each pass's own
    cutoff (now plus the look-ahead), so PgworkMaterialiserStale, which the runbook says fires
    here, could not. The daemon exports the recorded cutoff: it stays put pass after pass."""
    from .helpers import add_in_an_unknown_zone, config, running, until

    await add_in_an_unknown_zone(conn)
    cfg = config(tick=0.2, metrics_enabled=True, metrics_listen="127.0.0.1:0")
    async with running(cfg, dsn) as d:

        def exported() -> float | None:
            return d.metrics.registry.get_sample_value(
                "pgwork_materialiser_cutoff_timestamp_seconds"
            )

        async def set_aside() -> bool:
            return bool(await rows(conn, "SELECT 1 FROM pgwork.set_aside"))

        await until(set_aside, what="the reminder set aside")
        await anyio.sleep(0.5)  # passes after it
        first = exported()
        await anyio.sleep(1.0)  # five more passes at the tick
        (state,) = await rows(conn, "SELECT last_cutoff FROM pgwork.materialiser_state")
        (now,) = await rows(conn, "SELECT now() AS t")
    assert first is not None and exported() == first
    assert first == state["last_cutoff"].timestamp()
    assert first < now["t"].timestamp() - 60  # held short of its occurrence, a minute ago
