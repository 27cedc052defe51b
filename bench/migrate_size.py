"""What an upgrade costs on a large database while apps write: ``python -m bench.migrate_size
[--rows 1000000] [--from 13 1]``. For each starting schema (its frozen fresh install,
tests/history.py builds it from git) on a scratch embedded server at server defaults: N reminders, N work
rows (99% delivered, 1% ready) and N attempts; then `pgwork migrate` to this version while an app
inserts a reminder and moves another 20 times a second each (no daemon runs: the documented
procedure, and what the handshake leaves once the daemons stepped aside). Reports the
migration's time, and the apps' longest and median statement time during it and before it."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import psycopg

from pgwork import SCHEMA_VERSION, migration
from pgwork.embedded import LocalServer
from tests.history import fresh_install

ROOT = Path(__file__).resolve().parent.parent


async def seed(dsn: str, version: int, rows: int) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        await c.execute(fresh_install(version))
        await c.execute("INSERT INTO pgwork.channel (name, kind) VALUES ('app', 'webhook')")
        # Columns every schema since 1 has.
        await c.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 'app', 'r' || g, now() + interval '30 days' + g * interval '1 second', "
            "'app', 'r@example.com' FROM generate_series(1, %s) g",
            (rows,),
        )
        await c.execute(
            "INSERT INTO pgwork.renewal_work (reminder_id, source, business_key, deadline, "
            "occurrence, due_at, channel, operation_id, status, available_at, attempts, lease, "
            "finished_at) "
            "SELECT g, 'app', 'old' || g, now() - interval '1 day', '0', now() - interval '1 day', "
            "'app', gen_random_uuid(), CASE WHEN g %% 100 = 0 THEN 'ready' ELSE 'delivered' END, "
            "now(), CASE WHEN g %% 100 = 0 THEN 0 ELSE 1 END, CASE WHEN g %% 100 = 0 THEN 0 ELSE 1 END, "
            "CASE WHEN g %% 100 = 0 THEN NULL ELSE now() END FROM generate_series(1, %s) g",
            (rows,),
        )
        await c.execute(
            "INSERT INTO pgwork.attempt (work_id, lease, attempt, daemon_id, host, pid, "
            "started_at, finished_at, outcome) SELECT g, 1, 1, 'd', 'h', 1, now(), now(), "
            "'delivered' FROM generate_series(1, %s) g",
            (rows,),
        )
        await c.execute("VACUUM ANALYZE")
        await c.execute("CHECKPOINT")


async def app(
    dsn: str, rows: int, stop: anyio.Event, times: list[tuple[float, float]], errors: list[str]
) -> None:
    """Inserts and moves, each 20 a second, timing each statement (start, seconds); a statement
    that fails (a deadlock) is counted and the app goes on."""

    async def one(kind: str) -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
            n = 0
            while not stop.is_set():
                t = time.monotonic()
                try:
                    await _statement(c, kind, n, rows)
                except psycopg.Error as e:
                    errors.append(type(e).__name__)
                times.append((t, time.monotonic() - t))
                n += 1
                await anyio.sleep(max(0.0, 0.05 - (time.monotonic() - t)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "insert")
        tg.start_soon(one, "move")


async def _statement(c: psycopg.AsyncConnection[Any], kind: str, n: int, rows: int) -> None:
    if kind == "insert":
        await c.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "VALUES ('app', %s, now() + interval '40 days', 'app', 'r')",
            (f"new{n}",),
        )
    else:
        await c.execute(
            "UPDATE pgwork.reminder SET due_at = due_at + interval '1 hour' "
            "WHERE source = 'app' AND business_key = %s",
            (f"r{random.randint(1, rows)}",),
        )


async def measure(dsn: str, version: int, rows: int) -> dict[str, Any]:
    await seed(dsn, version, rows)
    times: list[tuple[float, float]] = []
    errors: list[str] = []
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(app, dsn, rows, stop, times, errors)
        await anyio.sleep(3)  # the apps' pace before
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
            t0 = time.monotonic()
            said = await migration.migrate(c)
            t1 = time.monotonic()
        await anyio.sleep(1)
        stop.set()
    during = [d for t, d in times if t0 - d <= t <= t1] or [0.0]
    # A statement that started before the migration and ended inside it waited on it too.
    during += [d for t, d in times if t < t0 < t + d]
    before = [d for t, d in times if t + d < t0] or [0.0]
    return {
        "from": version,
        "to": SCHEMA_VERSION,
        "rows": rows,
        "said": said,
        "migrate_s": round(t1 - t0, 3),
        "app_longest_wait_s": round(max(during), 4),
        "app_median_during_s": round(statistics.median(during), 4),
        "app_longest_before_s": round(max(before), 4),
        "app_statements_during": len(during),
        "app_errors": errors,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[1_000_000])
    p.add_argument("--from", dest="versions", type=int, nargs="+", default=[SCHEMA_VERSION - 2, 1])
    a = p.parse_args()
    for rows in a.rows:
        for version in a.versions:
            with tempfile.TemporaryDirectory(prefix="pgwork-migrate-size-") as tmp:
                server = LocalServer(Path(tmp) / "data")
                server.start()
                try:
                    got = anyio.run(measure, server.dsn(), version, rows)
                finally:
                    server.destroy()
            print(json.dumps(got), flush=True)


if __name__ == "__main__":
    main()
