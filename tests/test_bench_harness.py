"""The benchmark harness's own measuring parts, where a wrong reading would pass unnoticed as a
figure (bench/README.md quotes them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import psycopg

from bench import costs
from bench.run import postmaster_of
from pgwork.embedded import LocalServer


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return int(data[data.rfind(b")") + 2 :].split()[1])


def test_the_postmaster_is_found_on_every_call(admin_dsn: str) -> None:
    """The CPU split meters the postmaster's children; without its pid, Postgres's share reads
    as 0.0 cores. The pid comes from a backend's parent, read while that backend lives: read
    after the connection closed, the backend had sometimes exited, and on a busy machine (the
    bench's, and this test's: a busy process per core) most runs of 200 calls got a None."""
    with psycopg.connect(admin_dsn) as c:
        row = c.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        postmaster = _parent_of(row[0])
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        found = [postmaster_of(admin_dsn) for _ in range(200)]
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert found == [postmaster] * 200


def test_the_costs_count_a_statement_run_inside_a_function_once() -> None:
    """bench.costs' totals per job: with ``pg_stat_statements.track = all`` an INSERT inside a
    function has a row of its own and is counted again in its caller's, so adding every row
    read a tree whose claim runs its rows in a function (pgwork.claim_rows) ~50% high in WAL and
    execution time against one without (issue 41's A/B against 993e7db)."""
    root = Path(tempfile.mkdtemp(prefix="pgwork-costs-"))
    root.chmod(0o755)
    pgbin = os.environ.get("PGWORK_TEST_PGBIN")
    server = LocalServer(root / "data", Path(pgbin) if pgbin else None, settings=costs.SETTINGS)

    async def measure(dsn: str) -> tuple[dict[str, float], list[dict[str, Any]]]:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
            await c.execute("CREATE EXTENSION pg_stat_statements")
            await c.execute("CREATE TABLE t (x int)")
            await c.execute(
                "CREATE FUNCTION f() RETURNS void LANGUAGE plpgsql"
                " AS $$ BEGIN INSERT INTO t VALUES (1); END $$"
            )
            await c.execute("SELECT pg_stat_statements_reset()")
            for _ in range(20):
                await c.execute("SELECT f()")
            rows = await costs.statements(c)
        return costs.totals(rows, 20), rows

    try:
        server.start()
        per_job, rows = anyio.run(measure, server.dsn())
    finally:
        server.destroy()
        shutil.rmtree(root, ignore_errors=True)
    (caller,) = [r for r in rows if r["statement"] == "SELECT f()"]
    (inside,) = [r for r in rows if str(r["statement"]).startswith("INSERT INTO t")]
    assert caller["toplevel"] and not inside["toplevel"]
    assert inside["calls"] == 20 and inside["wal_records"] == caller["wal_records"] > 0
    assert per_job["wal_records"] * 20 == caller["wal_records"]


def test_every_insert_cost_variant_applies_to_this_schema(admin_dsn: str) -> None:
    """bench.insert_cost takes parts of pgwork.reminder away by name (its triggers, its foreign
    key, its indexes): a part renamed would make a variant fail, not read as a figure. Each
    variant runs once, with few rows, and inserts every row."""
    from bench import insert_cost

    got = insert_cost.measure(admin_dsn, list(insert_cost.VARIANTS), rows=2000, rounds=1, due="now")
    assert sorted(got) == sorted(insert_cost.VARIANTS)
    assert all(len(r) == 1 and r[0] > 0 for r in got.values()), got
