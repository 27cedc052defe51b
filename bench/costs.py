"""What one delivered job costs: per statement, per job, from ``pg_stat_statements``.

Starts its own embedded server with ``pg_stat_statements`` loaded (or uses ``--dsn``, where it
must be loaded), materialises ``--jobs`` reminders already due, then drains them with the
burn-down's daemon (no-op Python channel, ledger and fencing on; ``--webhook``: the webhook
burn-down's channel posting to a local receiver) and prints, per statement the
drain ran: calls, mean execution time, and per delivered job the execution time, WAL bytes and
records, and shared buffers touched (hit + read) and dirtied; then the totals, the CPU split
(µs of Postgres, of the daemon's Python and of the receiver per job) and how contended the
machine's cores were::

    .venv/bin/python -m bench.costs --jobs 50000
    .venv/bin/python -m bench.costs --jobs 50000 --json   # one JSON line (for comparisons)
    .venv/bin/python -m bench.costs --jobs 30000 --webhook
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import psycopg

from pgwork import db, eventloop
from pgwork.embedded import LocalServer

from . import workloads as w

SETTINGS = {
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "all",
    "pg_stat_statements.track_planning": "on",
}

STATS = """
SELECT regexp_replace(left(query, 60), '\\s+', ' ', 'g') AS statement, calls, plans,
       total_exec_time AS exec_ms, total_plan_time AS plan_ms, wal_bytes::float8 AS wal_bytes,
       wal_records, shared_blks_hit + shared_blks_read AS buffers, shared_blks_dirtied AS dirtied,
       toplevel
  FROM pg_stat_statements
 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND calls > 0
 ORDER BY total_exec_time DESC
"""


async def statements(conn: psycopg.AsyncConnection[Any]) -> list[dict[str, Any]]:
    """This database's rows of ``pg_stat_statements``, slowest first."""
    cur = await conn.execute(STATS)
    names = [d.name for d in cur.description or ()]
    return [dict(zip(names, r, strict=True)) for r in await cur.fetchall()]


def totals(rows: list[dict[str, Any]], jobs: int) -> dict[str, float]:
    """Execution, planning, WAL and buffers per job, of the statements the clients sent.

    With ``track = all`` a statement run inside a function is counted in its own row and again
    in its caller's: adding every row counts it twice."""
    return {
        k: sum(float(r[k]) for r in rows if r["toplevel"]) / jobs
        for k in ("exec_ms", "plan_ms", "wal_bytes", "wal_records", "buffers", "dirtied")
    }


async def measure(
    dsn: str, jobs: int, postmaster: int | None, *, webhook: bool = False
) -> dict[str, Any]:
    async with await db.connect(dsn) as c:
        await w.migrate_with_noop(c)
        await c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    receiver, url = w.start_receiver() if webhook else (None, "")
    try:
        await w.seed_work(dsn, jobs, channel="hook" if webhook else "noop")
        async with await db.connect(dsn) as c:
            await c.execute("SELECT pg_stat_statements_reset()")
        cfg = (
            w.daemon_config(w.webhook_channel(url, w.WEBHOOK_CONCURRENCY))
            if webhook
            else w.daemon_config()
        )
        drained = await w.drain(
            dsn, cfg, jobs, postmaster, receiver=receiver.pid if receiver else None
        )
    finally:
        if receiver is not None:
            receiver.terminate()
            receiver.wait(10)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        rows = await statements(c)
    per_job = totals(rows, jobs)
    return {
        "channel": "webhook" if webhook else "noop",
        "jobs": jobs,
        "jobs_per_s": round(drained["jobs_per_s"], 1),
        "pg_us_per_job": round(drained["pg_cores"] / drained["jobs_per_s"] * 1e6, 1),
        "py_us_per_job": round(drained["py_cores"] / drained["jobs_per_s"] * 1e6, 1),
        "receiver_us_per_job": round(
            drained.get("receiver_cores", 0.0) / drained["jobs_per_s"] * 1e6, 1
        ),
        "sys_cores": drained["sys_cores"],
        "cpu_pressure": drained["cpu_pressure"],
        "loop_wait": drained["loop_wait"],
        "exec_us_per_job": round(per_job["exec_ms"] * 1000, 1),
        "plan_us_per_job": round(per_job["plan_ms"] * 1000, 2),
        "wal_bytes_per_job": round(per_job["wal_bytes"], 1),
        "wal_records_per_job": round(per_job["wal_records"], 2),
        "buffers_per_job": round(per_job["buffers"], 2),
        "dirtied_per_job": round(per_job["dirtied"], 3),
        "statements": rows,
    }


def report(r: dict[str, Any]) -> str:
    n = r["jobs"]
    out = [
        f"{'statement':62} {'calls':>7} {'mean ms':>8} {'µs/job':>7} {'WAL B/job':>9} "
        f"{'WAL rec/job':>11} {'bufs/job':>8} {'dirtied/job':>11}"
    ]
    for s in r["statements"]:
        if s["exec_ms"] / n * 1000 < 0.05:
            continue
        name = s["statement"] if s["toplevel"] else f"  (nested) {s['statement']}"[:62]
        out.append(
            f"{name:62} {s['calls']:>7} {s['exec_ms'] / s['calls']:>8.3f} "
            f"{s['exec_ms'] / n * 1000:>7.2f} {s['wal_bytes'] / n:>9.1f} "
            f"{s['wal_records'] / n:>11.2f} {s['buffers'] / n:>8.2f} {s['dirtied'] / n:>11.3f}"
        )
    out.append(
        f"\nper delivered job, statements the clients sent: "
        f"{r['exec_us_per_job']} µs of execution "
        f"(+{r['plan_us_per_job']} µs planning), {r['wal_bytes_per_job']} WAL bytes in "
        f"{r['wal_records_per_job']} records, {r['buffers_per_job']} buffers touched, "
        f"{r['dirtied_per_job']} dirtied"
    )
    receiver = (
        f", {r['receiver_us_per_job']} µs of the receiver's" if r["receiver_us_per_job"] else ""
    )
    out.append(
        f"CPU: {r['pg_us_per_job']} µs of Postgres and {r['py_us_per_job']} µs of the daemon's "
        f"Python{receiver} per job, at {r['jobs_per_s']:,} jobs/s ({r['channel']} channel)"
    )
    out.append(
        f"machine: {r['sys_cores']} cores busy; some task waited for a core "
        f"{100 * r['cpu_pressure']:.0f}% of the time, the event loop "
        f"{100 * r['loop_wait']:.0f}%"
    )
    return "\n".join(out)


async def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=50_000)
    ap.add_argument("--dsn", help="an existing server with pg_stat_statements loaded")
    ap.add_argument(
        "--pgbin", type=Path, help="server binaries to use (default: the embedded ones)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument(
        "--webhook",
        action="store_true",
        help="deliver through the webhook burn-down's channel to a local receiver",
    )
    args = ap.parse_args(argv)
    from .run import postmaster_of

    if args.dsn:
        r = await measure(args.dsn, args.jobs, postmaster_of(args.dsn), webhook=args.webhook)
    else:
        with tempfile.TemporaryDirectory(prefix="pgwork-costs-") as tmp:
            srv = LocalServer(Path(tmp) / "data", args.pgbin, settings=SETTINGS)
            srv.start()
            try:
                dsn = srv.dsn()
                r = await measure(dsn, args.jobs, postmaster_of(dsn), webhook=args.webhook)
            finally:
                srv.stop()
    if args.json:
        r = {**r, "statements": [s for s in r["statements"] if s["calls"] >= 10]}
        print(json.dumps(r, default=float))
    else:
        print(report(r))


if __name__ == "__main__":
    anyio.run(
        main,
        sys.argv[1:],
        backend="asyncio",
        backend_options={"use_uvloop": eventloop.use_uvloop("auto")},
    )
