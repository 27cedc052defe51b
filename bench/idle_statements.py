"""The idle path, statement by statement (issue 41): ``python -m bench.idle_statements``.

A scratch server with ``pg_stat_statements`` tracking nested statements; an idle daemon (no-op
channel, claim batch 1) and the latency workload's samples: another connection inserts one
reminder due now, and the time until the channel is called is one sample. Prints the samples'
median and, per statement run at least ten times, its calls, mean execution time and mean
planning time (``T``: sent by a client; the others run inside a function or a trigger). The
statistics include the daemon's start and ten warm-up samples: use a few hundred samples.

``pg_stat_statements`` does not time starting a statement's plan (``ExecutorStart``): a
statement run inside a function is timed without it, its caller with it. Runs against whichever
``pgwork`` and ``bench`` are importable, so the same file measures an older tree::

    cd <tree> && PYTHONPATH=<tree> python /path/to/this/bench/idle_statements.py --pgbin ...
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import anyio
import psycopg

from bench import workloads as w
from pgwork import db
from pgwork.embedded import LocalServer

# bench.costs has the same settings and a reading of its own, but an older tree's bench/ (the one
# importable when this file measures that tree) may not: this file carries what it uses.
SETTINGS = {
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "all",
    "pg_stat_statements.track_planning": "on",
}

STATS = """
SELECT toplevel, calls, total_exec_time / calls * 1000, total_plan_time / greatest(plans, 1) * 1000,
       plans, regexp_replace(left(query, 64), '\\s+', ' ', 'g')
  FROM pg_stat_statements
 WHERE calls >= 10 AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
 ORDER BY total_exec_time DESC
"""


async def measure(dsn: str, samples: int) -> str:
    async with await db.connect(dsn) as c:
        await w.migrate_with_noop(c)
        await c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        await c.execute("SELECT pg_stat_statements_reset()")
    cfg = w.daemon_config(w.noop_channel(1), claim_batch=1)
    lat = await w.latency_samples(dsn, samples, cfg, warmup=10)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        rows = await (await c.execute(STATS)).fetchall()
    out = [
        f"latency p50 {statistics.median(lat):.3f} ms over {len(lat)} samples",
        f"  {'calls':>6} {'exec µs':>8} {'plan µs':>8} {'plans':>5}  statement",
    ]
    for top, calls, exec_us, plan_us, plans, text in rows:
        out.append(
            f"{'T' if top else ' '} {calls:>6} {exec_us:>8.1f} {plan_us:>8.1f} {plans:>5}  {text}"
        )
    return "\n".join(out)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument(
        "--pgbin", type=Path, help="server binaries to use (default: the embedded ones)"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pgwork-idle-") as tmp:
        srv = LocalServer(Path(tmp) / "data", args.pgbin, settings=SETTINGS)
        srv.start()
        try:
            print(await measure(srv.dsn(), args.samples))
        finally:
            srv.stop()


if __name__ == "__main__":
    anyio.run(main)
