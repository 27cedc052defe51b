"""An idle consumer of a peer, for ``bench.idle --peers``: ``python bench/peer_idle.py KIND DSN``.

Run with the peers' interpreter (``../shared/bench-peers/run.sh`` makes it: pgqueuer, asyncpg,
psycopg), not pgwork's. It installs its queue's schema and consumes until SIGTERM, with nothing
enqueued:

- ``pgqueuer``: one ``PgQueuer`` with one entrypoint, at its defaults (LISTEN/NOTIFY and its own
  periodic polls and health checks), as ``../shared/bench-peers/peer_pgqueuer.py`` runs it;
- ``ref``: the raw reference queue of ``../shared/bench-peers/ref_queue.py``, a table and a
  claim by ``FOR UPDATE SKIP LOCKED`` that LISTENs and claims again every 5 s without a
  notification (a consumer written here after that harness's description).
"""

from __future__ import annotations

import asyncio
import signal
import sys

REF_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id bigserial PRIMARY KEY,
    status text NOT NULL DEFAULT 'ready',
    available_at timestamptz NOT NULL DEFAULT now(),
    attempts int NOT NULL DEFAULT 0,
    payload jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS jobs_ready_idx ON jobs (available_at, id) WHERE status = 'ready'
"""

REF_CLAIM = """
UPDATE jobs j SET status = 'processing', attempts = j.attempts + 1
  FROM (SELECT id FROM jobs WHERE status = 'ready' AND available_at <= now()
         ORDER BY available_at, id LIMIT 10 FOR UPDATE SKIP LOCKED) AS c
 WHERE j.id = c.id
RETURNING j.id
"""


async def ref(dsn: str, stop: asyncio.Event) -> None:
    import psycopg

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        await c.execute(REF_SCHEMA)
        await c.execute("LISTEN ref_jobs")
        while not stop.is_set():
            rows = await (await c.execute(REF_CLAIM)).fetchall()
            if rows:
                await c.execute(
                    "UPDATE jobs SET status = 'done' WHERE id = ANY(%s)", ([r[0] for r in rows],)
                )
                continue
            async for _ in c.notifies(timeout=5.0, stop_after=1):
                pass


async def pgqueuer(dsn: str, stop: asyncio.Event) -> None:
    import psycopg
    from pgqueuer import PgQueuer
    from pgqueuer.db import PsycopgDriver
    from pgqueuer.queries import Queries

    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    driver = PsycopgDriver(conn)
    q = Queries(driver)
    if not await q.schema_is_installed():
        await q.install()
    pgq = PgQueuer(driver, queries=q)

    @pgq.entrypoint("noop")  # type: ignore[untyped-decorator]
    async def noop(job: object) -> None:
        return None

    task = asyncio.create_task(pgq.run())
    await stop.wait()
    pgq.shutdown.set()
    await asyncio.wait_for(task, 30)


async def main() -> None:
    kind, dsn = sys.argv[1], sys.argv[2]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await {"ref": ref, "pgqueuer": pgqueuer}[kind](dsn, stop)


if __name__ == "__main__":
    asyncio.run(main())
