"""What the materialiser's page costs Postgres (issues 39, 41): ``python -m bench.page_cost``.

Two readings on a scratch embedded server (durable settings, ``pg_stat_statements`` tracking
nested statements), one daemon connection, the daemon's own ``run_once``:

- ``idle``: the idle path's page. An app inserts one reminder due now; one pass makes its row
  and claims it in the page (a channel with room, as an idle daemon asks). Per pass: the wall
  time of the pass, the page statement's time in the server, and the CPU of the daemon
  connection's server process (read from ``/proc``; it includes starting the page's plan).
- ``rent``: rent day's making. N monthly series (Berlin, one instant two hours ahead) made by
  one pass (page size 1,000, the default). Per series: the pass's wall time, and the server time
  of the page and of the series function inside it.

Prints one JSON line. Runs against whichever ``pgwork`` is importable, so the same file
measures an older tree (``PYTHONPATH=<tree> python <this file>``)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import psycopg

from pgwork import db, migration, store
from pgwork.duties import materialise
from pgwork.embedded import LocalServer

from .cpu import process_cpu_s

SETTINGS = {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all"}


class _Room:
    """A channel with room for the page's claims (what an idle daemon's channel asks)."""

    def __init__(self) -> None:
        self.request = store.ClaimRequest(
            channel="noop", limit=10, max_attempts=3, lease=timedelta(seconds=60), daemon_id="d1"
        )
        self.claimed = 0

    def page_claim(self) -> store.ClaimRequest | None:
        return self.request

    def page_claimed(
        self, request: store.ClaimRequest, rows: list[store.Claimed] | None, t_claim: float
    ) -> None:
        self.claimed += len(rows or ())


#: How the page's statement starts: today's, and an older tree's (before schema 16).
PAGE = ("SELECT p.cutoff, p.scanned%", "SELECT * FROM pgwork.materialise_page(%")
SERIES = ("WITH due AS MATERIALIZED%",)


async def _server_us(app: psycopg.AsyncConnection[Any], like: tuple[str, ...], per: int) -> float:
    """Microseconds of server time, per ``per``, of the statements whose text is ``like``."""
    cur = await app.execute(
        "SELECT coalesce(sum(total_exec_time), 0) * 1000 / %s FROM pg_stat_statements"
        " WHERE query LIKE ANY (%s)",
        (per, list(like)),
    )
    row = await cur.fetchone()
    return round(float(row[0]) if row else 0.0, 1)


async def idle(dsn: str, app: psycopg.AsyncConnection[Any], passes: int) -> dict[str, Any]:
    room = _Room()
    walls: list[float] = []
    async with await db.connect(dsn) as daemon:
        backend = daemon.info.backend_pid
        cpu0 = 0.0
        for i in range(passes + 50):  # the first 50 warm the session (plans, caches)
            if i == 50:
                await app.execute("SELECT pg_stat_statements_reset()")
                cpu0 = process_cpu_s(backend)
            await app.execute(
                "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient)"
                " VALUES ('idle', %s, now(), 'noop', 'r')",
                (f"k{i}",),
            )
            t0 = time.perf_counter()
            await materialise.run_once(daemon, lookahead=300, page_size=100, claimers=[room])
            if i >= 50:
                walls.append((time.perf_counter() - t0) * 1e6)
        cpu = process_cpu_s(backend) - cpu0
    assert room.claimed == passes + 50, "every reminder is claimed by the page that makes it"
    return {
        "passes": passes,
        "pass_wall_us_p50": round(statistics.median(walls), 1),
        "page_server_us": await _server_us(app, PAGE, passes),
        # The daemon's backend, whole: pg_stat_statements does not time starting and ending
        # the page's plan (tick-grained: a few hundred passes make it exact to a few %).
        "backend_cpu_us": round(cpu / passes * 1e6, 1),
    }


async def rent(dsn: str, app: psycopg.AsyncConnection[Any], n: int) -> dict[str, Any]:
    cur = await app.execute(
        "SELECT date_trunc('second', now() AT TIME ZONE 'Europe/Berlin') + interval '2 hours'"
    )
    row = await cur.fetchone()
    assert row is not None
    await app.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, channel,"
        " recipient) SELECT 'rent', 'flat-' || g, %s, 'Europe/Berlin', 'FREQ=MONTHLY', 'noop', 'r'"
        " FROM generate_series(1, %s) g",
        (row[0], n),
    )
    await app.execute("VACUUM (ANALYZE) pgwork.reminder, pgwork.renewal_work")
    await app.execute("SELECT pg_stat_statements_reset()")
    async with await db.connect(dsn) as daemon:
        t0 = time.perf_counter()
        await materialise.run_once(daemon, lookahead=7300, page_size=1000)
        wall = time.perf_counter() - t0
    cur = await app.execute("SELECT count(*) FROM pgwork.renewal_work")
    made = await cur.fetchone()
    assert made is not None and made[0] == n, f"made {made} of {n}"
    return {
        "series": n,
        "wall_us_per_series": round(wall / n * 1e6, 1),
        "page_server_us_per_series": await _server_us(app, PAGE, n),
        "series_function_us_per_series": await _server_us(app, SERIES, n),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=400, help="idle passes (after 50 warm-up)")
    ap.add_argument(
        "--series", type=int, default=30_000, help="rent series made in one pass (0: none)"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pgwork-page-cost-") as tmp:
        srv = LocalServer(Path(tmp) / "data", settings=SETTINGS)
        srv.start()
        try:
            dsn = srv.dsn()
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as app:
                await migration.migrate(app)
                await app.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                await app.execute(
                    "INSERT INTO pgwork.channel (name, kind) VALUES ('noop', 'python')"
                )
                out = {"idle": await idle(dsn, app, args.passes)}
                if args.series:  # 0: a tree without series (before schema 13)
                    await app.execute("TRUNCATE pgwork.renewal_work, pgwork.reminder")
                    out["rent"] = await rent(dsn, app, args.series)
        finally:
            srv.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    anyio.run(main)
