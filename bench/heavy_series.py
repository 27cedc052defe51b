"""What one heavy but valid series costs everyone else (issue 37): a page's and a claim's time
while it is present. ``python -m bench.heavy_series [--rule A|B]``.

On a scratch embedded server (durable settings): 1,000 one-off reminders of other apps due over
the next minutes, and one series every minute in UTC, ``catch_up = all``, with ``remind_before``
of 16 entries over 0-375 days (rule A, the issue's) or ``{0, 50 days}`` (rule B), on a channel
that is not drained. Then one materialiser pass after another (the daemon's own ``run_once``,
page size 1,000, the session's 60 s statement timeout), each timed, with a claim of another
app's reminder due now after each. Prints one JSON line. Runs against whichever ``pgwork`` is
importable, so the same file measures an older tree (``PYTHONPATH=<tree>``)."""

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

EVERY_MINUTE = "FREQ=DAILY;BYHOUR={};BYMINUTE={}".format(
    ",".join(str(h) for h in range(24)), ",".join(str(m) for m in range(60))
)
RULES = {
    "A": "{" + ", ".join(f"{i * 25} days" for i in range(16)) + "}",
    "B": "{0, 50 days}",
}


async def measure(dsn: str, rule: str, passes: int) -> dict[str, Any]:
    async with await db.connect(dsn) as c:
        await migration.migrate(c)
        await c.execute(
            "INSERT INTO pgwork.channel (name, kind) VALUES ('noop', 'python'), ('hook', 'webhook')"
        )
        await c.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 'other' || (g % 10), 'k' || g, now() + g * interval '100 ms', 'noop', 'r' "
            "FROM generate_series(1, 1000) g"
        )
        await c.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, "
            "remind_before, channel, recipient) VALUES ('heavy', 'series', "
            "date_trunc('minute', now() AT TIME ZONE 'UTC') + interval '1 minute', 'UTC', %s, "
            "%s::interval[], 'hook', 'r')",
            (EVERY_MINUTE, RULES[rule]),
        )
        await c.execute("ANALYZE")
    out: dict[str, Any] = {"rule": rule, "passes": []}
    req = store.ClaimRequest(
        channel="noop",
        limit=100,
        max_attempts=5,
        lease=timedelta(seconds=30),
        daemon_id="bench",
        expire_after=None,
    )
    async with await db.connect(dsn) as c:
        for i in range(passes):
            await c.execute(
                "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
                "VALUES ('other', %s, now(), 'noop', 'r')",
                (f"due-now-{i}",),
            )
            t0 = time.perf_counter()
            try:
                res = await materialise.run_once(c, lookahead=0.0, page_size=1000)
                failed = None
            except psycopg.Error as e:
                res, failed = None, type(e).__name__
            took = time.perf_counter() - t0
            t1 = time.perf_counter()
            claimed = await store.claim_work(c, req)
            claim = time.perf_counter() - t1
            out["passes"].append(
                {
                    "pass_s": round(took, 4),
                    "longest_page_s": round(res.longest_page, 4) if res else None,
                    "made": res.made if res else 0,
                    "failed": failed,
                    "claim_s": round(claim, 4),
                    "claimed": len(claimed),
                }
            )
    ok = [p for p in out["passes"] if not p["failed"]]
    out["first_pass_s"] = out["passes"][0]["pass_s"]
    out["median_pass_s"] = statistics.median(p["pass_s"] for p in out["passes"])
    out["max_pass_s"] = max(p["pass_s"] for p in out["passes"])
    out["others_claimed"] = sum(p["claimed"] for p in out["passes"])
    out["median_page_s"] = statistics.median(p["longest_page_s"] for p in ok) if ok else None
    out["median_claim_s"] = statistics.median(p["claim_s"] for p in out["passes"])
    out["failed_passes"] = len(out["passes"]) - len(ok)
    out["made"] = sum(p["made"] for p in out["passes"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rule", choices=sorted(RULES), default="A")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--all", action="store_true", help="print every pass's figures")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pgwork-heavy-") as tmp:
        server = LocalServer(Path(tmp) / "data")
        server.start()
        try:
            got = anyio.run(measure, server.dsn(), a.rule, a.passes)
            if not a.all:
                del got["passes"]
            print(json.dumps(got))
        finally:
            server.destroy()


if __name__ == "__main__":
    main()
