"""How long `pgwork migrate` takes from the previous schema on a large database:
``python -m bench.migrate_cost [--rows N]``. Seeds the frozen previous schema
(tests/data/schema_v<N-1>.sql) on a scratch embedded server with N work rows (99% delivered) and
N reminders, then times the upgrade (one transaction, holding the tables' locks)."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import anyio
import psycopg

from pgwork import SCHEMA_VERSION, db
from pgwork.embedded import LocalServer

ROOT = Path(__file__).resolve().parent.parent


async def measure(dsn: str, rows: int) -> float:
    previous = ROOT / "tests" / "data" / f"schema_v{SCHEMA_VERSION - 1}.sql"
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        await c.execute(previous.read_text())
        await c.execute("INSERT INTO pgwork.channel (name, kind) VALUES ('noop', 'python')")
        await c.execute(
            "INSERT INTO pgwork.renewal_work (reminder_id, source, business_key, deadline, "
            "occurrence, due_at, channel, operation_id, status, available_at, finished_at) "
            "SELECT g, 's', 'k' || g, now() - interval '1 day', '0', now() - interval '1 day', "
            "'noop', gen_random_uuid(), CASE WHEN g %% 100 = 0 THEN 'ready' ELSE 'delivered' END, "
            "now(), CASE WHEN g %% 100 = 0 THEN NULL ELSE now() END "
            "FROM generate_series(1, %s) g",
            (rows,),
        )
        await c.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 's', 'r' || g, now() + interval '30 days', 'noop', 'r' "
            "FROM generate_series(1, %s) g",
            (rows,),
        )
        await c.execute("VACUUM ANALYZE")
        t0 = time.perf_counter()
        print(await db.migrate(c))
        return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=1_000_000)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pgwork-migrate-") as tmp:
        server = LocalServer(Path(tmp) / "data")
        server.start()
        try:
            took = anyio.run(measure, server.dsn(), a.rows)
        finally:
            server.destroy()
    print(
        f"migrate {SCHEMA_VERSION - 1} -> {SCHEMA_VERSION}: {took:.2f}s with {a.rows} work rows and {a.rows} reminders"
    )


if __name__ == "__main__":
    main()
