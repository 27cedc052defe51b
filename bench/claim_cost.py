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

Prints one JSON line. To compare two trees, copy this file and ``bench/cpu.py`` (which reads the
backend's CPU) into the other tree's ``bench/`` and run ``python -m bench.claim_cost`` in each
(``PYTHONPATH=<tree>``), alternately, the same hour.

  python -m bench.claim_cost [--batch 1 10 100] [--pgbin DIR]
  python -m bench.claim_cost --batch 10 --drain 30000"""

from __future__ import annotations

import argparse
import json
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
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pgwork-claim-cost-") as tmp:
        srv = LocalServer(Path(tmp) / "data", a.pgbin)
        srv.start()
        try:
            if a.drain:
                out = {"drain": await drain(srv.dsn(), a.batch[0], a.drain)}
            else:
                out = {"claims": await measure(srv.dsn(), a.batch, a.rounds)}
        finally:
            srv.stop()
    print(json.dumps({"pgbin": str(a.pgbin or "embedded"), **out}), flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:], backend="asyncio", backend_options={"use_uvloop": True})
