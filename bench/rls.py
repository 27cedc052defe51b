"""Row-level security's cost to the daemon: a materialiser pass over N due reminders, run as a
login role in ``pgwork_daemon`` (as docs/sql.md documents for many apps on one database), with
row-level security on ``pgwork.reminder`` off and on, alternated round by round on one server.

  python -m bench.rls [--pgbin DIR] [--reminders 50000] [--rounds 3]

Before schema 10 the policy called a SECURITY DEFINER function per reminder row (issue 25: a
1,000-row page read 21 ms against 1.1 ms); now its daemon branch is an InitPlan, evaluated once
per statement. Prints each round's rows/s and the median ratio on/off. Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import anyio
import psycopg
from psycopg.conninfo import make_conninfo

from pgwork import db
from pgwork.duties import materialise as materialiser
from pgwork.embedded import LocalServer

from . import workloads as w

ROLE = "bench_daemon"


async def one_pass(admin: str, dsn: str, n: int, rls: bool) -> float:
    """Rows per second of one pass over ``n`` reminders due now (inserted, not timed)."""
    async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as c:
        await c.execute("TRUNCATE pgwork.renewal_work, pgwork.attempt, pgwork.reminder")
        await c.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 's' || (i %% 10), 'k' || i, now() - interval '1 minute', 'noop', 'r' "
            "FROM generate_series(1, %s) AS i",
            (n,),
        )
        await c.execute(
            f"ALTER TABLE pgwork.reminder {'ENABLE' if rls else 'DISABLE'} ROW LEVEL SECURITY"
        )
        await c.execute("VACUUM (ANALYZE) pgwork.reminder, pgwork.renewal_work")
    async with await db.connect(dsn) as c:
        t0 = time.perf_counter()
        res = await materialiser.run_once(c, lookahead=0.0, page_size=1000)
        elapsed = time.perf_counter() - t0
    assert res is not None and res.made == n, res
    return n / elapsed


async def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.rls", description=__doc__)
    ap.add_argument("--pgbin", type=Path, help="PostgreSQL's bin directory (default: embedded)")
    ap.add_argument("--reminders", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        srv = LocalServer(Path(tmp) / "data", a.pgbin)
        srv.start()
        try:
            admin = srv.dsn()
            async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as c:
                await w.migrate_with_noop(c)
                await c.execute(f"CREATE ROLE {ROLE} LOGIN IN ROLE pgwork_daemon")
            dsn = make_conninfo(admin, user=ROLE)
            got: dict[bool, list[float]] = {False: [], True: []}
            for r in range(a.rounds):
                for rls in (False, True) if r % 2 == 0 else (True, False):
                    rate = await one_pass(admin, dsn, a.reminders, rls)
                    got[rls].append(rate)
                    print(f"round {r + 1} rls {'on ' if rls else 'off'}: {rate:,.0f} rows/s")
            off, on = statistics.median(got[False]), statistics.median(got[True])
            print(
                f"materialise {a.reminders:,} reminders as a pgwork_daemon member: "
                f"RLS off {off:,.0f}/s, on {on:,.0f}/s, on/off {on / off:.2f}"
            )
        finally:
            srv.destroy()


if __name__ == "__main__":
    anyio.run(main)
