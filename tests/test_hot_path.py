"""The hot path (issue 12): one hop from an app's INSERT to a claimed row, and the session
settings the daemon's statements rely on."""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from functools import partial
from typing import Any

import anyio
import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pgwork import db, store
from pgwork.channels import Delivery
from pgwork.channels.types import PayloadError, Receipt, decode_payload
from pgwork.duties import materialise as materialiser
from pgwork.duties.outcomes import Cleaner, Record, clean_receipt
from pgwork.metrics import Metrics
from pgwork.queries import P, Q, positional
from pgwork.secrets import Secrets
from pgwork.store._bind import _tuple_rows
from pgwork.supervise import Supervisor
from pgwork.waker import WakerGroup

from . import sink
from .helpers import add, config, rows, running, sync_queue, until, work

pytestmark = pytest.mark.anyio


@dataclass
class Claimer:
    """A delivery channel's side of a page claim, recording what it was handed."""

    request: store.ClaimRequest | None
    got: list[list[store.Claimed] | None] = field(default_factory=list)

    def page_claim(self) -> store.ClaimRequest | None:
        return self.request

    def page_claimed(
        self, request: store.ClaimRequest, rows: list[store.Claimed] | None, t_claim: float
    ) -> None:
        assert request is self.request
        self.got.append(rows)


def request(limit: int = 10, **kw: Any) -> store.ClaimRequest:
    return store.ClaimRequest(
        channel="test",
        limit=limit,
        max_attempts=3,
        lease=timedelta(seconds=60),
        daemon_id=kw.pop("daemon_id", "d1"),
        **kw,
    )


async def test_a_reminder_due_now_is_claimed_by_the_page_that_makes_it(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await add(conn, "now")
    await add(conn, "soon", "now() + interval '1 minute'")
    c = Claimer(request(daemon_id="d1"))
    async with (
        await db.connect(dsn) as daemon,
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as other,
    ):
        await other.execute("LISTEN pgwork_work")
        res = await materialiser.run_once(
            daemon, lookahead=300, page_size=100, claimers=[c], origin="d1"
        )
        assert res is not None and res.made == 2
        # Handed over as claimed rows, with the lease the row now carries.
        (got,) = c.got
        assert got is not None and len(got) == 1
        row = got[0]
        assert row.business_key == "now" and row.status == "claimed"
        assert row.lease == 1 and row.attempts == 1 and row.recipient == "r@example.com"
        by_key = {w["business_key"]: w for w in await work(conn)}
        assert by_key["now"]["status"] == "claimed" and by_key["now"]["claimed_by"] == "d1"
        assert by_key["now"]["lease"] == 1
        assert by_key["soon"]["status"] == "ready"  # made, not due: left to the claim timers
        # Other daemons are told, and told whose materialiser it was (it skips its own).
        told = [n async for n in other.notifies(timeout=1, stop_after=1)]
        assert [(n.channel, n.payload) for n in told] == [("pgwork_work", "d1")]


async def test_a_page_that_claimed_all_it_made_tells_no_other_daemon(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Work claimed by the page is no other daemon's to claim: a NOTIFY would only make each of
    them run a claim that finds nothing (per reminder due now, in a fleet). A row left ready
    still wakes them (the same listener, as a control)."""
    await add(conn, "now")
    c = Claimer(request(daemon_id="d1"))
    async with (
        await db.connect(dsn) as daemon,
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as other,
    ):
        await other.execute("LISTEN pgwork_work")
        res = await materialiser.run_once(
            daemon, lookahead=300, page_size=100, claimers=[c], origin="d1"
        )
        assert res is not None and res.made == 1
        assert [len(g or ()) for g in c.got] == [1]
        assert [n async for n in other.notifies(timeout=0.5, stop_after=1)] == []
        await add(conn, "soon", "now() + interval '1 minute'")
        res = await materialiser.run_once(
            daemon, lookahead=300, page_size=100, claimers=[c], origin="d1"
        )
        assert res is not None and res.made == 1
        told = [n async for n in other.notifies(timeout=1, stop_after=1)]
        assert [(n.channel, n.payload) for n in told] == [("pgwork_work", "d1")]


async def test_only_the_first_page_of_a_pass_claims(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    for i in range(5):
        await add(conn, f"k{i}", "now() - interval '1 minute'")
    c = Claimer(request(limit=2))
    async with await db.connect(dsn) as daemon:
        res = await materialiser.run_once(daemon, lookahead=0, page_size=2, claimers=[c])
    assert res is not None and res.made == 5 and res.pages == 3
    assert len(c.got) == 1 and c.got[0] is not None and len(c.got[0]) == 2
    assert [w["status"] for w in await work(conn)].count("claimed") == 2


async def test_a_paused_channel_claims_nothing_in_a_page(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The claim's gate holds in the page too, whatever the worker believed."""
    await conn.execute("SELECT pgwork.pause_channel('test', 'maintenance', 'tests')")
    await add(conn, "now")
    c = Claimer(request())
    async with await db.connect(dsn) as daemon:
        res = await materialiser.run_once(daemon, lookahead=0, page_size=100, claimers=[c])
    assert res is not None and res.made == 1
    assert c.got == [[]]
    assert [w["status"] for w in await work(conn)] == ["ready"]


async def test_a_claim_that_fails_in_the_page_loses_nothing_and_is_left_out_after(
    dsn: str, conn: psycopg.AsyncConnection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A page's claim that errors (here: an expire_after whose sum with the due time overflows)
    rolls the page's claims back with it; the claimer is told nothing was claimed, the same page
    runs again without claims in the same pass and makes the row (issue 68: the pass failed, and
    a retried set-aside reminder cost three lines a try), and the materialiser leaves claims out
    for a while."""
    await add(conn, "now")
    bad = Claimer(request(expire_after=timedelta(days=999_999_999)))
    pool = db.make_pool(dsn, 2, 5)
    await pool.open(wait=True)
    try:
        m = materialiser.Materialiser(
            pool,
            Supervisor(Metrics()),
            WakerGroup(),
            tick=5,
            lookahead=0,
            page_size=100,
            claimers=[bad],
            origin="d1",
        )
        await m.step()
        assert bad.got == [None]
        assert [(w["status"], w["attempts"]) for w in await work(conn)] == [("ready", 0)]
        assert "a page with claims failed, and ran without them" in caplog.text
        assert "DataError" in caplog.text or "out of range" in caplog.text
        await add(conn, "off")
        await m.step()  # claims are off for a while: not asked
        assert bad.got == [None] and len(await work(conn)) == 2
        # Later, claims are tried again (and fail again, losing nothing).
        m._claims_off_until = time.monotonic()  # skip the wait
        await add(conn, "again")
        await m.step()
        assert bad.got == [None, None]
        assert sorted(w["status"] for w in await work(conn)) == ["ready"] * 3
    finally:
        await pool.close()


async def test_daemon_sessions_run_without_jit(dsn: str) -> None:
    """JIT compiled the claim on every execution on PostgreSQL 15 (115 of 126 ms): the daemon's
    sessions turn it off, as they set their timeouts."""
    async with await db.connect(dsn) as c:
        (one,) = await rows(c, "SELECT current_setting('jit') AS jit")
        assert one["jit"] == "off"
    pool = db.make_pool(dsn, 1, 5)
    await pool.open(wait=True)
    try:
        async with pool.connection() as c:
            (one,) = await rows(c, "SELECT current_setting('jit') AS jit")
            assert one["jit"] == "off"
    finally:
        await pool.close()


async def test_a_revived_occurrence_is_made_ready_not_claimed(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A deadline moved away and back revives its superseded row (ON CONFLICT ... DO UPDATE):
    that row keeps its lease and attempts and is made ready for the claim, never claimed by the
    page that revives it."""
    await add(conn, "k", "now() - interval '1 minute'")
    async with await db.connect(dsn) as daemon:
        assert (await materialiser.run_once(daemon, lookahead=0, page_size=100)) is not None
        (first,) = await work(conn)
        # Moved away; the claim's verdict for the old occurrence (superseded) stands in here.
        await conn.execute("UPDATE pgwork.reminder SET due_at = due_at + interval '1 day'")
        await conn.execute(
            "UPDATE pgwork.renewal_work SET status = 'superseded', finished_at = now(), lease = 1,"
            " attempts = 1, claimed_by = 'd0', claimed_at = now()"
        )
        await sync_queue(conn)
        await conn.execute("UPDATE pgwork.reminder SET due_at = due_at - interval '1 day'")
        c = Claimer(request())
        res = await materialiser.run_once(daemon, lookahead=0, page_size=100, claimers=[c])
    assert res is not None and res.made == 1
    assert c.got == [[]]
    (row,) = await work(conn)
    assert row["id"] == first["id"] and row["status"] == "ready"
    assert (row["lease"], row["attempts"], row["claimed_by"]) == (1, 1, "d0")
    assert row["available_at"] == row["due_at"]


def _scans(plan: Any, relation: str) -> list[dict[str, Any]]:
    """The nodes of a JSON plan that read ``relation`` (not the one writing it)."""
    found: list[dict[str, Any]] = []
    if isinstance(plan, dict):
        if plan.get("Relation Name") == relation and plan.get("Node Type") != "ModifyTable":
            found.append(plan)
        for v in plan.values():
            found += _scans(v, relation)
    elif isinstance(plan, list):
        for v in plan:
            found += _scans(v, relation)
    return found


async def test_outcomes_applied_now_do_not_read_the_ledger(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """record_outcomes looks in the ledger only for a record it could not apply (fenced, or a
    retried write whose first run committed). Joined to every record, a plan made while the
    ledger was small hashed all of it on every flush: 25 ms a flush at 100k attempts on
    PostgreSQL 15 instead of 6 (bench.costs)."""
    from pgwork.queries import Q

    for i in range(20):
        await add(conn, f"k{i}", "now() - interval '1 minute'")
    async with await db.connect(dsn) as daemon:
        await materialiser.run_once(daemon, lookahead=0, page_size=100)
        claimed = await store.claim_work(daemon, request(limit=20))
    assert len(claimed) == 20
    await conn.execute("ANALYZE pgwork.attempt")
    outcomes = [
        {"work_id": r.id, "lease": r.lease, "attempt": r.attempts, "channel": "test",
         "outcome": "delivered", "status": "delivered", "started_ago": 0.01, "finished_ago": 0.0}
        for r in claimed
    ]  # fmt: skip
    params = {"outcomes": json.dumps(outcomes), "daemon_id": "d1", "host": "h", "pid": 1}
    async with conn.transaction():  # rolled back: only the plan is wanted
        cur = await conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + Q["record_outcomes"],
            params,
        )
        got = await cur.fetchone()
        raise psycopg.Rollback()
    assert got is not None
    (plan,) = got[0]
    applied = [n for n in _scans(plan, "renewal_work") if n.get("Actual Rows")]
    assert applied, "the statement found the claimed rows"
    ledger = _scans(plan, "attempt")
    assert ledger and all(n["Actual Loops"] == 0 for n in ledger), ledger


async def test_a_late_outcome_reads_the_ledger_by_key_however_the_flush_was_planned(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A record record_outcomes cannot apply (a late outcome, or a retried write) is looked up in
    the ledger, which keeps every attempt until retention. A daemon's session plans the flush once
    (db.PLAN_ONCE), maybe on a fresh install's ledger of a few rows, where a sequential scan is
    the cheapest plan: kept, every late outcome would read every attempt ever recorded. The
    lookup reads by key however it was planned (a guard: it does on PostgreSQL 15 and 18; with
    index scans turned off in the daemon's session this test fails, reading 20,000 rows)."""
    await add(conn, "late", "now() - interval '1 minute'")
    await conn.execute("ALTER TABLE pgwork.attempt SET (autovacuum_enabled = off)")
    await conn.execute(
        "INSERT INTO pgwork.attempt (work_id, lease, attempt, daemon_id, host, pid,"
        " started_at, finished_at, outcome) SELECT -g, 1, 1, 'd0', 'h', 1, now(), now(),"
        " 'delivered' FROM generate_series(20001, 20010) g"
    )
    await conn.execute("VACUUM ANALYZE pgwork.attempt")  # the statistics say: ten attempts
    pool = db.make_pool(dsn, 1, 5, plan_once=True)
    await pool.open(wait=True)
    try:
        async with pool.connection() as daemon:
            await materialiser.run_once(daemon, lookahead=0, page_size=100)
            (row,) = await store.claim_work(daemon, request(limit=1))
            late = Record(row.id, row.lease - 1, row.attempts, "test", "delivered", "delivered",
                          None, 0.0, 0.0).json_text(0.0)  # fmt: skip
            for _ in range(3):  # the flush planned while the ledger is empty
                await store.record_outcomes(daemon, outcomes="[]", daemon_id="d1", host="h", pid=1)
            # 20,000 attempts of other rows, as a ledger keeps them until retention.
            await conn.execute(
                "INSERT INTO pgwork.attempt (work_id, lease, attempt, daemon_id, host, pid,"
                " started_at, finished_at, outcome) SELECT -g, 1, 1, 'd0', 'h', 1, now(), now(),"
                " 'delivered' FROM generate_series(1, 20000) g"
            )
            async with daemon.transaction():
                (fenced,) = await store.record_outcomes(
                    daemon, outcomes=f"[{late}]", daemon_id="d1", host="h", pid=1
                )
                read = await _seq_read(daemon, "attempt")
                raise psycopg.Rollback()
    finally:
        await pool.close()
    assert fenced.fenced_id == row.id and not fenced.already
    assert read["attempt"] <= 10, read


#: Rows of renewal_work and work_lease this transaction read so far, by sequential scans and
#: through indexes (they hold what earlier transactions read until those are flushed).
_TABLE_READS = (
    "SELECT sum(pg_stat_get_xact_tuples_returned(t::regclass) "
    "+ pg_stat_get_xact_tuples_fetched(t::regclass))::bigint AS n "
    "FROM unnest(ARRAY['pgwork.renewal_work', 'pgwork.work_lease']) AS t"
)


async def _rows_read(conn: psycopg.AsyncConnection[Any], sql: str, params: Any) -> list[int]:
    """How many rows of renewal_work and work_lease ``sql`` read (by a scan or through an
    index), with the plans PostgreSQL chooses (custom at first) and with generic ones (those a
    pooled connection keeps once psycopg prepared the statement, and those PL/pgSQL keeps for
    the statements of the functions it calls). Counted by the server's statistics, a
    difference, so that what runs inside functions counts too. Rolled back."""
    read: list[int] = []
    for mode in ("auto", "force_generic_plan"):
        async with conn.transaction():
            await conn.execute(f"SET LOCAL plan_cache_mode = {mode}")
            (before,) = await rows(conn, _TABLE_READS)
            await conn.execute(sql, params)
            (after,) = await rows(conn, _TABLE_READS)
            raise psycopg.Rollback()
        read.append(int(after["n"]) - int(before["n"]))
    return read


async def _insert_due(conn: psycopg.AsyncConnection[Any], n: int) -> None:
    """``n`` reminders of one source on the test channel, due a minute ago."""
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT 's', 'k' || g, now() - interval '1 minute', 'test', 'r' "
        "FROM generate_series(1, %s) g",
        (n,),
    )


def _settling(mine: list[store.Claimed]) -> dict[str, dict[str, Any]]:
    """The parameters of the statements that settle the claimed rows ``mine``: their outcomes
    (all delivered), their leases extended, their leases released."""
    ids, leases = [r.id for r in mine], [r.lease for r in mine]
    outcomes = "[" + ",".join(
        Record(r.id, r.lease, r.attempts, "test", "delivered", "delivered", None, 0.0, 0.0)
        .json_text(0.0) for r in mine
    ) + "]"  # fmt: skip
    return {
        "record_outcomes": {"outcomes": outcomes, "daemon_id": "d1", "host": "h", "pid": 1},
        "extend_leases": {"work_id": ids, "lease_no": leases, "lease": timedelta(seconds=60)},
        "release_leases": {
            "work_id": ids, "lease_no": leases, "daemon_id": "d1", "host": "h", "pid": 1
        },
    }  # fmt: skip


async def test_outcomes_leases_and_releases_read_only_the_rows_they_name(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """record_outcomes, extend_leases and release_leases name their rows by id, and must read
    them by primary key whatever the statistics say. Statistics taken while few rows were
    claimed (a table analysed before a burst: on a large table the next ANALYZE is 2% of its
    rows away) made work_held, the partial index of claimed rows, look cheaper: every flush read
    every claimed row of every channel and daemon (24 ms a flush instead of 6 with 20,000
    rows claimed elsewhere, PostgreSQL 15). Leases are rows of work_lease now, analysed here
    while it is empty, with its (channel, expires_at) index as the same trap."""
    await conn.execute("ALTER TABLE pgwork.renewal_work SET (autovacuum_enabled = off)")
    await _insert_due(conn, 1500)
    async with await db.connect(dsn) as daemon:
        await materialiser.run_once(daemon, lookahead=0, page_size=2000)
        await conn.execute("ANALYZE pgwork.renewal_work, pgwork.work_lease")  # no row claimed yet
        held = 0
        while held < 1200:  # another daemon's rows, under long leases
            held += len(await store.claim_work(daemon, request(limit=400, daemon_id="other")))
        mine = await store.claim_work(daemon, request(limit=20))
    assert len(mine) == 20
    read = {
        name: await _rows_read(conn, Q[name], params) for name, params in _settling(mine).items()
    }
    # Each named row read once or twice (extend_leases reads its rows, then locks them), never
    # the other daemon's 1,200.
    assert all(n <= 3 * len(mine) for counts in read.values() for n in counts), read


#: 3,000 reminders of one source: 20 due a minute ago, the others in an hour.
DUE_AND_LATER = (
    "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
    "SELECT 's', 'k' || g, now() + CASE WHEN g <= 20 THEN interval '-1 minute' "
    "ELSE interval '1 hour' END, 'test', 'r' FROM generate_series(1, 3000) g"
)


async def _seq_read(conn: psycopg.AsyncConnection[Any], *tables: str) -> dict[str, int]:
    """Rows of each pgwork table that sequential scans read in this transaction so far."""
    got = await rows(
        conn,
        "SELECT t, pg_stat_get_xact_tuples_returned(('pgwork.' || t)::regclass) AS n "
        "FROM unnest(%s::text[]) AS t",
        (list(tables),),
    )
    return {r["t"]: int(r["n"]) for r in got}


def _arrays_probed_again(plan: dict[str, Any]) -> list[str]:
    """Index conditions on a whole array (``= ANY``) in plan nodes that ran more than once (the
    inner side of a nested loop): every run prepares the array again, sorting it."""
    found: list[str] = []
    if plan.get("Actual Loops", 1) > 1 and "ANY" in plan.get("Index Cond", ""):
        found.append(f"{plan['Node Type']} on {plan.get('Relation Name')}: {plan['Index Cond']}")
    for sub in plan.get("Plans", []):
        found += _arrays_probed_again(sub)
    return found


async def test_a_flush_probes_each_record_by_its_key_alone(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """An outcome flush updates the records whose lease rows it ended, one key probe per
    record (the inner side of a nested loop). Each probe also carried the whole flush's ids
    (``w.id = ANY (...)``, meant to keep the read by key): PostgreSQL prepares (sorts) that
    array again for every probe, so a flush's cost grew with its square: 25 µs of Postgres a
    record in a flush of 1,000 against 15 without (python -m bench.outcome_cost --batch 1000).
    The records are read by key without it, however the statement was planned
    (test_outcomes_leases_and_releases_read_only_the_rows_they_name,
    test_a_daemon_planned_on_an_empty_table_reads_its_rows_by_key). The statements that extend
    and release leases are held to the same."""
    await _insert_due(conn, 60)
    async with await db.connect(dsn) as daemon:
        await materialiser.run_once(daemon, lookahead=0, page_size=100)
        mine = await store.claim_work(daemon, request(limit=50))
    assert len(mine) == 50
    probed: dict[str, list[str]] = {}
    for name, params in _settling(mine).items():
        for mode in ("auto", "force_generic_plan"):
            async with conn.transaction():
                await conn.execute(f"SET LOCAL plan_cache_mode = {mode}")
                cur = await conn.execute(
                    "EXPLAIN (ANALYZE, FORMAT JSON) " + Q[name], params, prepare=False
                )
                ((plan,),) = await cur.fetchall()
                probed[f"{name} ({mode})"] = _arrays_probed_again(plan[0]["Plan"])
                raise psycopg.Rollback()
    assert not any(probed.values()), probed


async def test_a_daemon_planned_on_an_empty_table_reads_its_rows_by_key(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A daemon's session plans each statement once (db.PLAN_ONCE), and a daemon started on an
    empty renewal_work (a fresh install; rent day's daemons, idle until the crunch) keeps plans
    made for an empty table. The claim's read its candidates, and updated them, by a sequential
    scan of the whole table: every claim read every row the pages had made since (on rent day,
    12.9 ms a claim during the crunch, 306 claims while 100,000 rows were made, instead of ~0.3).
    The claim and the statements that settle its rows read them by key, however they were
    planned."""
    await conn.execute("ALTER TABLE pgwork.renewal_work SET (autovacuum_enabled = off)")
    await conn.execute("VACUUM ANALYZE pgwork.renewal_work")  # the statistics say: empty
    pool = db.make_pool(dsn, 1, 5, plan_once=True)
    await pool.open(wait=True)
    read: dict[str, int] = {}
    try:
        async with pool.connection() as daemon:
            for _ in range(3):  # each planned while the table is empty
                assert await store.claim_work(daemon, request()) == []
                await store.record_outcomes(daemon, outcomes="[]", daemon_id="d1", host="h", pid=1)
                await store.extend_leases(
                    daemon, work_id=[], lease_no=[], lease=timedelta(seconds=60)
                )
                await store.release_leases(
                    daemon, work_id=[], lease_no=[], daemon_id="d1", host="h", pid=1
                )
            await conn.execute(DUE_AND_LATER)
            async with await db.connect(dsn) as other:
                made = await materialiser.run_once(other, lookahead=7200, page_size=5000)
            assert made is not None and made.made == 3000
            async with daemon.transaction():
                mine = await store.claim_work(daemon, request(limit=10))
                read["claim_work"] = (await _seq_read(daemon, "renewal_work"))["renewal_work"]
            assert len(mine) == 10
            ids, leases = [r.id for r in mine], [r.lease for r in mine]
            outcomes = "[" + ",".join(
                Record(r.id, r.lease, r.attempts, "test", "delivered", "delivered", None, 0.0, 0.0)
                .json_text(0.0) for r in mine
            ) + "]"  # fmt: skip
            settle: dict[str, Any] = {
                "record_outcomes": partial(
                    store.record_outcomes, outcomes=outcomes, daemon_id="d1", host="h", pid=1
                ),
                "extend_leases": partial(
                    store.extend_leases, work_id=ids, lease_no=leases, lease=timedelta(seconds=60)
                ),
                "release_leases": partial(
                    store.release_leases,
                    work_id=ids,
                    lease_no=leases,
                    daemon_id="d1",
                    host="h",
                    pid=1,
                ),
            }
            for name, call in settle.items():
                async with daemon.transaction():
                    got = await call(daemon)
                    # Every outcome applied (none returned); every lease extended or released.
                    assert len(got) == (0 if name == "record_outcomes" else 10), (name, got)
                    read[name] = (await _seq_read(daemon, "renewal_work"))["renewal_work"]
                    raise psycopg.Rollback()
    finally:
        await pool.close()
    # Ten rows claimed and settled: read by key, never the 3,000 made.
    assert all(n <= 100 for n in read.values()), read


async def test_a_page_planned_on_empty_tables_reads_by_key(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The materialiser's page and the claim keep the plans they make in a session, in any
    session: behind PgBouncer too, where the daemon's session settings (db.PLAN_ONCE) are not
    sent. A page planned while the tables were empty advanced its reminders by a sequential scan
    of all of them (bench.plans: 80,253 reminders read to page 3), and a claim read its
    candidates by a scan of every work row. Both read by key, however they were planned."""
    for table in ("reminder", "renewal_work"):
        await conn.execute(f"ALTER TABLE pgwork.{table} SET (autovacuum_enabled = off)")
    await conn.execute("VACUUM ANALYZE pgwork.reminder, pgwork.renewal_work")  # both empty
    params: dict[str, Any] = {
        "coordinate": True, "cutoff": None, "lookahead": timedelta(minutes=1), "after_at": None,
        "after_id": 0, "limit": 100, "origin": "d1",
        "take": json.dumps([{"channel": "test", "room": 10, "expire_after_s": None}]),
        "lease": timedelta(seconds=60), "daemon_id": "d1", "aside": [], "turn_after": None,
    }  # fmt: skip
    async with await db.connect(dsn, pooled=True) as daemon:  # no session settings
        for _ in range(6):  # planned while both tables are empty (custom ones first)
            await daemon.execute(Q["materialise_page"], params)
            assert await store.claim_work(daemon, request()) == []
        await conn.execute(DUE_AND_LATER)
        async with await db.connect(dsn) as other:  # the later ones made, not due yet
            await materialiser.run_once(other, lookahead=7200, page_size=5000, cutoff=None)
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 's', 'now' || g, now(), 'test', 'r' FROM generate_series(1, 5) g"
        )
        read: dict[str, dict[str, int]] = {}
        async with daemon.transaction():
            cur = await daemon.execute(Q["materialise_page"], params)
            page = await cur.fetchall()
            read["page"] = await _seq_read(daemon, "reminder", "renewal_work")
            raise psycopg.Rollback()
        async with daemon.transaction():
            claimed = await store.claim_work(daemon, request())
            read["claim"] = await _seq_read(daemon, "renewal_work")
            raise psycopg.Rollback()
    assert len(page) == 5 and page[0][2] == 5  # five made, each claimed in the page
    assert len(claimed) == 10
    # Five reminders paged and ten rows claimed, among 3,000 of each: read by key.
    assert all(n <= 100 for got in read.values() for n in got.values()), read


async def test_a_crowded_page_finds_its_sources_by_key(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A page that cannot take every due reminder serves the sources in turn: it finds them by a
    skip scan of reminder_due_by_source, a probe or two per source, and takes its rows by their
    row versions, never by reading every due reminder, however it was planned (here: on empty
    tables). Taken by id, a plan made on empty tables read every due reminder by a bitmap scan
    on every page (6 s a page with 200,000 due on PostgreSQL 15)."""
    await conn.execute("ALTER TABLE pgwork.reminder SET (autovacuum_enabled = off)")
    await conn.execute("VACUUM ANALYZE pgwork.reminder, pgwork.renewal_work")  # both empty
    params: dict[str, Any] = {
        "coordinate": True, "cutoff": None, "lookahead": timedelta(0), "after_at": None,
        "after_id": 0, "limit": 100, "origin": "d1", "take": "[]",
        "lease": timedelta(seconds=60), "daemon_id": "d1", "aside": [], "turn_after": None,
    }  # fmt: skip
    async with await db.connect(dsn, pooled=True) as daemon:  # no session settings
        for _ in range(6):  # planned while the tables are empty
            await daemon.execute(Q["materialise_page"], params)
        await conn.execute(DUE_AND_LATER)  # 20 due, 2,980 later, source 's'
        await conn.execute(  # 3,000 more due of source 's'
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 's', 'more' || g, now() - interval '1 minute', 'test', 'r' "
            "FROM generate_series(1, 3000) g"
        )
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 'src' || (g % 30), 'k' || g, now() + CASE WHEN g <= 60 "
            "THEN interval '-30 seconds' ELSE interval '1 day' END, 'test', 'r' "
            "FROM generate_series(1, 3000) g"
        )
        async with daemon.transaction():
            cur = await daemon.execute(Q["materialise_page"], params)
            page = await cur.fetchall()
            read = await _seq_read(daemon, "reminder", "renewal_work")
            fetched = await rows(
                daemon,
                "SELECT pg_stat_get_xact_tuples_fetched('pgwork.reminder'::regclass) AS n",
            )
            made = await rows(daemon, "SELECT count(DISTINCT source) AS n FROM pgwork.renewal_work")
            raise psycopg.Rollback()
    assert page[0][2] == 100  # made a full page
    assert made[0]["n"] == 31  # every source with a due reminder had its turn
    assert all(n <= 100 for n in read.values()), read
    # 100 made among 3,080 due: each source probed, each row taken by its version.
    assert fetched[0]["n"] <= 600, fetched


async def test_a_claim_starts_where_its_lane_s_ready_rows_start(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A drain's claims take the oldest ready rows of a lane, and each row taken leaves its ready
    entry behind in work_ready_order until a vacuum removes it (the claim deletes its row). Claims that read a lane from its start walked every such entry: in a
    drain of 100,000 rows claimed ten at a time, without a vacuum, the last tenth's claims cost
    2-3x the first's (python -m bench.claim_cost --drain). A lane knows where its ready rows
    start in the index's order (lane.ready_from, ready_from_id: a time alone does not tell rows
    of one due time apart), and its claims read from there: the entries of rows already taken
    are not read again."""
    await conn.execute("ALTER TABLE pgwork.work_ready SET (autovacuum_enabled = off)")
    await conn.execute(  # one due time for all, as a bulk insert has: ordered by id within it
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT 's', 'k' || g, now() - interval '1 hour', 'test', 'r' FROM generate_series(1, 3000) g"
    )

    async def claim_reading(daemon: psycopg.AsyncConnection[Any]) -> tuple[int, int]:
        """Rows claimed, and work_ready_order's pages read, by one claim (rolled back). The count
        is a difference: it holds what earlier transactions read until it is flushed."""
        pages = "SELECT pg_stat_get_xact_blocks_fetched('pgwork.work_ready_order'::regclass) AS n"
        async with daemon.transaction():
            (before,) = await rows(daemon, pages)
            got = await store.claim_work(daemon, request(limit=10))
            (after,) = await rows(daemon, pages)
            raise psycopg.Rollback()
        return len(got), int(after["n"]) - int(before["n"])

    async with await db.connect(dsn) as daemon:
        await materialiser.run_once(daemon, lookahead=0, page_size=5000)
        first = await claim_reading(daemon)
        for _ in range(280):  # 2,800 rows taken, their ready entries left in the index
            assert len(await store.claim_work(daemon, request(limit=10))) == 10
        late = await claim_reading(daemon)
    assert first[0] == late[0] == 10
    # The same pages as the drain's first claim, give or take a page; not the ~20 leaf pages of
    # entries left behind, read twice.
    assert late[1] <= first[1] + 4, (first, late)


async def test_moving_or_deleting_a_reminder_reads_only_its_own_work_rows(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """An app's UPDATE of a deadline and its DELETE of a reminder close the reminder's ready work
    rows (triggers). With statistics taken while little work was live, the planner added a scan
    of the whole claimable index to the reminder's own few rows (a BitmapAnd): every such write
    of every app read every live work row of every channel. The triggers now delete the rows'
    entries of pgwork.work_ready first, planned as well on an empty one: neither table may be
    read beyond the reminder's own rows, by index or by a scan."""
    for table in ("renewal_work", "work_ready"):
        await conn.execute(f"ALTER TABLE pgwork.{table} SET (autovacuum_enabled = off)")
    await add(conn, "early", "now() + interval '1 day'")
    await conn.execute("ANALYZE pgwork.renewal_work, pgwork.work_ready")  # no work row yet
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT 's', 'k' || g, now() + interval '10 minutes', 'test', 'r' "
        "FROM generate_series(1, 3000) g"
    )
    async with await db.connect(dsn) as daemon:
        await materialiser.run_once(daemon, lookahead=3600, page_size=5000)
    assert len(await work(conn)) == 3000

    counted = (
        "SELECT i.indexrelid::regclass::text AS name, "
        "pg_stat_get_xact_tuples_returned(i.indexrelid) AS n "
        "FROM pg_index i WHERE i.indrelid IN ('pgwork.renewal_work'::regclass, "
        "'pgwork.work_ready'::regclass) "
        "UNION ALL SELECT t || ' (scanned)', pg_stat_get_xact_tuples_returned(t::regclass) "
        "FROM unnest(ARRAY['pgwork.renewal_work', 'pgwork.work_ready']) AS t"
    )

    async def index_reads(sql: str) -> dict[str, int]:
        """What ``sql`` read of each (a difference: the counts hold what earlier transactions
        read until they are flushed)."""
        async with conn.transaction():
            before = {r["name"]: r["n"] for r in await rows(conn, counted)}
            await conn.execute(sql)
            got = await rows(conn, counted)
            closed = await rows(
                conn, "SELECT count(*) AS n FROM pgwork.renewal_work WHERE status <> 'ready'"
            )
            raise psycopg.Rollback()
        assert closed[0]["n"] == 1, sql  # the trigger closed the reminder's one row
        return {r["name"]: r["n"] - before[r["name"]] for r in got}

    for _ in range(7):  # PL/pgSQL plans a statement for itself from its sixth run on
        moved = await index_reads(
            "UPDATE pgwork.reminder SET due_at = due_at + interval '1 day' WHERE business_key = 'k7'"
        )
        deleted = await index_reads("DELETE FROM pgwork.reminder WHERE business_key = 'k8'")
        for reads in (moved, deleted):
            # The reminder's own index entries (the rolled-back runs leave a few more each time),
            # not the 3,000 live rows.
            assert sum(reads.values()) <= 50, reads


async def test_a_page_reads_only_the_tombstones_of_what_it_pages(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A page checks each occurrence it would insert against pgwork.retired. Tombstones pile up
    for as long as their reminders exist (an app that keeps its deadlines after they pass keeps
    one per sent occurrence): the page's generic plan hashed the whole table on every page,
    however few reminders it paged, so every reminder due now waited for a scan of all of
    them (PostgreSQL 15 at these sizes; 18's estimates keep the probes here, so this fails on
    the old page only on 15, which CI runs too)."""
    await conn.execute(
        "INSERT INTO pgwork.retired (reminder_id, deadline, occurrence, status, operation_id, "
        "finished_at) SELECT -g, now() - interval '40 days', '0', 'delivered', "
        "md5(g::text)::uuid, now() - interval '40 days' FROM generate_series(1, 3000) g"
    )
    for due, n in (("now() - interval '1 minute'", 4000), ("now() + interval '30 days'", 2000)):
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            f"SELECT 's', md5(random()::text), {due}, 'test', 'r' FROM generate_series(1, {n}) g"
        )
    async with await db.connect(dsn) as daemon:
        await materialiser.run_once(daemon, lookahead=0, page_size=5000)
    await conn.execute("ANALYZE pgwork.retired, pgwork.reminder, pgwork.renewal_work")
    for i in range(3):
        await add(conn, f"k{i}", "now() - interval '1 second'")
    take = json.dumps([{"channel": "test", "room": 10, "expire_after_s": None}])
    params: dict[str, Any] = {
        "coordinate": True, "cutoff": None, "lookahead": timedelta(0), "after_at": None,
        "after_id": 0, "limit": 1000, "origin": "d1", "take": take,
        "lease": timedelta(seconds=60), "daemon_id": "d1", "aside": [], "turn_after": None,
    }  # fmt: skip
    async with await db.connect(dsn) as daemon:
        for _ in range(2):  # a connection's first page plans the function's statements
            async with daemon.transaction():
                cur = await daemon.execute(Q["materialise_page"], params)
                assert [r[9] is not None for r in await cur.fetchall()] == [True] * 3
                got = await rows(
                    daemon,
                    "SELECT pg_stat_get_xact_tuples_returned('pgwork.retired'::regclass) AS seq, "
                    "pg_stat_get_xact_tuples_returned('pgwork.retired_pkey'::regclass) AS idx",
                )
                raise psycopg.Rollback()
            # Three probes of the primary key, not a scan of 3,000 tombstones.
            assert got[0]["seq"] + got[0]["idx"] <= 10, got


async def test_a_delivery_from_a_claimed_row_is_the_dataclass_its_fields_make(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """``Delivery.from_claim`` fills the frozen instance's ``__dict__`` in one step (a frozen
    dataclass's ``__init__`` costs a call per field): it must make exactly what the dataclass's
    own constructor makes, every field included, and stay frozen."""
    await add(conn, "k", "now() - interval '1 minute'")
    async with await db.connect(dsn) as daemon:
        await materialiser.run_once(daemon, lookahead=0, page_size=100)
        (row,) = await store.claim_work(daemon, request())
    d = Delivery.from_claim(row, "00-trace-span-01", "k=v")
    assert set(vars(d)) == {f.name for f in dataclasses.fields(Delivery)}
    assert d == Delivery(
        operation_id=row.operation_id,
        source=row.source,
        business_key="k",
        deadline=row.deadline,
        occurrence=row.occurrence,
        due_at=row.due_at,
        channel="test",
        work_id=row.id,
        recipient="r@example.com",
        payload_json=row.payload or "",
        attempt=1,
        traceparent="00-trace-span-01",
        tracestate="k=v",
    )
    assert d.payload == json.loads(row.payload or "")
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.attempt = 2  # type: ignore[misc]


def _document_by_json_dumps(d: Delivery) -> str:
    """The webhook document as json.dumps writes it: what Delivery.document_json must equal."""
    doc: dict[str, Any] = {
        "operation_id": str(d.operation_id),
        "source": d.source,
        "business_key": d.business_key,
        "deadline": d.deadline.isoformat(),
        # A whole number of seconds is written as an integer.
        "occurrence_seconds": int(s) if (s := d.occurrence.total_seconds()).is_integer() else s,
        "due_at": d.due_at.isoformat(),
        "channel": d.channel,
        "recipient": d.recipient,
        "attempt": d.attempt,
    }
    if d.deadline_local is not None:
        doc |= {"deadline_local": d.deadline_local.isoformat(), "time_zone": d.time_zone}
    head = json.dumps(doc, separators=(",", ":"))
    return f'{head[:-1]},"payload":{d.payload_json}}}'


_zones = st.sampled_from(
    [UTC, timezone(timedelta(hours=5, minutes=30)), timezone(-timedelta(hours=3))]
)


@settings(max_examples=300, deadline=None)
@given(
    text=st.tuples(*[st.text(max_size=12)] * 4),
    zone=st.none() | st.text(max_size=12),
    deadline=st.datetimes(datetime(1000, 1, 1), datetime(9000, 1, 1), timezones=_zones),
    local=st.none() | st.datetimes(),
    occurrence=st.timedeltas(min_value=timedelta(days=-400), max_value=timedelta(days=400)),
    attempt=st.integers(min_value=1, max_value=2**31 - 1),
    operation_id=st.uuids(),
)
def test_a_webhook_document_is_what_json_dumps_makes_of_its_fields(
    text: tuple[str, str, str, str],
    zone: str | None,
    deadline: datetime,
    local: datetime | None,
    occurrence: timedelta,
    attempt: int,
    operation_id: uuid.UUID,
) -> None:
    """The webhook body is written with one f-string and json's C string encoder, not json.dumps
    of a dict (bench/README.md, "Per-delivery code"): byte for byte what json.dumps writes, for
    any text (quotes, backslashes, control and non-ASCII characters), offset and fraction of a
    second, a one-off or an occurrence of a series."""
    source, key, channel, recipient = text
    d = Delivery(
        operation_id=operation_id,
        source=source,
        business_key=key,
        deadline=deadline,
        occurrence=occurrence,
        due_at=deadline + occurrence,
        channel=channel,
        work_id=1,
        recipient=recipient,
        payload_json='{"n":1.50,"s":"\\u00e9"}',
        attempt=attempt,
        deadline_local=local,
        time_zone=zone if local is not None else None,
    )
    assert d.document_json() == _document_by_json_dumps(d)
    assert json.loads(d.document_json())["payload"] == {"n": 1.5, "s": "\u00e9"}


async def test_a_payload_is_decoded_as_json_loads_decodes_it(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """The delivery decodes its payload with json's scanner alone when that reads the whole
    text (Postgres's jsonb text), and with json.loads otherwise: the value, or the refusal, must
    be what json.loads gives, for texts as Postgres writes them and for texts it never writes."""
    docs = ['{"a": 1}', '{"b": [1, 2.50, {"c": null}], "a": "\\u00e9"}', "{}", '{"n": 1e400}']
    cur = await conn.execute("SELECT d::jsonb::text FROM unnest(%s::text[]) AS d", (docs,))
    stored = [t for (t,) in await cur.fetchall()]
    deep = '{"a": ' + "[" * 3000 + "]" * 3000 + "}"
    odd = [
        " {}",
        "{} ",
        "{}\n",
        "{}x",
        "{}{}",
        "",
        "[]",
        "1",
        "null",
        '"{}"',
        "{",
        deep,
        '{"a": NaN}',
    ]
    for text in stored + odd:
        try:
            want: Any = json.loads(text)
        except (ValueError, RecursionError) as e:
            want = PayloadError(f"payload cannot be decoded: {type(e).__name__}")
        if not isinstance(want, dict | PayloadError):
            want = PayloadError("payload is not a JSON object")
        try:
            got: Any = decode_payload(text)
        except PayloadError as e:
            got = e
        if isinstance(want, PayloadError):
            assert isinstance(got, PayloadError) and str(got) == str(want), text[:40]
        else:
            assert got == want and type(got) is dict, text[:40]
    d = Delivery.from_claim(
        store.Claimed._make([None] * len(store.Claimed._fields))._replace(
            recipient="r", payload=stored[0]
        )
    )
    assert d.payload == {"a": 1} and vars(d)["payload"] is d.payload  # decoded once, then kept


async def test_an_outcome_record_is_the_json_object_its_fields_make(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """The outcome writer writes each record's JSON with an f-string: it must be the object
    json.dumps makes of the fields (absent ones left out, times as seconds ago, never below 0),
    and Postgres must read a batch of them back as record_outcomes does."""
    now = time.monotonic()
    base: dict[str, Any] = {"lease": 2, "attempt": 1, "retry_after": None}
    records = [
        Record(
            work_id=7,
            channel="noop",
            outcome="delivered",
            status="delivered",
            started=now - 0.25,
            finished=now - 1e-7,
            **base,
        ),
        Record(
            work_id=2**40,
            channel='we"ird\\\u00e9\n',
            outcome="retry",
            status="ready",
            started=now + 1.0,
            finished=now,
            http_status=503,
            error_class="HTTPError",
            error='x\n"y\u2028\x01',
            receipt={"a": [1, 2.5, None]},
            throttle=2.5,
            pause="gone",
            **{**base, "retry_after": 1e-7},
        ),
        Record(
            work_id=9,
            channel="noop",
            outcome="failed",
            status="dead",
            started=now - 3,
            finished=now - 2,
            error="no",
            **base,
        ),
    ]
    names = ["retry_after", "http_status", "error_class", "error", "receipt", "throttle", "pause"]
    for r in records:
        want = {
            "work_id": r.work_id,
            "lease": r.lease,
            "attempt": r.attempt,
            "channel": r.channel,
            "outcome": r.outcome,
            "status": r.status,
            "started_ago": max(0.0, now - r.started),
            "finished_ago": max(0.0, now - r.finished),
            **{k: getattr(r, k) for k in names if getattr(r, k) is not None},
        }
        assert json.loads(r.json_text(now)) == want
    batch = "[" + ",".join(r.json_text(now) for r in records) + "]"
    cur = await conn.execute(
        "SELECT work_id, channel, error, receipt, started_ago, retry_after FROM jsonb_to_recordset(%s::jsonb)"
        " AS o(work_id bigint, channel text, error text, receipt jsonb, started_ago float8,"
        " retry_after float8)",
        (batch,),
    )
    assert await cur.fetchall() == [
        (r.work_id, r.channel, r.error, r.receipt, max(0.0, now - r.started), r.retry_after)
        for r in records
    ]


async def test_a_receipt_shared_by_many_records_is_stored_as_cleaning_makes_it(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """The webhook channel shares one outcome between deliveries that got the same answer, and
    the writer cleans each shared receipt once (``Cleaner``): every record must still carry the
    receipt cleaned and masked as ``clean_receipt`` makes it, its JSON text must be that
    receipt's, and Postgres must read it so. A plain dict (a python channel's, which may change
    it after returning it) is cleaned anew every time."""
    secret = "tok-3f9a2b"
    cleaner = Cleaner(Secrets([secret]))
    answer = Receipt(
        http_status=200, body={"echo": f"Bearer {secret}", "x": math.nan, "s": "a\x00b\udc80"}
    )
    want = {"http_status": 200, "body": {"echo": "Bearer ***", "x": None, "s": "ab?"}}
    assert clean_receipt(Secrets([secret]).scrub_json(answer)) == want
    now = time.monotonic()

    def delivered(work_id: int, receipt: Any) -> Record:
        made = Record(
            work_id=work_id,
            lease=2,
            attempt=3,
            channel="hook",
            outcome="delivered",
            status="delivered",
            retry_after=None,
            started=now - 0.5,
            finished=now - 0.25,
            http_status=200,
            receipt=receipt,
        )
        got = made.cleaned(cleaner)
        # Every other field as it was made (the cleaned record is built field by field).
        assert dataclasses.replace(got, receipt=receipt, receipt_json=None) == made
        return got

    records = [delivered(i, answer) for i in (1, 2, 3)]
    mutable: dict[str, Any] = {"n": 1}
    records.append(delivered(4, mutable))
    mutable["n"] = 2
    records.append(delivered(5, mutable))
    for r in records[:3]:
        assert r.receipt == want and json.loads(r.receipt_json or "") == want
        assert json.loads(r.json_text(now))["receipt"] == want
    assert [json.loads(r.json_text(now))["receipt"] for r in records[3:]] == [{"n": 1}, {"n": 2}]
    batch = "[" + ",".join(r.json_text(now) for r in records) + "]"
    cur = await conn.execute(
        "SELECT work_id, http_status, receipt FROM jsonb_to_recordset(%s::jsonb)"
        " AS o(work_id bigint, http_status int, receipt jsonb)",
        (batch,),
    )
    assert await cur.fetchall() == [
        (1, 200, want),
        (2, 200, want),
        (3, 200, want),
        (4, 200, {"n": 1}),
        (5, 200, {"n": 2}),
    ]


def test_long_statements_are_sent_as_psycopg_would_send_them() -> None:
    """The statements psycopg would convert on every call (longer than its cache allows) are
    converted once at import: the text and the order of the parameters must be psycopg's own
    (read through its private converter, as nothing public exposes it)."""
    from psycopg._queries import PostgresQuery
    from psycopg.adapt import Transformer

    assert set(P) == {n for n, sql in Q.items() if len(sql) > 4096} >= {"record_outcomes"}
    for name, pos in P.items():
        pq = PostgresQuery(Transformer())
        pq.convert(Q[name], {n: None for n in pos.names})
        assert (pq.query, pq._order) == (pos.sql.encode(), list(pos.names)), name
    assert positional("a %(x)s, %(y)s %% %(x)s") == ("a $1, $2 % $1", ("x", "y"))
    with pytest.raises(ValueError, match="lone %"):
        positional("LIKE 'a%' AND %(x)s")


async def test_claimed_rows_are_read_by_column_name_checked_once(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """Claimed rows are built positionally; a statement whose columns are not the fields, in
    order, fails naming both instead of filling the wrong fields."""
    cur = conn.cursor(row_factory=_tuple_rows(store.Claimed))
    with pytest.raises(TypeError, match=r"Claimed: the statement returns \('reminder_id', 'id'\)"):
        await cur.execute("SELECT 1 AS reminder_id, 2 AS id")


async def test_held_and_active_gauges_read_the_channel_when_scraped(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """pgwork_rows_held and pgwork_deliveries_active are read from the channel at scrape time
    (not set per delivery): they show a delivery in flight, and zero once it has settled."""
    release = anyio.Event()
    started = anyio.Event()

    async def slow(d: Delivery) -> None:
        started.set()
        await release.wait()

    sink.BEHAVIOUR["slow"] = slow
    try:
        async with running(config(), dsn) as daemon:
            reg = daemon.metrics.registry

            def gauge(name: str) -> float | None:
                return reg.get_sample_value(name, {"channel": "test"})

            await add(conn, "slow")
            with anyio.fail_after(30):
                await started.wait()
            assert gauge("pgwork_deliveries_active") == 1
            assert gauge("pgwork_rows_held") == 1
            release.set()

            async def settled() -> bool:
                return gauge("pgwork_rows_held") == 0 and gauge("pgwork_deliveries_active") == 0

            await until(settled, what="the delivery settled")
            assert (
                reg.get_sample_value(
                    "pgwork_attempts_total", {"channel": "test", "outcome": "delivered"}
                )
                == 1
            )
    finally:
        sink.reset()


async def test_a_page_that_handed_over_all_it_made_does_not_wake_the_claim_loops(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The one-hop page hands the rows it made to the workers. When it claimed every row it
    made, the local claim loops have nothing to look for: waking them cost a claim and a gate
    read per reminder on an idle daemon. A page that made a row it did not claim (due later)
    still wakes them, so that they set its timer."""

    def claim_wakeups(d: Any) -> float:
        """The claim loop's wake-ups by the materialiser (not its own timers)."""
        got = d.metrics.registry.get_sample_value(
            "pgwork_wakeups_total", {"duty": "claim:test", "cause": "local"}
        )
        return float(got or 0.0)

    async with running(config(lookahead=7200.0), dsn) as d:
        await anyio.sleep(0.5)  # the start's own wake-ups are over
        before = claim_wakeups(d)
        for i in range(6):
            await add(conn, f"now{i}")
            await until(partial(_delivered, conn, i + 1), what=f"reminder {i} delivered")
        # Each was handed over by its page, unless the page ran while the claim loop was in a
        # claim of its own (the page then leaves the row ready and wakes it): seen about once in
        # three runs of three reminders. A wake-up per reminder is what this guards against.
        after = claim_wakeups(d)
        assert after - before <= 2
        await add(conn, "later", "now() + interval '1 hour'")
        await until(lambda: _made(conn, 7), what="the later reminder made")
        await until(lambda: _woken(d, claim_wakeups, after), what="the claim loop woken")


async def _delivered(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    return len([w for w in await work(conn) if w["status"] == "delivered"]) == n


async def _made(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    return len(await work(conn)) == n


async def _woken(d: Any, wakeups: Any, before: float) -> bool:
    return bool(wakeups(d) > before)


async def test_warming_a_new_pool_plans_the_page_on_every_connection_and_changes_nothing(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """PL/pgSQL compiles the page function and plans its statements once per session (~10 ms);
    without warming, the first reminder paged on each of a new pool's connections paid for it,
    a latency outlier per connection. Warming runs a page of no reminders on every connection:
    a reminder already due is not materialised by it."""
    await add(conn, "due", "now() - interval '1 minute'")
    pool = db.make_pool(dsn, 3, 5)
    await pool.open(wait=True)
    try:
        assert await materialiser.warm_pages(pool, 3) == 3
        # Each of the pool's three sessions ran the page last.
        (seen,) = await rows(
            conn,
            "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND query LIKE '%pgwork.materialise_page(%'",
        )
        assert seen["n"] == 3
    finally:
        await pool.close()
    assert await work(conn) == []
    (r,) = await rows(conn, "SELECT next_fire_at FROM pgwork.reminder")
    assert r["next_fire_at"] is None


def test_an_outcome_records_fields_are_the_keys_its_json_sends() -> None:
    """An outcome record is declared once, as pgwork.outcome (what record_outcomes reads; a
    daemon checks at start that the keys json_text writes are its fields:
    tests/test_schema.py::test_the_outcome_record_is_declared_once_and_checked_at_start). Record's
    fields are those keys, times kept as monotonic instants and sent as seconds ago, and the
    receipt's cleaned text sent as the receipt."""
    import dataclasses

    from pgwork.duties.outcomes import sent_keys

    kept = {f.name for f in dataclasses.fields(Record)} - {"started", "finished", "receipt_json"}
    assert kept | {"started_ago", "finished_ago"} == sent_keys()


async def test_the_daemons_pool_plans_each_statement_once_per_connection(dsn: str) -> None:
    """A statement run by a session is planned anew on each of its first executions (psycopg
    prepares it at the sixth, PostgreSQL then makes five custom plans before it weighs a generic
    one): the claim's plan is ~3 ms of Postgres CPU, so every new connection of a daemon paid
    ~30 ms for it, and as much again for the outcome flush. The daemon's pool prepares at the
    first execution and uses the generic plan at once (bench/plans.py: the hot statements'
    generic plans read what their custom plans read)."""
    pool = db.make_pool(dsn, 1, 5, plan_once=True)
    await pool.open(wait=True)
    try:
        async with pool.connection() as c:
            for _ in range(3):
                assert await store.claim_work(c, request()) == []
            plans = await rows(
                c,
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                "WHERE statement LIKE '%%pgwork.claim_lanes(%%' AND statement NOT LIKE '%%pg_prepared%%'",
            )
            # Its one generic plan, made once, served all three.
            assert plans == [{"generic_plans": 3, "custom_plans": 0}]
            (one,) = await rows(c, "SELECT current_setting('plan_cache_mode') AS mode")
            assert one["mode"] == "force_generic_plan"
    finally:
        await pool.close()
    # Other pools (the web page's, whose DLQ listing needs the custom plan) plan as PostgreSQL
    # chooses.
    pool = db.make_pool(dsn, 1, 5)
    await pool.open(wait=True)
    try:
        async with pool.connection() as c:
            (one,) = await rows(c, "SELECT current_setting('plan_cache_mode') AS mode")
            assert one["mode"] == "auto"
    finally:
        await pool.close()


#: Six reminders of each of two sources whose occurrences are due: one-offs, and series (daily,
#: the send a day and a minute before tomorrow's deadline).
DUE_NOW = {
    "one-off": "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
    "SELECT s, 'k' || g, now() - interval '1 minute', 'test', 'r' "
    "FROM generate_series(1, 6) g, unnest(ARRAY['a', 'b']) s",
    "series": "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, "
    "remind_before, channel, recipient) "
    "SELECT s, 'k' || g, (now() AT TIME ZONE 'UTC') + interval '1 day', 'UTC', 'FREQ=DAILY', "
    "'{1 day 00:01}', 'test', 'r' FROM generate_series(1, 6) g, unnest(ARRAY['a', 'b']) s",
}


@pytest.mark.parametrize("kind", DUE_NOW)
async def test_a_claim_runs_no_sql_function_body_of_its_own(
    dsn: str, conn: psycopg.AsyncConnection[Any], kind: str
) -> None:
    """The claim is its two steps (pgwork/sql/code/claim.sql) and nothing else. A SQL function
    PostgreSQL cannot inline (its body holds a subquery) is a plan of its own, made again on
    every execution of the statement that calls it on PostgreSQL 15 (18 caches it): the claim
    turned its lanes through pgwork.next_ready, and a claim of ten rows cost 1.2 ms of Postgres
    instead of 0.9. pgwork.as_claimed must stay inlined too: made PL/pgSQL or given a SET
    clause, it would be called once per field, 21 times a claimed row. Trigger functions
    (wake_lanes, on the rows' update) aside. The same for a series' occurrences: asking whether
    one is still wanted (pgwork.series_unwanted) was a SQL function with a subquery, run as a
    plan of its own for every row claimed: half of a rent-day claim's Postgres time."""
    await conn.execute(DUE_NOW[kind])
    async with await db.connect(dsn) as daemon:
        await materialiser.run_once(daemon, lookahead=0, page_size=100)
        await daemon.execute("BEGIN")
        try:
            await daemon.execute("SET LOCAL track_functions = 'all'")
            got = await store.claim_work(daemon, request(limit=4))
            called = await rows(
                daemon,
                "SELECT f.funcname, f.calls FROM pg_stat_xact_user_functions f "
                "JOIN pg_proc p ON p.oid = f.funcid "
                "WHERE f.schemaname = 'pgwork' AND p.prorettype <> 'trigger'::regtype "
                "ORDER BY 1",
            )
        finally:
            await daemon.execute("ROLLBACK")
    # Both lanes served and turned (rows are left in each), nothing else called.
    assert sorted(r.source for r in got) == ["a", "a", "b", "b"]
    assert called == [
        {"funcname": "claim_lanes", "calls": 1},
        {"funcname": "claim_rows", "calls": 1},
    ]


async def test_a_statement_that_makes_no_row_ready_leaves_the_lanes_alone(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """pgwork.wake_lanes runs after every statement that inserts or updates work rows, and most
    make none ready: every claim, every delivered outcome, the page that claims what it makes
    for idle workers. Those leave it before the lanes' upsert: its plan, started and ended for
    no row, was ~40 µs of Postgres of every claim and every outcome flush (bench/README.md,
    issue 41). A retry makes its row ready, and wakes its lane. Seen with auto_explain, which
    reports every statement run, those inside functions and triggers too."""
    await conn.execute(DUE_NOW["one-off"])
    async with await db.connect(dsn) as daemon:
        await materialiser.run_once(daemon, lookahead=0, page_size=100)
        reported: list[str] = []
        daemon.add_notice_handler(lambda d: reported.append(d.message_primary or ""))
        for setting in (
            "LOAD 'auto_explain'",
            "SET auto_explain.log_min_duration = 0",
            "SET auto_explain.log_nested_statements = on",
            "SET auto_explain.log_level = notice",
        ):
            await daemon.execute(setting)

        def upserts() -> int:
            n = sum("INSERT INTO pgwork.lane" in r for r in reported)
            reported.clear()
            return n

        first, second = await store.claim_work(daemon, request(limit=2))
        assert upserts() == 0
        outcome = {"channel": "test", "retry_after": 0}
        delivered = {"outcome": "delivered", "status": "delivered"}
        for row, said in ((first, delivered), (second, {"outcome": "retry", "status": "ready"})):
            record = {**outcome, **said, "work_id": row.id, "lease": row.lease, "attempt": 1}
            await store.record_outcomes(
                daemon, outcomes=json.dumps([record]), daemon_id="d", host="h", pid=1
            )
            assert upserts() == (said["status"] == "ready")


async def test_the_pages_planner_settings_are_its_own(conn: psycopg.AsyncConnection[Any]) -> None:
    """The page read by key because it set the planner's settings for the whole transaction
    (set_config, local): whatever a session ran after it in that transaction was planned without
    sequential scans and with generic plans too. The settings are the function's own now, as the
    claim's are: in force inside it, in any session, and gone after it returns; only
    synchronous_commit, which must hold at the commit, stays the transaction's."""
    async with conn.transaction():
        await conn.execute(
            "SELECT * FROM pgwork.materialise_page(false, NULL, '0', NULL, 0, 10, 'test', "
            "'[]'::jsonb, '1 minute', 'test', '{}', NULL)"
        )
        cur = await conn.execute(
            "SELECT current_setting('enable_seqscan') AS seqscan, "
            "current_setting('plan_cache_mode') AS plans, "
            "current_setting('synchronous_commit') AS sync"
        )
        assert await cur.fetchone() == ("on", "auto", "off")
