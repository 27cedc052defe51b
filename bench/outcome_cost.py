"""What one outcome flush costs Postgres: ``python -m bench.outcome_cost``.

On a scratch embedded server (or ``--pgbin``): rows of one no-op channel claimed ``--batch`` at
a time under long leases, a CHECKPOINT (so the flushes, like a drain's, make the first write to
each record's page after one), then ``record_outcomes`` over each claimed batch, every record
delivered, from one connection of the daemon's pool (its settings: one plan per statement), the
flush committed as the daemon's is (synchronously). Per flush: the CPU its server backend spent
(read from ``/proc``, so planning, executor start and end, the functions it calls and the commit
count, which ``pg_stat_statements`` does not all count), and that divided by the batch.

With ``--parts``: the statement as it ships alternated with copies of it made for this run only,
each without one part: ``lease_end_inline`` (the lease rows deleted by the statement itself, not
through ``pgwork.lease_end``, which reads them by key whatever the statistics), ``lease_kept``
(the lease rows read, not deleted: what ending them costs), ``no_ledger`` (no attempt row),
``no_channel_news`` (no throttle, breaker or pause bookkeeping). None of the copies is a flush
pgwork could ship; the differences say what each part costs.

To compare two trees, copy this file and ``bench/cpu.py`` into the other tree's ``bench/`` and
run it in each, alternately, the same hour: the statement is read from the tree it runs in.

  python -m bench.outcome_cost [--batch 10 100] [--flushes 400] [--rounds 3] [--pgbin DIR]
  python -m bench.outcome_cost --batch 100 --parts"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio

from pgwork import db, store
from pgwork.embedded import LocalServer

from . import workloads as w
from .cpu import process_cpu_s

WARMUP = 3  # flushes run first, so that the statement is planned and its plan kept


def record_outcomes_sql() -> str:
    """record_outcomes as this tree names it (pgwork/sql/queries/, or an older tree's
    pgwork/sql/queries.sql)."""
    root = Path(__file__).resolve().parent.parent / "pgwork" / "sql"
    for path in (root / "queries" / "delivery.sql", root / "queries.sql"):
        if path.exists() and "-- name: record_outcomes" in (text := path.read_text()):
            start = text.index("-- name: record_outcomes")
            return text[start : text.index("-- name:", start + 1)]
    raise SystemExit("no record_outcomes statement in this tree")


def _without(sql: str, first: str, upto: str, instead: str = "") -> str:
    """``sql`` with the text from ``first`` up to ``upto`` replaced by ``instead``."""
    a, b = sql.index(first), sql.index(upto)
    return sql[:a] + instead + sql[b:]


_LEASE_END_INLINE = """), held AS (
    DELETE FROM pgwork.work_lease l
     USING (SELECT unnest(array_agg(o.work_id)) AS work_id, unnest(array_agg(o.lease)) AS lease
              FROM o) AS h
     WHERE l.work_id = h.work_id AND l.lease = h.lease
       AND l.work_id = ANY ((SELECT array_agg(o.work_id) FROM o)::bigint[])
    RETURNING l.work_id, l.lease, l.attempts, l.claimed_at, l.claimed_by
"""


_LEASE_KEPT = """), held AS (
    SELECT l.work_id, l.lease, l.attempts, l.claimed_at, l.claimed_by
      FROM pgwork.work_lease l
      JOIN (SELECT unnest(array_agg(o.work_id)) AS work_id, unnest(array_agg(o.lease)) AS lease
              FROM o) AS h
        ON l.work_id = h.work_id AND l.lease = h.lease
     WHERE l.work_id = ANY ((SELECT array_agg(o.work_id) FROM o)::bigint[])
"""


def variants() -> dict[str, str]:
    """The statement as it ships and the copies ``--parts`` measures."""
    sql = record_outcomes_sql()
    return {
        "as_shipped": sql,
        "lease_end_inline": _without(sql, "), held AS (", "), done AS (", _LEASE_END_INLINE),
        "lease_kept": _without(sql, "), held AS (", "), done AS (", _LEASE_KEPT),
        "no_ledger": _without(sql, "), ledger AS (", "\nSELECT j.work_id AS fenced_id", ")"),
        "no_channel_news": _without(sql, "), news AS (", "), judged AS ("),
    }


def _records(rows: list[store.Claimed]) -> str:
    return (
        "["
        + ",".join(
            f'{{"work_id":{r.id},"lease":{r.lease},"attempt":{r.attempts},"channel":"noop",'
            '"outcome":"delivered","status":"delivered","started_ago":0.001,"finished_ago":0.0005}'
            for r in rows
        )
        + "]"
    )


async def measure(dsn: str, sql: str, batch: int, flushes: int) -> float:
    """µs of Postgres per flush of ``batch`` delivered records, on a schema made again."""
    async with await db.connect(dsn) as c:
        await c.execute("DROP SCHEMA IF EXISTS pgwork CASCADE")
        await w.migrate_with_noop(c)
    await w.seed_work(dsn, batch * (flushes + WARMUP))
    pool = db.make_pool(dsn, 1, 5, plan_once=True)
    await pool.open(wait=True)
    try:
        async with pool.connection() as conn:
            req = store.ClaimRequest("noop", batch, 5, timedelta(hours=1), "bench")
            claimed = [await store.claim_work(conn, req) for _ in range(flushes + WARMUP)]
            assert all(len(rows) == batch for rows in claimed)
            await conn.execute("CHECKPOINT")
            params: dict[str, Any] = {"daemon_id": "bench", "host": "bench", "pid": 1}
            pid = conn.info.backend_pid
            b0 = 0.0
            for i, rows in enumerate(claimed):
                if i == WARMUP:
                    b0 = process_cpu_s(pid)
                cur = await conn.execute(sql, {**params, "outcomes": _records(rows)}, prepare=True)
                assert not await cur.fetchall(), "a record was not applied"
            pg = process_cpu_s(pid) - b0
            cur = await conn.execute(
                "SELECT count(*) FROM pgwork.renewal_work WHERE status = 'delivered'"
            )
            assert await cur.fetchone() == (batch * (flushes + WARMUP),)
    finally:
        await pool.close()
    return pg / flushes * 1e6


async def run(dsn: str, batches: list[int], flushes: int, rounds: int, parts: bool) -> Any:
    """Medians over ``rounds``, the statements alternated within each round."""
    chosen = variants() if parts else {"as_shipped": record_outcomes_sql()}
    seen: dict[str, dict[int, list[float]]] = {}
    for _ in range(rounds):
        for batch in batches:
            for name, sql in chosen.items():
                us = await measure(dsn, sql, batch, flushes)
                seen.setdefault(name, {}).setdefault(batch, []).append(us)
    return {
        name: {
            str(batch): {
                "pg_us_per_flush": round(statistics.median(v), 1),
                "pg_us_per_record": round(statistics.median(v) / batch, 2),
                "runs": [round(x, 1) for x in v],
            }
            for batch, v in by.items()
        }
        for name, by in seen.items()
    }


async def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.outcome_cost", description=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--flushes", type=int, default=400, help="flushes timed per measure")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pgbin", type=Path, help="server binaries (default: the embedded ones)")
    ap.add_argument("--parts", action="store_true", help="the flush against its copies")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pgwork-outcome-cost-") as tmp:
        srv = LocalServer(Path(tmp) / "data", a.pgbin)
        srv.start()
        try:
            out = await run(srv.dsn(), a.batch, a.flushes, a.rounds, a.parts)
        finally:
            srv.stop()
    print(json.dumps({"pgbin": str(a.pgbin or "embedded"), "flushes": out}), flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:], backend="asyncio", backend_options={"use_uvloop": True})
