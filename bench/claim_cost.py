"""What one claim costs each party (issue 41): ``python -m bench.claim_cost``.

On a scratch embedded server (or ``--pgbin``), rows of one no-op channel ready to claim, and the
daemon's own connection (its pool: one plan per statement) running ``store.claim_work`` for
batches of ``--batch`` rows, again and again. Per claim: the CPU its server backend spent (read
from ``/proc``: parse, plan, executor start and end, triggers and commit, which
``pg_stat_statements`` does not all count) and the CPU this process spent (psycopg, the rows).
Every claim is the daemon's claim as it ships; the leases are long, so no row is claimed twice.

With ``--drain ROWS``: one drain instead, ``ROWS`` rows of one source claimed ``--batch`` at a
time (the first size given) with no vacuum meanwhile (autovacuum off for the work and lane
tables, as in a drain shorter than autovacuum's round), and the Postgres CPU per claim of each
tenth of it: a claim that reads past the entries of the rows taken before it costs more as the
drain goes on.

With ``--parts``: what the claim's fixed cost is made of. The same measure, alternated on one
server, for the claim as it ships and two copies of ``pgwork.claim_rows`` made for this run only:
``without_rare_writes`` (the statement without the writes a claim of ready rows never makes:
a reclaimed lease's renewal, release and ledger row, a closed record, the rate limit's tokens)
and ``floor`` (the same two steps with the least a claim must do: take a lane's first ready rows
with SKIP LOCKED, remove them from ``work_ready``, insert their leases, return them; no gate, no
reclaim, no turn, no verdict). Neither copy is a claim pgwork could ship; the differences say
what the rest costs.

Prints one JSON line. To compare two trees, copy this file and ``bench/cpu.py`` (which reads the
backend's CPU) into the other tree's ``bench/`` and run ``python -m bench.claim_cost`` in each
(``PYTHONPATH=<tree>``), alternately, the same hour.

  python -m bench.claim_cost [--batch 1 10 100] [--pgbin DIR]
  python -m bench.claim_cost --batch 10 --drain 30000
  python -m bench.claim_cost --batch 1 10 --parts"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio

from pgwork import db, store
from pgwork.embedded import LocalServer

from . import workloads as w
from .cpu import process_cpu_s

CALLS_PER_BATCH = 2000  # rows claimed per batch size and round (at least 100 claims)


async def measure(dsn: str, batches: list[int], rounds: int) -> dict[str, Any]:
    async with await db.connect(dsn) as c:
        await w.migrate_with_noop(c)
    need = sum(rounds * max(100, CALLS_PER_BATCH // b) * b + 3 * b for b in batches)
    await w.seed_work(dsn, need)
    pool = db.make_pool(dsn, 1, 5, plan_once=True)
    await pool.open(wait=True)
    out: dict[str, Any] = {}
    try:
        async with pool.connection() as conn:
            pid = conn.info.backend_pid
            for batch in batches:
                req = store.ClaimRequest("noop", batch, 5, timedelta(hours=1), "bench")
                for _ in range(3):  # plans made and cached first
                    await store.claim_work(conn, req)
                calls = rounds * max(100, CALLS_PER_BATCH // batch)
                b0, p0 = process_cpu_s(pid), time.process_time()
                for _ in range(calls):
                    got = await store.claim_work(conn, req)
                    assert len(got) == batch, (len(got), batch)
                pg, py = process_cpu_s(pid) - b0, time.process_time() - p0
                out[str(batch)] = {
                    "calls": calls,
                    "pg_us_per_claim": round(pg / calls * 1e6, 1),
                    "py_us_per_claim": round(py / calls * 1e6, 1),
                }
    finally:
        await pool.close()
    return out


#: pgwork.claim_rows as the code defines it, and the rare writes ``without_rare_writes`` drops.
_CLAIM_SQL = Path(__file__).resolve().parent.parent / "pgwork" / "sql" / "code" / "claim.sql"
_RARE = ("reissued", "released", "closed", "spent", "expired")
_FLOOR_QUERY = """    RETURN QUERY
    WITH picked AS MATERIALIZED (
        SELECT w.work_id AS id FROM pgwork.work_ready w
         WHERE w.channel = claim_rows.channel AND w.source = claim_rows.lanes[1]
           AND w.available_at <= now()
         ORDER BY w.available_at, w.work_id
         LIMIT claim_rows.claim_limit
           FOR UPDATE SKIP LOCKED
    ), unreadied AS (
        DELETE FROM pgwork.work_ready r WHERE r.work_id IN (SELECT id FROM picked)
    ), judged AS (
        SELECT w FROM pgwork.renewal_work w WHERE w.id IN (SELECT id FROM picked)
    ), leased AS (
        INSERT INTO pgwork.work_lease
               (work_id, lease, attempts, channel, source, due_at, expires_at, claimed_by, claimed_at)
        SELECT (j.w).id, (j.w).lease + 1, (j.w).attempts + 1, (j.w).channel, (j.w).source,
               (j.w).due_at, now() + claim_rows.lease, claim_rows.daemon_id, now()
          FROM judged j
    )
    SELECT (pgwork.as_claimed(j.w, 'claimed', (j.w).lease + 1, (j.w).attempts + 1, 'ready',
                              'r', '{}', NULL)).*
      FROM judged j;
END
$$;
"""


def claim_rows_variants() -> dict[str, str | None]:
    """``CREATE OR REPLACE FUNCTION pgwork.claim_rows`` for each part measured (None: as it
    ships)."""
    text = _CLAIM_SQL.read_text()
    fn = text[
        text.index("CREATE OR REPLACE FUNCTION pgwork.claim_rows(") : text.index(
            "COMMENT ON FUNCTION pgwork.claim_rows"
        )
    ]
    lean = fn
    for name in _RARE:
        start = lean.index(f"    ), {name} AS (")
        following = lean.find("    ), ", start + 1)
        last = lean.index("\n    )\n    SELECT u.*", start)
        lean = (
            lean[:start] + lean[following if following != -1 and following < last else last + 1 :]
        )
    return {
        "as_shipped": None,
        "without_rare_writes": lean,
        "floor": fn[: fn.index("    RETURN QUERY")] + _FLOOR_QUERY,
    }


async def parts(dsn: str, batches: list[int], rounds: int) -> dict[str, Any]:
    """Backend CPU per claim for each of ``claim_rows_variants``, alternated ``rounds`` times (a
    fresh schema for each), medians."""
    seen: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for name, sql in claim_rows_variants().items():
            async with await db.connect(dsn) as c:
                await c.execute("DROP SCHEMA IF EXISTS pgwork CASCADE")
                await w.migrate_with_noop(c)
                if sql is not None:
                    await c.execute(sql)
            got = await measure(dsn, batches, 1)
            for batch, fig in got.items():
                seen.setdefault(name, {}).setdefault(batch, []).append(fig["pg_us_per_claim"])
    return {
        name: {batch: statistics.median(v) for batch, v in by.items()} for name, by in seen.items()
    }


async def drain(dsn: str, batch: int, total: int) -> dict[str, Any]:
    """``total`` rows claimed ``batch`` at a time, no vacuum meanwhile: µs of Postgres per claim in
    each tenth of the drain."""
    async with await db.connect(dsn) as c:
        await w.migrate_with_noop(c)
        for table in ("renewal_work", "lane"):
            await c.execute(f"ALTER TABLE pgwork.{table} SET (autovacuum_enabled = off)")
    await w.seed_work(dsn, total + 3 * batch)
    async with await db.connect(dsn) as c:
        await c.execute("VACUUM ANALYZE pgwork.renewal_work, pgwork.lane")
    pool = db.make_pool(dsn, 1, 5, plan_once=True)
    await pool.open(wait=True)
    tenths: list[float] = []
    try:
        async with pool.connection() as conn:
            pid = conn.info.backend_pid
            req = store.ClaimRequest("noop", batch, 5, timedelta(hours=1), "bench")
            for _ in range(3):  # plans made and cached first
                await store.claim_work(conn, req)
            calls = max(1, total // batch // 10)
            for _ in range(10):
                b0 = process_cpu_s(pid)
                for _ in range(calls):
                    got = await store.claim_work(conn, req)
                    assert len(got) == batch, (len(got), batch)
                tenths.append(round((process_cpu_s(pid) - b0) / calls * 1e6, 1))
    finally:
        await pool.close()
    return {
        "batch": batch,
        "rows": total,
        "pg_us_per_claim_by_tenth": tenths,
        # /proc counts CPU in clock ticks (10 ms here): a tenth of a small drain (the smoke's)
        # can read none, and then there is no ratio to give.
        "last_to_first": round(tenths[-1] / tenths[0], 2) if tenths[0] else None,
    }


async def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.claim_cost", description=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 10, 100])
    ap.add_argument(
        "--rounds", type=int, default=3, help="~2,000 rows (at least 100 claims) per round"
    )
    ap.add_argument("--pgbin", type=Path, help="PostgreSQL's bin directory (default: embedded)")
    ap.add_argument(
        "--drain", type=int, metavar="ROWS", help="one drain of ROWS rows, by tenths (see above)"
    )
    ap.add_argument(
        "--parts", action="store_true", help="the claim against its lean copies (see above)"
    )
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pgwork-claim-cost-") as tmp:
        srv = LocalServer(Path(tmp) / "data", a.pgbin)
        srv.start()
        try:
            if a.drain:
                out = {"drain": await drain(srv.dsn(), a.batch[0], a.drain)}
            elif a.parts:
                out = {"parts": await parts(srv.dsn(), a.batch, a.rounds)}
            else:
                out = {"claims": await measure(srv.dsn(), a.batch, a.rounds)}
        finally:
            srv.stop()
    print(json.dumps({"pgbin": str(a.pgbin or "embedded"), **out}), flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:], backend="asyncio", backend_options={"use_uvloop": True})
