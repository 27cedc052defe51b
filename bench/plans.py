"""Plans at production size: how many rows each of the daemon's statements reads for the rows it
returns, on tables much larger than their statistics say (or, with ``--fresh``, just analysed).

A statement that names its rows (by id, by reminder) or pages a key range should read about as
many rows as it returns. Statistics taken while a table was small or a state was rare (on a large
table the next ANALYZE is 2 to 10% of its rows away; a pooled connection keeps a generic plan until
then) can make the planner scan a whole index or table instead. This builds such a database on an
embedded server (``--rows`` sets the scale), then prints, for every statement the daemon runs in
its loops, the rows its custom plan and its generic plan examined (returned by a scan or removed
by its filter) and the scans that examined the most. The materialiser's page runs inside a
function; its statements are read from ``auto_explain``'s log.

  python -m bench.plans [--pgbin DIR] [--rows 20000] [--fresh]

Not part of ``bench.run``: it asserts nothing and takes ~30 s; the defects it found have tests
(``tests/test_hot_path.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, LiteralString

import anyio
import psycopg

from pgwork import db, store
from pgwork.duties import materialise as materialiser
from pgwork.embedded import LocalServer
from pgwork.queries import Q, positional

from . import workloads as w

Scan = tuple[float, str]

#: auto_explain as these plans are read: every statement, nested ones too, with the rows each
#: node read (not its time), as JSON.
AUTO_EXPLAIN = (
    ("log_min_duration", "0"),
    ("log_analyze", "on"),
    ("log_nested_statements", "on"),
    ("log_format", "json"),
    ("log_timing", "off"),
)


def examined(plan: Any) -> tuple[float, list[Scan]]:
    """Rows a plan's scans examined in all, and each scan's count with what it scanned."""
    scans: list[Scan] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            reads = node.get("Node Type") != "ModifyTable" and (
                "Relation Name" in node or node.get("Node Type") == "Bitmap Index Scan"
            )
            if reads:
                rows = (
                    node.get("Actual Rows", 0)
                    + node.get("Rows Removed by Filter", 0)
                    + node.get("Rows Removed by Index Recheck", 0)
                )
                what = " ".join(
                    x
                    for x in (node["Node Type"], node.get("Relation Name"), node.get("Index Name"))
                    if x
                )
                scans.append((rows * (node.get("Actual Loops") or 0), what))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(plan)
    scans.sort(reverse=True)
    return sum(n for n, _ in scans), scans


async def plans(
    conn: psycopg.AsyncConnection[Any], name: str, params: dict[str, Any], log: Path
) -> list[Any]:
    """The statement's custom plan (as sent with ``params``) and its generic plan, executed and
    rolled back. The claim's rows are read by a statement of pgwork.claim_rows: its plans are
    read from ``auto_explain``'s log (``log``: the server's)."""
    if name == "claim_work":
        return [await _claim_rows_plan(conn, params, log, generic) for generic in (False, True)]
    got: list[Any] = []
    async with conn.transaction():
        cur = await conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + Q[name], params)
        row = await cur.fetchone()
        assert row is not None
        got.append(row[0][0]["Plan"])
        raise psycopg.Rollback()
    generic = positional(Q[name])
    await conn.execute(f"PREPARE plans_probe AS {generic.sql}")
    try:
        async with conn.transaction():
            await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            args = ", ".join(psycopg.sql.quote(v) for v in generic.args(params))
            cur = await conn.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE plans_probe"
                + (f" ({args})" if args else "")
            )
            row = await cur.fetchone()
            assert row is not None
            got.append(row[0][0]["Plan"])
            raise psycopg.Rollback()
    finally:
        await conn.execute("DEALLOCATE plans_probe")
    return got


async def _claim_rows_plan(
    conn: psycopg.AsyncConnection[Any], params: dict[str, Any], log: Path, generic: bool
) -> Any:
    """The plan of the claim's rows statement (a custom or the generic one), from auto_explain,
    the claim rolled back."""
    plans_seen = await nested_plans(conn, log, Q["claim_work"], params, generic=generic)
    (plan,) = [
        doc["Plan"]
        for doc in plans_seen
        if doc.get("Query Text", "").lstrip().startswith("WITH gate")
    ]
    return plan


async def nested_plans(
    conn: psycopg.AsyncConnection[Any],
    log: Path,
    sql: LiteralString,
    params: dict[str, Any],
    *,
    generic: bool = False,
) -> list[Any]:
    """Run ``sql`` in a transaction rolled back, with auto_explain logging every statement it
    runs (those of the functions it calls too); their documents from the log."""
    await conn.execute("LOAD 'auto_explain'")
    mark = log.stat().st_size
    async with conn.transaction():
        for k, v in AUTO_EXPLAIN:
            await conn.execute(f"SET LOCAL auto_explain.{k} = {v}")
        if generic:
            await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        await conn.execute(sql, params)
        raise psycopg.Rollback()
    return logged_plans(log, mark)


def logged_plans(log: Path, mark: int) -> list[Any]:
    """The plans auto_explain wrote to the server's ``log`` after byte ``mark``, in order."""
    decoder = json.JSONDecoder()
    docs = []
    for chunk in log.read_text()[mark:].split("LOG:  duration:")[1:]:
        doc, _ = decoder.raw_decode(chunk[chunk.index("{") :])
        docs.append(doc)
    return docs


def line(name: str, results: list[tuple[str, float | None, float, list[Scan]]]) -> str:
    parts = []
    for kind, returned, total, scans in results:
        top = "; ".join(f"{n:,.0f} {what}" for n, what in scans[:2])
        parts.append(f"{kind}: {returned or 0:,.0f} rows, {total:,.0f} examined [{top}]")
    return f"{name:24} " + " | ".join(parts)


async def build(c: psycopg.AsyncConnection[Any], n: int, fresh: bool) -> None:
    """Statistics of a near-empty database, then: ``n`` reminders due in ten minutes (ready work),
    ``2n`` due a minute ago (``n`` claimed by another daemon under long leases, the rest delivered
    or dead 40 days ago, with their ledger rows), ``n`` a month ahead (pending), ``n`` tombstones,
    200 rows claimable now. ``fresh``: analysed again at the end."""
    await w.migrate_with_noop(c)
    for t in ("renewal_work", "reminder", "attempt", "retired", "daemon", "channel"):
        await c.execute(f"ALTER TABLE pgwork.{t} SET (autovacuum_enabled = off)")
    insert = (
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT 's' || (g %% 5), %s || g, now() + %s::interval, 'noop', 'r' "
        "FROM generate_series(1, %s) g"
    )
    await c.execute(insert, ("seed", "1 day", 50))
    await c.execute("ANALYZE")
    await c.execute(insert, ("soon", "10 minutes", n))
    await c.execute(insert, ("due", "-1 minute", 2 * n))
    await c.execute(insert, ("far", "30 days", n))
    await materialiser.run_once(c, lookahead=3600, page_size=5000)
    other = store.ClaimRequest(
        channel="noop", limit=1000, max_attempts=3, lease=timedelta(hours=1), daemon_id="other"
    )
    held = 0
    while held < n:
        held += len(await store.claim_work(c, other))
    for status, reason, which in (("delivered", None, "<> 0"), ("dead", "x", "= 0")):
        await c.execute(
            "UPDATE pgwork.renewal_work SET status = %s, dead_reason = %s, attempts = 1, lease = 1, "
            "finished_at = now() - interval '40 days', claimed_at = now(), claimed_by = 'x' "
            f"WHERE status = 'ready' AND due_at < now() AND id %% 10 {which}",
            (status, reason),
        )
    await c.execute(
        "INSERT INTO pgwork.attempt (work_id, lease, attempt, daemon_id, host, pid, started_at, "
        "finished_at, outcome) SELECT id, 1, 1, 'x', 'h', 1, now(), now(), 'delivered' "
        "FROM pgwork.renewal_work WHERE status = 'delivered'"
    )
    await c.execute(
        "INSERT INTO pgwork.retired (reminder_id, deadline, occurrence, status, operation_id, "
        "finished_at) SELECT -g, now(), '0', 'delivered', md5(g::text)::uuid, now() "
        "FROM generate_series(1, %s) g",
        (n,),
    )
    await c.execute(insert, ("now", "-1 second", 200))
    await materialiser.run_once(c, lookahead=0, page_size=5000)
    await c.execute(
        "INSERT INTO pgwork.daemon (id, host, pid, version) VALUES ('d1', 'h', 1, 'v') "
        "ON CONFLICT DO NOTHING"
    )
    await c.execute(insert, ("page", "-1 second", 3))  # left for the page below
    if fresh:
        await c.execute("ANALYZE")


async def page_statements(c: psycopg.AsyncConnection[Any], log: Path) -> list[str]:
    """One page (three reminders due now, claimed), its statements' plans from auto_explain."""
    await c.execute("LOAD 'auto_explain'")
    for k, v in AUTO_EXPLAIN:
        await c.execute(f"SET auto_explain.{k} = {v}")
    mark = log.stat().st_size
    take = store.ClaimRequest(
        channel="noop", limit=16, max_attempts=3, lease=timedelta(seconds=60), daemon_id="d1"
    )
    page, claimed = await store.materialise_page(
        c,
        coordinate=True,
        cutoff=None,
        lookahead=timedelta(0),
        after_at=None,
        after_id=0,
        limit=1000,
        take=[take],
    )
    await c.execute("SET auto_explain.log_min_duration = -1")
    out = [f"page: {page.scanned if page else 0} reminders paged, {len(claimed)} claimed"]
    for doc in logged_plans(log, mark):
        total, scans = examined(doc["Plan"])
        if scans:
            text = " ".join(doc.get("Query Text", "").split())[:40]
            out.append(line(f"  {text}", [("run", doc["Plan"].get("Actual Rows"), total, scans)]))
    return out


async def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.plans", description=__doc__)
    ap.add_argument("--pgbin", type=Path, help="PostgreSQL's bin directory (default: embedded)")
    ap.add_argument("--rows", type=int, default=20_000, help="scale (see build)")
    ap.add_argument("--fresh", action="store_true", help="analyse after building")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        srv = LocalServer(Path(tmp) / "data", a.pgbin)
        srv.start()
        try:
            dsn = srv.dsn()
            t0 = time.monotonic()
            async with await db.connect(dsn) as c:
                await build(c, a.rows, a.fresh)
                cur = await c.execute(
                    "SELECT status, count(*) FROM pgwork.renewal_work GROUP BY 1 ORDER BY 1"
                )
                counts = ", ".join(f"{s} {k:,}" for s, k in await cur.fetchall())
            print(f"built in {time.monotonic() - t0:.0f} s: work rows {counts}", flush=True)
            async with await db.connect(dsn) as c:
                for text in await page_statements(c, srv.data_dir / "server.log"):
                    print(text, flush=True)
                mine = await store.claim_work(
                    c,
                    store.ClaimRequest(
                        channel="noop",
                        limit=20,
                        max_attempts=3,
                        lease=timedelta(seconds=60),
                        daemon_id="d1",
                    ),
                )
                ids, leases = [r.id for r in mine], [r.lease for r in mine]
                cur = await c.execute(
                    "SELECT (SELECT id FROM pgwork.renewal_work WHERE status = 'dead' LIMIT 1), now()"
                )
                row = await cur.fetchone()
                assert row is not None
                dead, now = row
                old = now - timedelta(days=30)
                outcomes = (
                    "["
                    + ",".join(
                        f'{{"work_id":{r.id},"lease":{r.lease},"attempt":1,"channel":"noop",'
                        '"outcome":"delivered","status":"delivered","started_ago":0.01,'
                        '"finished_ago":0.0}'
                        for r in mine
                    )
                    + "]"
                )
                cases: dict[str, dict[str, Any]] = {
                    "next_fire_at": {"cutoff": now + timedelta(seconds=2)},
                    "claim_work": {
                        "channel": "noop", "daemon_id": "d1", "expire_after": None,
                        "lease": timedelta(seconds=60), "limit": 100, "max_attempts": 3,
                        "synchronous_commit": "off",
                    },
                    "next_available": {"channel": "noop"},
                    "record_outcomes": {
                        "outcomes": outcomes, "daemon_id": "d1", "host": "h", "pid": 1
                    },
                    "extend_leases": {
                        "work_id": ids, "lease_no": leases, "lease": timedelta(seconds=60)
                    },
                    "release_leases": {
                        "work_id": ids, "lease_no": leases, "daemon_id": "d1", "host": "h",
                        "pid": 1,
                    },
                    "daemon_heartbeat": {"id": "d1", "listener_up": True},
                    "work_states": {},
                    "lag": {},
                    "channel_states": {},
                    "retention_delete_batch": {
                        "after_at": None, "after_id": 0, "done_before": old, "dead_before": old,
                        "limit": 500,
                    },
                    "retention_backlog": {"done_before": old, "dead_before": old, "limit": 1000},
                    "dlq_list": {"channel": "noop", "limit": 50, "older_than": None, "source": None},
                    "dlq_redrive": {
                        "all": False, "ids": [dead], "channel": None, "since": None,
                        "reason_like": None, "operator": "op",
                    },
                    "work_get": {"id": dead},
                }  # fmt: skip
                for name, params in cases.items():
                    got = await plans(c, name, params, srv.data_dir / "server.log")
                    results = [
                        (kind, p.get("Actual Rows"), *examined(p))
                        for kind, p in zip(("custom", "generic"), got, strict=True)
                    ]
                    print(line(name, results), flush=True)
        finally:
            srv.stop()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
