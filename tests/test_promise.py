"""The exactly-once promise where time and size grow: retention between occurrences, reschedules
after retention, outcomes that cannot be stored, stale leases, lost commit replies."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import psycopg
import pytest

from pgwork import db, store
from pgwork.config import RetentionPolicy
from pgwork.duties.outcomes import OutcomeWriter, Record
from pgwork.duties.retention import Retention
from pgwork.metrics import Metrics
from pgwork.store import ClaimKey, Identity

from .helpers import (
    add,
    claim,
    config,
    delivered,
    materialise,
    rows,
    running,
    statement,
    until,
    webhook_channel,
    work,
)
from .receiver import Receiver

pytestmark = pytest.mark.anyio


def _outcome(work_id: int, lease: int, status: str, outcome: str | None = None) -> dict[str, Any]:
    return {
        "work_id": work_id,
        "lease": lease,
        "attempt": lease,
        "outcome": outcome or status,
        "status": status,
        "retry_after": 0.5 if status == "ready" else None,
        "started_ago": 0.2,
        "finished_ago": 0.1,
    }


async def _record(dsn: str, outcomes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async with await db.connect(dsn) as c:
        return await statement(
            c,
            "record_outcomes",
            {"outcomes": json.dumps(outcomes), "daemon_id": "d", "host": "h", "pid": 1},
        )


async def _deliver_all(dsn: str) -> None:
    """Claim every claimable row and record it delivered (a worker that always succeeds)."""
    claimed = await claim(dsn)
    await _record(dsn, [_outcome(r["id"], r["lease"], "delivered") for r in claimed])


async def _retire_everything(dsn: str) -> int:
    r = Retention(RetentionPolicy(keep=0, dead_keep=0, pause=0))
    async with await db.connect(dsn) as c:
        return (await r.run_once(c)).deleted


# -- second sends ------------------------------------------------------------------------------


@pytest.mark.slow
async def test_retention_between_occurrences_never_resends(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 8, items 1 and 16: three occurrences a second apart, retention at zero keep between
    each, then a full rescan and a deadline moved away and back. The receiver sees one request per
    occurrence."""
    with Receiver() as receiver:
        cfg = config(
            webhook_channel(receiver.url),
            tick=0.1,
            retention_interval=0.1,
            retention=RetentionPolicy(keep=0, dead_keep=0, pause=0),
        )
        async with running(cfg, dsn):
            await add(
                conn,
                "lease:42",
                "date_trunc('second', now()) + interval '3 seconds'",
                channel="hook",
                before="{2 seconds, 1 second, 0}",
            )
            await anyio.to_thread.run_sync(receiver.wait_for, 3)
            # Every delivered row is retired as soon as retention sees it.
            await until(lambda: _no_work(conn), what="retention to delete every work row")
            # A full rescan: the app rewrites the schedule (same entries), which resets progress.
            await conn.execute(
                "UPDATE pgwork.reminder SET remind_before = '{0, 1 second, 2 seconds}'"
            )
            # And moves the deadline away and back.
            await conn.execute("UPDATE pgwork.reminder SET due_at = due_at + interval '1 day'")
            await conn.execute("UPDATE pgwork.reminder SET due_at = due_at - interval '1 day'")
            await anyio.sleep(1.5)  # many materialiser and retention passes
    assert sorted(receiver.keys().values()) == [1, 1, 1]
    status = await rows(
        conn, "SELECT status, retired FROM pgwork.reminder_status ORDER BY remind_before"
    )
    assert [(s["status"], s["retired"]) for s in status] == [("delivered", True)] * 3


async def _no_work(conn: psycopg.AsyncConnection[Any]) -> bool:
    return not await work(conn)


async def test_reschedule_after_retention_does_not_recreate_a_sent_occurrence(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 8, items 14 and 16."""
    rid = await add(conn, "k", "now() - interval '1 minute'")
    await materialise(dsn)
    await _deliver_all(dsn)
    assert await _retire_everything(dsn) == 1
    (st,) = await rows(conn, "SELECT status, retired, operation_id FROM pgwork.reminder_status")
    assert (st["status"], st["retired"]) == ("delivered", True)  # never "scheduled" again

    # A new entry for the same deadline: only the new occurrence is made.
    await conn.execute(
        "UPDATE pgwork.reminder SET remind_before = '{0, 1 second}' WHERE id = %s", (rid,)
    )
    await materialise(dsn)
    assert [w["occurrence"] for w in await work(conn)] == [timedelta(seconds=1)]
    await _deliver_all(dsn)

    # The deadline moves away and comes back: nothing already sent for it is made again.
    await conn.execute("UPDATE pgwork.reminder SET due_at = due_at + interval '2 days'")
    await materialise(dsn)
    await conn.execute("UPDATE pgwork.reminder SET due_at = due_at - interval '2 days'")
    await materialise(dsn)
    assert await claim(dsn) == []
    made = [(w["occurrence"], w["status"]) for w in await work(conn)]
    assert made == [(timedelta(seconds=1), "delivered")]


async def test_deleting_a_reminder_removes_its_tombstones(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await add(conn, "k", "now() - interval '1 minute'")
    await materialise(dsn)
    await _deliver_all(dsn)
    await _retire_everything(dsn)
    assert len(await rows(conn, "SELECT * FROM pgwork.retired")) == 1
    await conn.execute("DELETE FROM pgwork.reminder")
    assert await rows(conn, "SELECT * FROM pgwork.retired") == []


# -- outcomes ----------------------------------------------------------------------------------


async def _writer_run(dsn: str, records: list[Record]) -> set[tuple[int, int]]:
    """Submit ``records`` to a real outcome writer; returns the fenced (work id, lease)."""
    fenced: set[tuple[int, int]] = set()
    written: list[Record] = []

    def on_written(rs: list[Record], f: set[ClaimKey]) -> None:
        written.extend(rs)
        fenced.update(f)

    pool = db.make_pool(dsn, 2, 5.0)
    await pool.open(wait=True)
    try:
        writer = OutcomeWriter(pool, Metrics(), Identity("d", "h", 1))
        writer.subscribe("test", on_written)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(writer.run)
                for r in records:
                    writer.submit(r)
                await writer.drain()
                tg.cancel_scope.cancel()
    finally:
        await pool.close()
    assert len(written) == len(records)
    return fenced


def _rec(row: dict[str, Any], status: str, **kw: Any) -> Record:
    now = time.monotonic()
    outcome = {"delivered": "delivered", "ready": "retry", "dead": "failed"}[status]
    base: dict[str, Any] = {
        "work_id": row["id"],
        "lease": row["lease"],
        "attempt": row["attempts"],
        "channel": "test",
        "outcome": outcome,
        "status": status,
        "retry_after": 0.5 if status == "ready" else None,
        "started": now - 0.01,
        "finished": now,
    }
    return Record(**{**base, **kw})


async def test_unstorable_outcomes_are_cleaned_and_cannot_block_a_flush(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 8, item 2: NUL characters, receipts that are not JSON, NaN/inf/negative delays."""
    for i in range(6):
        await add(conn, f"k{i}")
    await materialise(dsn)
    claimed = sorted(await claim(dsn), key=lambda r: r["business_key"])

    class Opaque:
        def __str__(self) -> str:
            return "opaque\x00object"

    records = [
        _rec(claimed[0], "delivered", receipt={"body": "nul\x00here", "n": math.nan}),
        _rec(claimed[1], "ready", error="receiver said \x00\x00 oops" * 500),
        _rec(claimed[2], "delivered", receipt=Opaque(), error_class="Err\x00"),
        _rec(claimed[3], "ready", retry_after=math.nan),
        _rec(claimed[4], "ready", retry_after=-5.0),
        _rec(claimed[5], "ready", retry_after=math.inf),
    ]
    assert await _writer_run(dsn, records) == set()
    ws = {w["business_key"]: w for w in await work(conn)}
    statuses = [ws[f"k{i}"]["status"] for i in range(6)]
    assert statuses == ["delivered", "ready", "delivered", "ready", "ready", "ready"]
    ledger = await rows(
        conn,
        "SELECT a.* FROM pgwork.attempt a JOIN pgwork.renewal_work w ON w.id = a.work_id "
        "ORDER BY w.business_key",
    )
    assert ledger[0]["receipt"] == {"body": "nulhere", "n": None}
    assert "\x00" not in ledger[1]["error"] and len(ledger[1]["error"]) <= 2000
    assert ledger[2]["receipt"] == "opaqueobject" and ledger[2]["error_class"] == "Err"
    # Bad delays: retried now (NaN, negative), or after the longest delay stored (inf).
    assert ws["k5"]["available_at"] - ws["k3"]["available_at"] > timedelta(days=6)


async def test_a_small_batch_waits_for_the_flush_under_way_and_a_large_one_does_not(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 26: outcomes that arrive while a flush is under way go with the next flush once it
    ends — fewer, larger statements: Postgres's CPU per webhook delivery fell by a tenth — unless
    they are at least ``SECOND_FLUSH_AT``: a burst of outcomes (a no-op channel's batch) is
    written at once by a second flush. The first flush is held here by a row lock."""
    few = 10
    n = 1 + few + OutcomeWriter.SECOND_FLUSH_AT
    for i in range(n):
        await add(conn, f"k{i:03d}")
    await materialise(dsn)
    rows_ = sorted(await claim(dsn, limit=n), key=lambda r: r["business_key"])
    assert len(rows_) == n
    first, small, large = rows_[0], rows_[1 : 1 + few], rows_[1 + few :]
    durable: list[int] = []
    pool = db.make_pool(dsn, 3, 5.0)
    await pool.open(wait=True)
    try:
        writer = OutcomeWriter(pool, Metrics(), Identity("d", "h", 1))
        writer.subscribe("test", lambda rs, fenced: durable.extend(r.work_id for r in rs))
        async with await psycopg.AsyncConnection.connect(dsn) as blocker:
            await blocker.execute(
                "SELECT 1 FROM pgwork.renewal_work WHERE id = %s FOR UPDATE", (first["id"],)
            )
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(writer.run)
                    writer.submit(_rec(first, "delivered"))

                    async def first_waits() -> bool:
                        return bool(
                            await rows(
                                conn,
                                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                "AND datname = current_database()",
                            )
                        )

                    await until(first_waits, what="the first flush to wait on the lock")
                    for r in small:
                        writer.submit(_rec(r, "delivered"))
                    await anyio.sleep(0.5)
                    assert durable == []  # the small batch waits for the first flush
                    for r in large:
                        writer.submit(_rec(r, "delivered"))

                    async def second_written() -> bool:
                        return len(durable) >= few + len(large)

                    # Enough for a second flush: written while the first still waits.
                    await until(second_written, what="the second flush")
                    assert sorted(durable) == sorted(r["id"] for r in small + large)
                    await blocker.rollback()
                    await writer.drain()
                    tg.cancel_scope.cancel()
    finally:
        await pool.close()
    assert sorted(durable) == sorted(r["id"] for r in rows_)
    assert {w["status"] for w in await work(conn)} == {"delivered"}


async def test_outcomes_that_stream_in_are_gathered_and_a_lone_one_is_written_at_once(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 54: a flush's statement costs Postgres ~0.3 ms whatever it holds, so records that
    stream in (a flush just ended) wait up to ``GATHER_S`` to go ``GATHER`` at a time: at claim
    batch 10, 25 records a flush instead of 15 (bench/README.md). A record that finds the writer
    quiet is written at once. ``GATHER_S`` is long here, so that only those rules can write."""
    n = 7
    for i in range(n):
        await add(conn, f"k{i:03d}")
    await materialise(dsn)
    rows_ = sorted(await claim(dsn, limit=n), key=lambda r: r["business_key"])
    assert len(rows_) == n
    durable: list[int] = []
    metrics = Metrics()
    pool = db.make_pool(dsn, 2, 5.0)
    await pool.open(wait=True)
    try:
        writer = OutcomeWriter(pool, metrics, Identity("d", "h", 1))
        writer.GATHER, writer.GATHER_S = 4, 3600.0
        writer.subscribe("test", lambda rs, fenced: durable.extend(r.work_id for r in rs))

        def flushes() -> float:
            return float(metrics.outcome_flushes._value.get())

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(writer.run)
                writer.submit(_rec(rows_[0], "delivered"))  # the writer is quiet: at once

                async def first_written() -> bool:
                    return durable == [rows_[0]["id"]]

                await until(first_written, what="the lone outcome")
                assert flushes() == 1
                # A flush just ended: these are gathered, not written one flush each.
                for r in rows_[1:4]:
                    writer.submit(_rec(r, "delivered"))
                await anyio.sleep(0.5)
                assert (flushes(), len(durable)) == (1, 1)
                writer.submit(_rec(rows_[4], "delivered"))  # the fourth: they go together

                async def gathered() -> bool:
                    return len(durable) == 5

                await until(gathered, what="the gathered outcomes")
                assert flushes() == 2
                # And a batch short of GATHER goes once its first record waited GATHER_S.
                writer.GATHER_S = 0.3
                for r in rows_[5:]:
                    writer.submit(_rec(r, "delivered"))

                async def rest_written() -> bool:
                    return len(durable) == n

                await until(rest_written, what="the short batch, after GATHER_S")
                assert flushes() == 3
                await writer.drain()
                tg.cancel_scope.cancel()
    finally:
        await pool.close()
    assert sorted(durable) == sorted(r["id"] for r in rows_)
    assert {w["status"] for w in await work(conn)} == {"delivered"}


async def _flush_held_by_a_lock(
    dsn: str, conn: psycopg.AsyncConnection[Any], n: int
) -> tuple[list[dict[str, Any]], psycopg.AsyncConnection[Any]]:
    """``n`` claimed rows, and a connection holding the first one's row lock."""
    for i in range(n):
        await add(conn, f"k{i:03d}")
    await materialise(dsn)
    claimed = sorted(await claim(dsn, limit=n), key=lambda r: r["business_key"])
    assert len(claimed) == n
    blocker = await psycopg.AsyncConnection.connect(dsn)
    await blocker.execute(
        "SELECT 1 FROM pgwork.renewal_work WHERE id = %s FOR UPDATE", (claimed[0]["id"],)
    )
    return claimed, blocker


async def _waits_on_a_lock(conn: psycopg.AsyncConnection[Any]) -> bool:
    return bool(
        await rows(
            conn,
            "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()",
        )
    )


@asynccontextmanager
async def _writer_beside_a_lock(
    dsn: str,
    blocker: psycopg.AsyncConnection[Any],
    *,
    pool_size: int,
    timeout: float,
    submitted_first: Iterable[Record] = (),
    **settings: float,
) -> AsyncIterator[tuple[OutcomeWriter, list[int]]]:
    """An outcome writer running on a pool of its own (``settings`` set on it, ``submitted_first``
    submitted before it runs), and the ids its flushes made durable. On leaving: the lock's
    holder rolls back, the writer writes what it holds, and the holder and the pool close."""
    durable: list[int] = []
    pool = db.make_pool(dsn, pool_size, 5.0)
    await pool.open(wait=True)
    try:
        writer = OutcomeWriter(pool, Metrics(), Identity("d", "h", 1))
        for name, value in settings.items():
            setattr(writer, name, value)
        writer.subscribe("test", lambda rs, fenced: durable.extend(r.work_id for r in rs))
        for rec in submitted_first:
            writer.submit(rec)
        with anyio.fail_after(timeout):
            async with anyio.create_task_group() as tg:
                tg.start_soon(writer.run)
                yield writer, durable
                await blocker.rollback()
                await writer.drain()
                tg.cancel_scope.cancel()
    finally:
        await blocker.close()
        await pool.close()


async def test_outcomes_are_written_while_a_flush_waits_on_a_lock(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """One flush that waits on a lock (any session's: another app's transaction, an operator's
    psql) must not hold back the outcomes of other work: after ``STALLED_AFTER`` a flush under
    way no longer counts, and what arrived since is written by a flush of its own. Until then a
    small batch still waits for it (the batching above)."""
    few = 8
    rows_, blocker = await _flush_held_by_a_lock(dsn, conn, 1 + few)
    first, others = rows_[0], rows_[1:]
    async with _writer_beside_a_lock(dsn, blocker, pool_size=4, timeout=30) as (writer, durable):
        writer.submit(_rec(first, "ready"))
        await until(lambda: _waits_on_a_lock(conn), what="the first flush to wait")
        t0 = time.monotonic()
        for r in others:
            writer.submit(_rec(r, "delivered"))

        async def others_written() -> bool:
            return len(durable) == few

        await until(others_written, timeout=10, what="the other outcomes written")
        assert time.monotonic() - t0 < OutcomeWriter.STALLED_AFTER + 2.0
        assert sorted(durable) == sorted(r["id"] for r in others)
    assert sorted(durable) == sorted(r["id"] for r in rows_)


async def test_a_writer_whose_flushes_are_all_stalled_waits_without_spinning(
    dsn: str, conn: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every flush slot held by a stalled flush (a lock an app holds) and records gathered past
    their ``GATHER_S``: the writer's loop waits for a flush to end or for the stall watch, and
    does not turn (before, a batch whose time had come and could not go set a timer of zero
    seconds, again and again: a core spun while the database was stuck)."""
    rows_, blocker = await _flush_held_by_a_lock(dsn, conn, 3)
    passes = 0
    take = OutcomeWriter._take

    def counted(self: OutcomeWriter, now: float) -> Any:
        nonlocal passes
        passes += 1
        return take(self, now)

    monkeypatch.setattr(OutcomeWriter, "_take", counted)
    async with _writer_beside_a_lock(
        dsn, blocker, pool_size=2, timeout=30, MAX_FLUSHES=1, STALLED_AFTER=0.2
    ) as (writer, durable):
        writer.submit(_rec(rows_[0], "delivered"))
        await until(lambda: _waits_on_a_lock(conn), what="the flush to wait")
        for r in rows_[1:]:
            writer.submit(_rec(r, "delivered"))
        await anyio.sleep(1.0)  # stalled after 0.2 s; the others' GATHER_S long past
        assert durable == []
        # The stall watch looks four times per STALLED_AFTER: ~20 passes in a second.
        assert passes < 100, passes
    assert sorted(durable) == sorted(r["id"] for r in rows_)


@pytest.mark.slow
async def test_a_flush_that_times_out_on_a_lock_is_split_so_the_others_are_written(
    dsn: str, conn: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records written in one flush with one whose row another session holds locked: at the
    lock timeout the batch is written in halves, so the others are durable while the lock is
    still held; the held one is written once the lock goes."""
    rows_, blocker = await _flush_held_by_a_lock(dsn, conn, 6)
    monkeypatch.setitem(db.SESSION_SETTINGS, "lock_timeout", "1s")
    # One batch: submitted before the writer runs.
    batch = [_rec(r, "delivered") for r in rows_]
    async with _writer_beside_a_lock(
        dsn, blocker, pool_size=4, timeout=60, submitted_first=batch
    ) as (_, durable):

        async def others_written() -> bool:
            return len(durable) == len(rows_) - 1

        await until(others_written, timeout=30, what="the others written")
        assert rows_[0]["id"] not in durable
    assert sorted(durable) == sorted(r["id"] for r in rows_)


async def test_a_batch_the_database_refuses_is_split_so_one_record_cannot_hold_the_others(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 8, item 2: if a record still reaches the database unstorable, the batch is split and
    the bad record is stored without its details; the others are written as they are."""
    for i in range(5):
        await add(conn, f"k{i}")
    await materialise(dsn)
    claimed = sorted(await claim(dsn), key=lambda r: r["business_key"])
    pool = db.make_pool(dsn, 2, 5.0)
    await pool.open(wait=True)
    try:
        writer = OutcomeWriter(pool, Metrics(), Identity("d", "h", 1))
        # Written directly, past the cleaning that submit() does: a NUL in a jsonb receipt.
        bad = _rec(claimed[2], "delivered", receipt={"x": "\x00"})
        good = [_rec(r, "delivered", receipt={"ok": True}) for r in claimed if r is not claimed[2]]
        with anyio.fail_after(10):
            assert await writer._write_split([*good[:2], bad, *good[2:]]) == set()
    finally:
        await pool.close()
    assert {w["status"] for w in await work(conn)} == {"delivered"}
    receipts = {
        r["work_id"]: r["receipt"] for r in await rows(conn, "SELECT * FROM pgwork.attempt")
    }
    assert receipts[claimed[2]["id"]] is None
    assert all(receipts[r["id"]] == {"ok": True} for r in claimed if r is not claimed[2])


@pytest.mark.parametrize("stale_first", [True, False])
async def test_two_leases_of_one_row_in_one_batch(
    dsn: str, conn: psycopg.AsyncConnection[Any], stale_first: bool
) -> None:
    """Issue 8, item 3: lease 1's late 'failed' must not beat lease 2's 'retry', in either order."""
    await add(conn, "k")
    await materialise(dsn)
    (first,) = await claim(dsn, lease=0.1)
    await anyio.sleep(0.2)
    (second,) = await claim(dsn)
    assert (first["lease"], second["lease"]) == (1, 2)
    batch = [_rec(first, "dead"), _rec(second, "ready")]
    fenced = await _writer_run(dsn, batch if stale_first else batch[::-1])
    assert fenced == {(first["id"], 1)}
    (w,) = await work(conn)
    assert (w["status"], w["lease"]) == ("ready", 2)
    ledger = await rows(conn, "SELECT lease, outcome FROM pgwork.attempt ORDER BY lease")
    assert [(x["lease"], x["outcome"]) for x in ledger] == [(1, "fenced"), (2, "retry")]


async def test_a_retried_write_whose_commit_reply_was_lost_is_not_fenced(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 8, item 4: the same (work id, lease, outcome) written twice is recognised."""
    await add(conn, "k")
    await materialise(dsn)
    (row,) = await claim(dsn)
    rec = [_outcome(row["id"], row["lease"], "delivered")]
    assert await _record(dsn, rec) == []
    again = await _record(dsn, rec)  # the retry after a lost reply
    assert [(r["fenced_id"], r["already"]) for r in again] == [(row["id"], True)]
    # And through the writer: nothing reported as fenced.
    assert await _writer_run(dsn, [_rec(row, "delivered")]) == set()
    ledger = await rows(conn, "SELECT outcome FROM pgwork.attempt")
    assert [x["outcome"] for x in ledger] == ["delivered"]


async def test_stored_times_come_from_the_database_clock(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 8, item 12: the daemon sends ages, the statement stamps now()."""
    await add(conn, "k")
    await materialise(dsn)
    (row,) = await claim(dsn)
    await _record(
        dsn,
        [
            {
                **_outcome(row["id"], row["lease"], "delivered"),
                "started_ago": 31.0,
                "finished_ago": 30.0,
            }
        ],
    )
    (a,) = await rows(
        conn,
        "SELECT extract(epoch FROM now() - finished_at) AS age, "
        "extract(epoch FROM finished_at - started_at) AS took FROM pgwork.attempt",
    )
    assert 29 < float(a["age"]) < 40 and 0.99 < float(a["took"]) < 1.01
    (w,) = await rows(
        conn, "SELECT extract(epoch FROM now() - finished_at) AS age FROM pgwork.renewal_work"
    )
    assert float(w["age"]) < 10


async def test_a_receiver_answering_nul_characters_cannot_stall_the_channel(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 8, item 2, from the receiver's side: an error body with NUL characters is stored
    cleaned, and the row is retried and delivered."""
    from .receiver import Answer, Request

    def script(r: Request) -> Answer:
        if r.n == 1:
            return Answer(status=500, body=b'{"error": "bad \x00 byte"} \x00\x00')
        # A valid JSON receipt whose string holds an escaped NUL (jsonb refuses \u0000).
        return Answer(status=200, body=b'{"ok": "\\u0000", "receipt": "ok"}')

    with Receiver(script) as receiver:
        async with running(config(webhook_channel(receiver.url)), dsn):
            for i in range(5):
                await add(conn, f"k{i}", channel="hook")
            await until(lambda: delivered(conn, 5), what="all delivered after one retry")
    ledger = await rows(conn, "SELECT outcome, error FROM pgwork.attempt WHERE outcome = 'retry'")
    assert len(ledger) == 5 and all("\x00" not in (x["error"] or "") for x in ledger)
    assert any("bad" in (x["error"] or "") for x in ledger)
    receipts = await rows(conn, "SELECT receipt FROM pgwork.attempt WHERE outcome = 'delivered'")
    assert [r["receipt"]["body"] for r in receipts] == [{"ok": "", "receipt": "ok"}] * 5


async def _page(
    c: psycopg.AsyncConnection[Any], *, coordinate: bool = True
) -> tuple[store.Page | None, list[store.Claimed]]:
    """The first page of a pass, nothing claimed."""
    return await store.materialise_page(
        c,
        coordinate=coordinate,
        cutoff=None,
        lookahead=timedelta(0),
        after_at=None,
        after_id=0,
        limit=100,
    )


async def test_a_page_waiting_for_a_retention_batch_sees_its_tombstones(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The page's lock is taken in a statement of its own, before the page's snapshot: a page
    that waited for a retention batch (which holds the same lock) sees the tombstones it wrote.
    A page whose snapshot predated the batch's commit would miss the tombstone, find the work row
    gone, and make the occurrence again: a second send."""
    rid = await add(conn, "k", "now() - interval '1 minute'")
    await materialise(dsn)
    await _deliver_all(dsn)
    # The deadline moves away and back: progress is reset, the page looks at it again.
    await conn.execute("UPDATE pgwork.reminder SET due_at = due_at + interval '1 day'")
    await conn.execute("UPDATE pgwork.reminder SET due_at = due_at - interval '1 day'")
    (r,) = await rows(conn, "SELECT next_fire_at FROM pgwork.reminder WHERE id = %s", (rid,))
    assert r["next_fire_at"] is None
    pages: list[Any] = []
    async with (
        await db.connect(dsn) as batch,
        await db.connect(dsn) as daemon,
        anyio.create_task_group() as tg,
    ):
        async with batch.transaction():
            got = await store.retention_delete_batch(
                batch,
                done_before=datetime.now(UTC) + timedelta(days=1),
                dead_before=datetime.now(UTC) + timedelta(days=1),
                after_at=None,
                after_id=0,
                limit=100,
                statement_timeout="10s",
                lock_timeout="5s",
            )
            assert got.deleted == 1 and got.retired == 1

            async def page() -> None:
                # Shares the lock (coordinate=False): it waits for the batch, not skips.
                pages.append(await _page(daemon, coordinate=False))

            tg.start_soon(page)
            await anyio.sleep(0.5)
            assert pages == []  # waiting for the batch's lock
        # The batch commits here; the page goes on.
    ((result, claimed),) = pages
    assert result is not None and result.scanned == 1 and result.made == 0 and claimed == []
    assert await work(conn) == []
    (st,) = await rows(conn, "SELECT status, retired FROM pgwork.reminder_status")
    assert (st["status"], st["retired"]) == ("delivered", True)


async def test_a_page_refuses_any_isolation_but_read_committed(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Under repeatable read the page would share one snapshot with its lock, taken before the
    lock: after a retention batch it re-made a retired occurrence (the test above fails that way).
    The page refuses, naming the setting; the daemon's own sessions run read committed whatever
    the database's default says."""
    await add(conn, "k", "now() - interval '1 minute'")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as plain:
        await plain.execute("SET default_transaction_isolation = 'repeatable read'")
        with pytest.raises(psycopg.errors.RaiseException, match="read committed, not repeatable"):
            await _page(plain)
    dbname = conn.info.dbname
    await conn.execute(
        f"ALTER DATABASE \"{dbname}\" SET default_transaction_isolation = 'serializable'"
    )
    async with await db.connect(dsn) as daemon:
        (one,) = await rows(daemon, "SELECT current_setting('transaction_isolation') AS level")
        assert one["level"] == "read committed"
        result, _ = await _page(daemon)
        assert result is not None and result.made == 1


def test_a_receipt_of_any_depth_is_cleaned_without_raising() -> None:
    """Issue 25, item 5: a receipt nested past Python's recursion limit (from a Python channel,
    or a parser that gave one back) is bounded, never an exception that turns a delivery into a
    retry."""
    from pgwork.duties.outcomes import MAX_RECEIPT, clean_receipt

    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    got = clean_receipt({"body": deep})
    assert len(json.dumps(got)) <= MAX_RECEIPT
