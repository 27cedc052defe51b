"""What an idle pgwork costs the primary (issue 70): ``python -m bench.idle``.

For each shape (daemons by channels), a scratch server at its defaults (plus
``pg_stat_statements``, which writes nothing), ``pgwork migrate``, then the daemons as
processes of their own (``pgwork run``, ``log`` channels, metrics on their own ports,
retention on, nothing scheduled). After a warm-up, a ``CHECKPOINT`` and then the window: WAL
bytes (``pg_current_wal_insert_lsn``), its records and full-page images by resource manager
(``pg_walinspect``), transactions committed, row writes per table (``pg_stat_user_tables``) and
the statements that wrote WAL (``pg_stat_statements``' ``wal_bytes``), each a minute.

The window starts at a checkpoint, so it counts the full-page images of every page touched
again after one, as a server at its defaults pays them once per ``checkpoint_timeout``
(5 minutes): a window of 5 minutes is that cycle; a shorter one overstates them.

Runs against whichever ``pgwork`` is importable from the working directory, so the same file
measures an older tree::

    cd <tree> && python /path/to/this/bench/idle.py --minutes 5 --pgbin ...
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import psycopg

from pgwork.embedded import LocalServer

SETTINGS = {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all"}

WAL_BY_KIND = """
SELECT "resource_manager/record_type" AS kind, count, record_size, fpi_size
  FROM pg_get_wal_stats(%(start)s::pg_lsn, %(end)s::pg_lsn, true)
 WHERE count > 0
 ORDER BY record_size + fpi_size DESC
"""

TABLES = """
SELECT schemaname || '.' || relname, n_tup_ins, n_tup_upd, n_tup_del, n_tup_hot_upd,
       autovacuum_count + vacuum_count, autoanalyze_count + analyze_count
  FROM pg_stat_all_tables
 WHERE schemaname = 'pgwork' OR autovacuum_count + autoanalyze_count > 0
"""

STATEMENTS = """
SELECT regexp_replace(left(query, 72), '\\s+', ' ', 'g') AS query, calls, wal_records, wal_fpi,
       wal_bytes::bigint AS wal_bytes
  FROM pg_stat_statements
 WHERE wal_bytes > 0
 ORDER BY wal_bytes DESC
 LIMIT 12
"""

# PostgreSQL 16 and later: which relations the window's records touched (a record touching
# several blocks counts once per block) and the page images each took.
BY_RELATION = """
SELECT coalesce(d.datname || ':', '') || coalesce(pg_filenode_relation(b.reltablespace, b.relfilenode)::regclass::text,
                b.relfilenode::text) AS rel, b.resource_manager || '/' || b.record_type AS kind,
       count(*) AS blocks, coalesce(sum(length(b.block_fpi_data)), 0) AS fpi
  FROM pg_get_wal_block_info(%(start)s::pg_lsn, %(end)s::pg_lsn) AS b
  LEFT JOIN pg_database d ON d.oid = b.reldatabase AND d.datname <> current_database()
 GROUP BY 1, 2
 ORDER BY count(*) DESC
 LIMIT 16
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(channels: int, port: int) -> str:
    chans = "".join(f'[channels.log{i}]\nkind = "log"\n' for i in range(channels))
    return f'[metrics]\nlisten = "127.0.0.1:{port}"\n[log]\nlevel = "warning"\n{chans}'


def pgwork(dsn: str, cfg: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "pgwork", "--config", str(cfg), *args],
        env={**os.environ, "PGWORK_DSN": dsn, "PYTHONPATH": os.getcwd()},
        stdout=subprocess.DEVNULL,
    )


def snapshot(c: psycopg.Connection[Any]) -> dict[str, Any]:
    lsn = c.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    xacts = c.execute(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()
    c.execute("SELECT pg_stat_force_next_flush()" if _has_flush(c) else "SELECT 1")
    tables = {r[0]: r[1:] for r in c.execute(TABLES).fetchall()}
    return {"lsn": lsn[0] if lsn else None, "xacts": xacts[0] if xacts else 0, "tables": tables}


def _has_flush(c: psycopg.Connection[Any]) -> bool:
    row = c.execute(
        "SELECT count(*) FROM pg_proc WHERE proname = 'pg_stat_force_next_flush'"
    ).fetchone()
    return bool(row and row[0])


def start_pgwork(dsn: str, daemons: int, channels: int, tmp: Path) -> list[subprocess.Popen[bytes]]:
    cfgs = []
    for i in range(daemons):
        cfg = tmp / f"d{i}.toml"
        cfg.write_text(config(channels, free_port()))
        cfgs.append(cfg)
    if pgwork(dsn, cfgs[0], "migrate").wait(timeout=300) != 0:
        raise SystemExit("pgwork migrate failed")
    return [pgwork(dsn, cfg, "run") for cfg in cfgs]


def start_peer(dsn: str, python: str, kind: str, consumers: int) -> list[subprocess.Popen[bytes]]:
    script = str(Path(__file__).with_name("peer_idle.py"))
    first = subprocess.Popen([python, script, kind, dsn])
    time.sleep(5)  # its schema installed before the others start
    return [first] + [subprocess.Popen([python, script, kind, dsn]) for _ in range(consumers - 1)]


def measure(
    srv: LocalServer,
    start: Callable[[str], list[subprocess.Popen[bytes]]],
    warmup: float,
    minutes: float,
    settle: float = 70.0,
) -> dict[str, Any]:
    dsn = srv.dsn()
    procs = start(dsn)
    try:
        time.sleep(warmup)
        with psycopg.connect(dsn, autocommit=True) as c:
            for ext in ("pg_walinspect", "pg_stat_statements"):
                c.execute(f"CREATE EXTENSION IF NOT EXISTS {ext}")
            # A server idle for days: autovacuum has analysed every database (template1's
            # catalogues too: 90 kB of WAL when it comes to them), cleaned what initdb and the
            # migration left and set every page's hint bits; done now, so that the window counts
            # the consumers' writes, not the aftermath of the set-up.
            dbs = c.execute("SELECT datname FROM pg_database WHERE datallowconn").fetchall()
            for (name,) in dbs:
                with psycopg.connect(srv.dsn(name), autocommit=True) as other:
                    other.execute("ANALYZE")
                    other.execute("VACUUM (FREEZE)")
            snapshot(
                c
            )  # its own reads set their hint bits before the checkpoint, not in the window
        time.sleep(settle)  # autovacuum's turn after those (autovacuum_naptime: 1 minute)
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("SELECT pg_stat_statements_reset()")
            c.execute("CHECKPOINT")
            before = snapshot(c)
        time.sleep(minutes * 60)
        with psycopg.connect(dsn, autocommit=True) as c:
            after = snapshot(c)
            args = {"start": before["lsn"], "end": after["lsn"]}
            wal = int(c.execute("SELECT %(end)s::pg_lsn - %(start)s::pg_lsn", args).fetchone()[0])  # type: ignore[index]
            kinds = c.execute(WAL_BY_KIND, args).fetchall()
            stmts = c.execute(STATEMENTS).fetchall()
            has_blocks = c.execute(
                "SELECT count(*) > 0 FROM pg_proc WHERE proname = 'pg_get_wal_block_info'"
            ).fetchone()
            rels = c.execute(BY_RELATION, args).fetchall() if has_blocks and has_blocks[0] else []
        if not all(p.poll() is None for p in procs):
            raise SystemExit("a consumer exited during the window")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
    per = 1 / minutes
    writes = {
        t: [
            round((a - b) * per, 1)
            for a, b in zip(after["tables"][t], before["tables"].get(t, (0,) * 6), strict=True)
        ]
        for t in after["tables"]
        if after["tables"][t] != before["tables"].get(t)
    }
    return {
        "minutes": minutes,
        "wal_bytes_per_min": round(wal * per),
        "records_per_min": round(sum(k[1] for k in kinds) * per, 1),
        "fpi_bytes_per_min": round(sum(k[3] for k in kinds) * per),
        "commits_per_min": round((after["xacts"] - before["xacts"]) * per, 1),
        "by_kind": [
            [k[0], round(k[1] * per, 1), round(k[2] * per), round(k[3] * per)] for k in kinds
        ],
        "writes_per_min": writes,
        "statements": [[s[0], round(s[1] * per, 1), round(s[4] * per)] for s in stmts],
        "by_relation": [[r[0], r[1], round(r[2] * per, 1), round(r[3] * per)] for r in rels],
    }


def report(r: dict[str, Any]) -> str:
    out = [
        f"{r['system']}: {r['consumers']} consumer(s), {r['channels']} channel(s), "
        f"{r['server']}, {r['minutes']} min: "
        f"{r['wal_bytes_per_min'] / 1000:.1f} kB WAL/min ({r['fpi_bytes_per_min'] / 1000:.1f} kB of "
        f"page images), {r['records_per_min']} records/min, {r['commits_per_min']} commits/min"
    ]
    for kind, n, size, fpi in r["by_kind"]:
        out.append(f"    {kind:<32} {n:>7} records {size:>8} B {fpi:>8} B images")
    for t, (ins, upd, dele, hot, vac, an) in r["writes_per_min"].items():
        out.append(
            f"    {t:<32} ins {ins} upd {upd} (hot {hot}) del {dele} vacuums {vac} analyses {an} a minute"
        )
    for rel, kind, n, fpi in r.get("by_relation", []):
        out.append(f"    {rel:<40} {kind:<24} {n:>6} blocks {fpi:>7} B images")
    for q, calls, wal in r["statements"]:
        out.append(f"    {calls:>6} calls {wal:>8} B  {q}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pgbin", type=Path, help="server binaries (default: the embedded ones)")
    ap.add_argument("--minutes", type=float, default=5.0, help="the window (default 5)")
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds before the set-up's clean")
    ap.add_argument("--daemons", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--channels", type=int, nargs="+", default=[1, 10])
    ap.add_argument(
        "--peers",
        metavar="PYTHON",
        help="also pgqueuer's and the raw reference's idle consumers, run by this interpreter "
        "(the peers' venv of ../shared/bench-peers/run.sh)",
    )
    ap.add_argument("--peers-only", action="store_true", help="measure only the peers")
    ap.add_argument("--out", type=Path, help="append each result as a JSON line")
    a = ap.parse_args()
    shapes = [] if a.peers_only else [("pgwork", d, ch) for d in a.daemons for ch in a.channels]
    if a.peers:
        shapes += [(kind, d, 1) for d in a.daemons for kind in ("pgqueuer", "ref")]
    for system, consumers, channels in shapes:
        with tempfile.TemporaryDirectory(prefix="pgwork-idle-") as tmp:
            srv = LocalServer(Path(tmp) / "data", a.pgbin, settings=SETTINGS)
            srv.start()
            try:
                if system == "pgwork":
                    start = partial(
                        start_pgwork, daemons=consumers, channels=channels, tmp=Path(tmp)
                    )
                else:
                    start = partial(start_peer, python=a.peers, kind=system, consumers=consumers)
                r = measure(srv, start, a.warmup, a.minutes)
            finally:
                srv.stop()
        r.update(
            system=system, consumers=consumers, channels=channels, server=str(a.pgbin or "embedded")
        )
        print(report(r), flush=True)
        if a.out:
            with a.out.open("a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
