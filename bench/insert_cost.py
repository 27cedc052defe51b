"""What an app's INSERT of reminders costs, part by part (issue 70): ``python -m bench.insert_cost``.

One producer inserts N reminders due now (``--due now``) or in 60 days (``--due later``), 1,000
rows a statement, as the peer harness's enqueue does, into a fresh database per run. Each
variant takes one part of the table away (the NOTIFY trigger, the channel's foreign key, the
per-source index of fair making, the due index) so what each part costs is the difference with
``full``; ``notify_per_row`` puts back the NOTIFY trigger as it was before issue 70 (a call per
row), ``fk_per_statement`` is a candidate measured and not taken; ``bare`` is a table of the same
columns with nothing but its primary key, the floor.
Variants are interleaved round by round (A B C … A B C …) and each figure is the median.

    python -m bench.insert_cost [--rows 100000] [--rounds 3] [--due now|later] [--pgbin DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import anyio
import psycopg

from pgwork import migration
from pgwork.embedded import LocalServer

INSERT = (
    "INSERT INTO {table} (source, business_key, due_at, channel, recipient) "
    "SELECT 'app', %s || g, {due}, 'noop', 'r' FROM generate_series(%s::int, %s::int) g"
)

DUE = {"now": "now() - interval '1 minute'", "later": "now() + interval '60 days'"}

#: Each variant: DDL run on the fresh database before the timed inserts.
VARIANTS: dict[str, list[str]] = {
    "full": [],
    # Before issue 70: the NOTIFY trigger called once per row written within the hour.
    "notify_per_row": [
        "DROP TRIGGER reminder_notify_insert ON pgwork.reminder",
        "CREATE OR REPLACE TRIGGER reminder_notify AFTER INSERT OR UPDATE OF due_at, due_local, "
        "due_tz, remind_before, recur, recur_until, recur_skip, paused, channel ON pgwork.reminder "
        "FOR EACH ROW WHEN (coalesce(NEW.next_fire_at, NEW.due_at) <= now() + interval '1 hour') "
        "EXECUTE FUNCTION pgwork.reminder_notify()",
    ],
    "no_notify_trigger": ["DROP TRIGGER reminder_notify_insert ON pgwork.reminder"],
    "no_channel_fk": ["ALTER TABLE pgwork.reminder DROP CONSTRAINT reminder_channel_known"],
    # A candidate measured and not taken (the foreign key checked once per statement).
    "fk_per_statement": [
        "ALTER TABLE pgwork.reminder DROP CONSTRAINT reminder_channel_known",
        "CREATE FUNCTION pgwork.t_fk_stmt() RETURNS trigger LANGUAGE plpgsql AS $$ DECLARE bad text; "
        "BEGIN PERFORM FROM pgwork.channel c WHERE c.name IN (SELECT DISTINCT m.channel FROM made m) "
        "FOR KEY SHARE; SELECT m.channel INTO bad FROM made m WHERE NOT EXISTS (SELECT FROM "
        "pgwork.channel c WHERE c.name = m.channel) LIMIT 1; IF FOUND THEN RAISE EXCEPTION "
        "'unknown channel %', bad; END IF; RETURN NULL; END $$",
        "CREATE TRIGGER t_fk_stmt AFTER INSERT ON pgwork.reminder REFERENCING NEW TABLE AS made "
        "FOR EACH STATEMENT EXECUTE FUNCTION pgwork.t_fk_stmt()",
    ],
    "no_source_index": ["DROP INDEX pgwork.reminder_due_by_source"],
    "no_due_index": ["DROP INDEX pgwork.reminder_next_fire"],
    "bare": [
        "CREATE TABLE public.bare (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
        "source text NOT NULL, business_key text NOT NULL, due_at timestamptz NOT NULL, "
        "channel text NOT NULL, recipient text NOT NULL, payload jsonb NOT NULL DEFAULT '{}')"
    ],
}


def one(admin: str, template: str, variant: str, rows: int, due: str, n: int) -> float:
    """Rows a second of one run: a database from ``template``, the variant's DDL, the inserts."""
    name = f"ins_{variant}_{n}"
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    try:
        dsn = psycopg.conninfo.make_conninfo(admin, dbname=name)
        table = "public.bare" if variant == "bare" else "pgwork.reminder"
        with psycopg.connect(dsn, autocommit=True) as c:
            for ddl in VARIANTS[variant]:
                c.execute(ddl)
            c.execute("CHECKPOINT")
            sql = INSERT.format(table=table, due=DUE[due])
            t0 = time.perf_counter()
            for start in range(0, rows, 1000):
                c.execute(sql, ("k", start + 1, min(rows, start + 1000)))
            rate = rows / (time.perf_counter() - t0)
            got = c.execute(f"SELECT count(*) FROM {table}").fetchone()
            assert got is not None and got[0] == rows, (variant, got)
            return rate
    finally:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def make_template(admin: str, name: str = "ins_template") -> str:
    """A database with pgwork's schema and the channel the inserts name."""
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}"')
        c.execute(f'CREATE DATABASE "{name}"')

    async def setup() -> None:
        async with await psycopg.AsyncConnection.connect(
            psycopg.conninfo.make_conninfo(admin, dbname=name), autocommit=True
        ) as c:
            await migration.migrate(c)
            await c.execute("INSERT INTO pgwork.channel (name, kind) VALUES ('noop', 'python')")

    anyio.run(setup)
    return name


def measure(
    admin: str, variants: list[str], rows: int, rounds: int, due: str
) -> dict[str, list[float]]:
    """Each variant's rate in each round, the variants interleaved round by round."""
    template = make_template(admin)
    try:
        got: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(rounds):
            for v in variants:
                got[v].append(one(admin, template, v, rows, due, r))
        return got
    finally:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'DROP DATABASE "{template}"')


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.insert_cost", description=__doc__)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--due", choices=sorted(DUE), default="now")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--pgbin", help="bin directory of another PostgreSQL")
    p.add_argument("--out", help="append the result as one JSON line to this file")
    a = p.parse_args(argv)
    variants = a.variants.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="pgwork-insert-"))
    os.chmod(tmp, 0o755)
    server = LocalServer(tmp / "data", Path(a.pgbin) if a.pgbin else None)  # durable defaults
    server.start()
    try:
        admin = server.dsn()
        with psycopg.connect(admin) as c:
            row = c.execute("SHOW server_version").fetchone()
            version = str(row[0]) if row else "?"
        got = measure(admin, variants, a.rows, a.rounds, a.due)
        med = {v: statistics.median(x) for v, x in got.items()}
        print(f"PostgreSQL {version}, {a.rows} rows due {a.due}, {a.rounds} rounds (median rows/s)")
        for v in variants:
            rel = f"  {med[v] / med['full']:.2f}x full" if "full" in med else ""
            print(f"  {v:<20} {med[v]:>10,.0f}{rel}   ({', '.join(f'{x:,.0f}' for x in got[v])})")
        if a.out:
            with open(a.out, "a") as f:
                f.write(
                    json.dumps({"postgres": version, "due": a.due, "rows": a.rows, "runs": got})
                    + "\n"
                )
    finally:
        server.destroy()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
