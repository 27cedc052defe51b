"""pgwork benchmarks: ``python -m bench.run [--smoke | --quick] [--rounds N] [--only a,b]``.

Starts its own PostgreSQL at durable settings (server defaults: fsync and synchronous_commit
on) from the embedded wheel, or from ``--pgbin`` (e.g. Debian's PostgreSQL 15), or uses
``--dsn``. Every workload runs in each round, rounds interleaved; the table shows median, min and
max over rounds, and the run is written to ``bench/results/<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import psycopg

import pgwork
from pgwork import db, eventloop, migration
from pgwork.embedded import LocalServer

from . import noop
from . import workloads as w
from .cpu import _stat

ORDER = [
    "burndown",
    "latency",
    "webhook",
    "webhook_wide",
    "morning",
    "morning_group",
    "webhook_group",
    "lateness",
    "materialise",
    "retention",
    "app_insert",
    "series",
    "rent_day",
    "scale",
    "gauges",
    "daemons",
    "fairness",
    "memory",
]

#: (workload, figure, comparison, target) checked at the end of a run.
TARGETS = [
    ("lateness", "late_p99_ms", "<=", 50.0),
    ("materialise", "ratio_to_bare", ">=", 0.70),
    ("materialise", "longest_txn_ms", "<=", 1000.0),
    ("retention", "burndown_ratio_with_retention", ">=", 0.80),
    ("retention", "longest_batch_ms", "<=", 500.0),
    ("retention", "longest_batch_during_burndown_ms", "<=", 500.0),
    ("scale", "burndown_ratio", ">=", 0.85),
    ("scale", "latency_p50_ratio", ">=", 0.85),
    ("gauges", "refresh_ratio", ">=", 0.85),
    ("app_insert", "ratio", ">=", 0.80),
    ("series", "longest_txn_ms", "<=", 1000.0),
    ("series", "made_ahead", "<=", 0.0),
    ("series", "ratio_to_oneoff", ">=", 0.50),
    ("rent_day", "made_before_instant", ">=", 1.0),
    ("rent_day", "next_month_rows", "<=", 0.0),
    ("rent_day", "made_too_early", "<=", 0.0),
    ("memory", "peak_rss_mb", "<=", 150.0),
    ("memory", "rss_growth_pct", "<=", 5.0),
]


def postmaster_of(dsn: str) -> int | None:
    """The postmaster's pid, when the server runs on this machine (a backend's parent, read
    while the backend lives: once its connection closes it may be gone)."""
    with psycopg.connect(dsn) as c:
        row = c.execute("SELECT pg_backend_pid()").fetchone()
        st = _stat(row[0]) if row else None
    return st[0] if st is not None else None  # None: another machine's server


def server_facts(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn) as c:
        version = c.execute("SELECT version()").fetchone()
        settings = c.execute(
            "SELECT name, setting FROM pg_settings WHERE source NOT IN ('default', 'override') "
            "OR name IN ('fsync', 'synchronous_commit', 'shared_buffers', 'max_connections') ORDER BY name"
        ).fetchall()
    return {"postgres": version[0] if version else "?", "settings": dict(settings)}


async def make_template(admin_dsn: str) -> str:
    name = f"pgwork_bench_tpl_{os.getpid()}"
    async with await psycopg.AsyncConnection.connect(admin_dsn, autocommit=True) as c:
        await c.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await c.execute(f'CREATE DATABASE "{name}"')
    async with await db.connect(psycopg.conninfo.make_conninfo(admin_dsn, dbname=name)) as c:
        await migration.migrate(c)
        await c.execute(
            "INSERT INTO pgwork.channel (name, kind) VALUES ('noop', 'python'), ('hook', 'webhook')"
        )
    return name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--smoke", action="store_true", help="tiny sizes, one round: checks the harness runs"
    )
    mode.add_argument("--quick", action="store_true", help="medium sizes (minutes, not an hour)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3; 1 with --smoke)")
    p.add_argument("--only", help="comma-separated workloads: " + ",".join(ORDER))
    p.add_argument("--dsn", help="an existing server (admin DSN that may create databases)")
    p.add_argument(
        "--pgbin", help="bin directory of another PostgreSQL (e.g. /usr/lib/postgresql/15/bin)"
    )
    p.add_argument(
        "--out", default=str(Path(__file__).parent / "results"), help="directory for the JSON"
    )
    p.add_argument(
        "--loop",
        choices=("auto", "uvloop", "asyncio"),
        default="auto",
        help="the event loop, as daemon.event_loop (default auto: what the daemon runs on)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SIZE=N",
        help="override one size, e.g. --set burndown=20000 (names: see bench/README.md)",
    )
    a = p.parse_args(argv)
    sizes = w.SMOKE if a.smoke else w.QUICK if a.quick else w.FULL
    for item in a.set:
        key, _, value = item.partition("=")
        if key not in w.Sizes.__dataclass_fields__:
            p.error(f"--set: unknown size {key!r}")
        sizes = replace(sizes, **{key: type(getattr(sizes, key))(value)})
    rounds = a.rounds or (1 if a.smoke else 3)
    only = [x for x in (a.only.split(",") if a.only else ORDER)]
    unknown = set(only) - set(ORDER)
    if unknown:
        p.error(f"unknown workloads: {', '.join(sorted(unknown))}")

    server = None
    tmp = None
    if a.dsn:
        admin = a.dsn
    else:
        tmp = Path(tempfile.mkdtemp(prefix="pgwork-bench-"))
        os.chmod(tmp, 0o755)
        server = LocalServer(
            tmp / "data", Path(a.pgbin) if a.pgbin else None
        )  # server defaults: durable
        server.start()
        admin = server.dsn()
    try:
        return anyio.run(
            run,
            admin,
            sizes,
            rounds,
            only,
            Path(a.out),
            "smoke" if a.smoke else "quick" if a.quick else "full",
            backend="asyncio",
            backend_options={"use_uvloop": eventloop.use_uvloop(a.loop)},
        )
    finally:
        if server is not None:
            server.destroy()
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


async def run(
    admin: str, sizes: w.Sizes, rounds: int, only: list[str], out: Path, mode: str
) -> int:
    facts = server_facts(admin)
    template = await make_template(admin)
    ctx = w.Ctx(admin, template, postmaster_of(admin), sizes)
    meta = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "mode": mode,
        "rounds": rounds,
        "pgwork": pgwork.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cores": os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "sizes": sizes.__dict__,
        **facts,
        "daemon": {"concurrency": w.CONCURRENCY, "claim_batch": w.CLAIM_BATCH},
        "event_loop": eventloop.name(),
    }
    print(
        f"# pgwork {meta['pgwork']} bench ({mode}, {rounds} rounds) on {facts['postgres'].split(',')[0]}, "
        f"{meta['cores']} cores, {meta['event_loop']}; fsync={facts['settings'].get('fsync')} "
        f"synchronous_commit={facts['settings'].get('synchronous_commit')}",
        flush=True,
    )
    results: list[dict[str, Any]] = []
    scale_tpl = None
    gauge_tpls: tuple[str, str] | None = None
    try:
        if "gauges" in only:
            t0 = time.monotonic()
            gauge_tpls = (
                await w.build_gauges_template(ctx, 0),
                await w.build_gauges_template(ctx, sizes.gauges_retained),
            )
            print(
                f"  (gauge databases: {w.GAUGES_LIVE} live and {w.GAUGES_DEAD} dead rows, with 0 "
                f"and {sizes.gauges_retained} delivered rows, built in {time.monotonic() - t0:.0f}s)",
                flush=True,
            )
        if "scale" in only:
            t0 = time.monotonic()
            scale_tpl = await w.build_scale_template(ctx)
            print(
                f"  (scale template: {sizes.scale_far} far-future reminders, {sizes.scale_terminal} "
                f"terminal rows, built in {time.monotonic() - t0:.0f}s)",
                flush=True,
            )
        for r in range(rounds):
            ctx.round_figures = {}
            for name in only:
                if name == "memory":
                    continue  # once, after the rounds
                noop.CALLED.clear()
                t0 = time.monotonic()
                if name == "scale":
                    assert scale_tpl is not None
                    fig = await w.w_scale(ctx, scale_tpl)
                elif name == "gauges":
                    assert gauge_tpls is not None
                    fig = await w.w_gauges(ctx, *gauge_tpls)
                else:
                    fig = await getattr(w, f"w_{name}")(ctx)
                if name == "latency":
                    ctx.round_figures["lat_p50_ms"] = fig["lat_p50_ms"]
                results.append({"round": r + 1, "workload": name, **fig})
                print(
                    f"  round {r + 1} {name:<12} {time.monotonic() - t0:6.1f}s  "
                    + "  ".join(f"{k}={_fmt(v)}" for k, v in fig.items()),
                    flush=True,
                )
        if "memory" in only:
            bd = [x["jobs_per_s"] for x in results if x["workload"] == "burndown"]
            rate = (statistics.median(bd) if bd else 2000.0) / 2
            fig = await w.w_memory(ctx, rate)
            results.append({"round": 1, "workload": "memory", **fig})
            print(
                "  memory       " + "  ".join(f"{k}={_fmt(v)}" for k, v in fig.items()), flush=True
            )
    finally:
        for tpl in (template, scale_tpl, *(gauge_tpls or ())):
            if tpl:
                ctx.drop(tpl)

    table = summarise(results)
    print()
    print(render(table))
    checks = check_targets(table)
    if checks:
        print("\ntargets (medians):")
        for c in checks:
            print(
                f"  {'PASS' if c['pass'] else 'MISS'}  {c['workload']}.{c['figure']} = {_fmt(c['value'])} "
                f"(target {c['op']} {c['target']:g})"
            )
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{meta['when'].replace(':', '')}-{mode}.json"
    path.write_text(
        json.dumps(
            {"meta": meta, "results": results, "summary": table, "targets": checks},
            indent=2,
            default=str,
        )
    )
    print(f"\nresults: {path}")
    return 0


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name in ORDER:
        mine = [r for r in results if r["workload"] == name]
        if not mine:
            continue
        for fig in mine[0]:
            if fig in ("round", "workload"):
                continue
            vals = [r[fig] for r in mine if isinstance(r.get(fig), int | float)]
            if not vals:
                continue
            rows.append(
                {
                    "workload": name,
                    "figure": fig,
                    "median": statistics.median(vals),
                    "min": min(vals),
                    "max": max(vals),
                    "n": len(vals),
                }
            )
    return rows


def check_targets(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for wl, fig, op, target in TARGETS:
        row = next((r for r in table if r["workload"] == wl and r["figure"] == fig), None)
        if row is None:
            continue
        v = row["median"]
        ok = v >= target if op == ">=" else v <= target
        out.append(
            {
                "workload": wl,
                "figure": fig,
                "value": v,
                "op": op,
                "target": target,
                "pass": bool(ok),
            }
        )
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def render(table: list[dict[str, Any]]) -> str:
    head = ["workload", "figure", "median", "min", "max", "n"]
    cells = [
        [r["workload"], r["figure"], _fmt(r["median"]), _fmt(r["min"]), _fmt(r["max"]), str(r["n"])]
        for r in table
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    lines = [
        "| " + " | ".join(h.ljust(wd) for h, wd in zip(head, widths, strict=True)) + " |",
        "|" + "|".join("-" * (wd + 2) for wd in widths) + "|",
    ]
    lines += [
        "| " + " | ".join(c.ljust(wd) for c, wd in zip(row, widths, strict=True)) + " |"
        for row in cells
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
