"""Another app's lateness beside one app's flood of reminders due now, or beside many heavy
series (issue 53): ``python -m bench.flood [--flood N] [--series N]``.

On a scratch embedded server, a daemon in this process (the no-op python channel, the
burn-down's config, a look-ahead of two minutes). ``--flood``: one app writes N one-offs due now
in one statement; then another app writes one reminder due 2 s later. ``--series``: one app
writes N series every minute with 16 ``remind_before`` entries over 0-375 days, each in its own
zone; after ``--settle`` seconds of passes, another app writes one reminder due 2 s later, five
times, 5 s apart. Reports how late the other app's reminders were delivered (due to delivered,
database clock) and how long the materialiser's passes took. Runs against whichever ``pgwork``
is importable, so the same file measures an older tree (``PYTHONPATH=<tree>``). Prints one JSON
line."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from pgwork import db
from pgwork.daemon import Daemon
from pgwork.embedded import LocalServer

from .heavy_series import EVERY_MINUTE, RULES
from .workloads import daemon_config, migrate_with_noop

#: The issue's heaviest valid series: 16 remind_before entries over 0-375 days.
SIXTEEN = RULES["A"]


async def _probe(dsn: str, key: str, timeout: float) -> float:
    """Write another app's reminder due 2 s from now; its lateness once delivered, seconds."""
    async with await db.connect(dsn) as app:
        await app.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "VALUES ('other', %s, now() + interval '2 seconds', 'noop', 'r')",
            (key,),
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            cur = await app.execute(
                "SELECT extract(epoch FROM w.finished_at - w.due_at)::float8 "
                "FROM pgwork.renewal_work w WHERE w.business_key = %s AND w.status = 'delivered'",
                (key,),
            )
            row = await cur.fetchone()
            if row is not None:
                return float(row[0])
            await anyio.sleep(0.05)
    return float("inf")


async def measure(dsn: str, flood: int, series: int, settle: float) -> dict[str, Any]:
    async with await db.connect(dsn) as c:
        await migrate_with_noop(c)
    out: dict[str, Any] = {"flood": flood, "series": series}
    daemon = Daemon(daemon_config(lookahead=120.0), dsn)
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.run)
        try:
            async with await db.connect(dsn) as app:
                if flood:
                    t0 = time.monotonic()
                    await app.execute(
                        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, "
                        "recipient) SELECT 'flood', 'f' || g, now(), 'noop', 'r' "
                        "FROM generate_series(1, %s) g",
                        (flood,),
                    )
                    out["flood_insert_s"] = round(time.monotonic() - t0, 2)
                if series:
                    await app.execute(
                        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, "
                        "recur, remind_before, channel, recipient) "
                        "SELECT 'heavy', z.name, date_trunc('minute', now() AT TIME ZONE z.name) "
                        "+ interval '1 minute', z.name, %s, %s::interval[], 'noop', 'r' "
                        "FROM (SELECT name FROM pgwork.time_zone ORDER BY name LIMIT %s) AS z",
                        (EVERY_MINUTE, SIXTEEN, series),
                    )
                    await anyio.sleep(settle)
            late = [await _probe(dsn, "probe-0", 120.0)]
            if series:
                for i in range(1, 5):
                    await anyio.sleep(5)
                    late.append(await _probe(dsn, f"probe-{i}", 120.0))
            hist = next(iter(daemon.sup.metrics.materialiser_pass.collect())).samples
            count = next(s.value for s in hist if s.name.endswith("_count"))
            total = next(s.value for s in hist if s.name.endswith("_sum"))
            out["other_late_s"] = [round(x, 3) for x in late]
            out["other_late_max_s"] = round(max(late), 3)
            out["other_late_median_s"] = round(statistics.median(late), 3)
            out["passes"] = int(count)
            out["mean_pass_s"] = round(total / count, 4) if count else None
        finally:
            daemon.request_stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--flood", type=int, default=0, help="one-offs due now from one app")
    p.add_argument("--series", type=int, default=0, help="heavy series, each in its own zone")
    p.add_argument("--settle", type=float, default=60.0, help="seconds of passes before probing")
    p.add_argument("--pgbin", type=Path, default=None, help="another PostgreSQL's bin directory")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pgwork-flood-") as tmp:
        server = LocalServer(Path(tmp) / "data", a.pgbin)
        server.start()
        try:
            print(json.dumps(anyio.run(measure, server.dsn(), a.flood, a.series, a.settle)))
        finally:
            server.destroy()


if __name__ == "__main__":
    main()
