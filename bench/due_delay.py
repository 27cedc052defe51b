"""Delay between a reminder's due instant and its materialisation, on an idle daemon with no
look-ahead and the default 5 s tick: only the timer (sleep until the next known due instant) can
make it prompt. ``python -m bench.due_delay [--n 100] [--spread 10]``; prints median and worst."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import anyio
import psycopg

from pgwork import db, migration
from pgwork.daemon import Daemon
from pgwork.embedded import LocalServer

from . import workloads as w


async def measure(dsn: str, n: int, spread: float) -> list[float]:
    async with await db.connect(dsn) as c:
        await migration.migrate(c)
        await c.execute("INSERT INTO pgwork.channel (name, kind) VALUES ('noop', 'python')")
    async with anyio.create_task_group() as tg:
        d = Daemon(w.daemon_config(lookahead=0.0, tick=5.0), dsn)
        await tg.start(d.run)
        await anyio.sleep(1)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as app:
            await app.execute(
                "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
                "SELECT 'delay', 'k' || g, now() + interval '1 second' + random() * %s * interval '1 second', "
                "'noop', 'r' FROM generate_series(1, %s) g",
                (spread, n),
            )
            while True:
                cur = await app.execute("SELECT count(*) FROM pgwork.renewal_work")
                row = await cur.fetchone()
                if row and row[0] >= n:
                    break
                await anyio.sleep(0.2)
            cur = await app.execute(
                "SELECT extract(epoch FROM created_at - due_at) * 1000 FROM pgwork.renewal_work"
            )
            delays = [float(r[0]) for r in await cur.fetchall()]
        d.request_stop()
    return delays


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.due_delay", description=__doc__)
    p.add_argument("--n", type=int, default=100)
    p.add_argument(
        "--spread", type=float, default=10.0, help="due instants spread over this many seconds"
    )
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pgwork-delay-"))
    os.chmod(tmp, 0o755)
    server = LocalServer(tmp / "data")
    server.start()
    try:
        delays = anyio.run(measure, server.dsn(), a.n, a.spread)
    finally:
        server.destroy()
    print(
        f"due instant -> work row, {len(delays)} reminders, look-ahead 0, tick 5 s: "
        f"median {statistics.median(delays):.1f} ms, worst {max(delays):.1f} ms, best {min(delays):.1f} ms"
    )


if __name__ == "__main__":
    main()
