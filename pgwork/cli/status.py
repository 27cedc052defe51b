"""`pgwork status`: what every daemon, channel and duty is doing, read from the database."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from typing import Any

import psycopg

from .. import db, store
from ..config import Config
from .channel import channel_row
from .common import (
    BACKLOG_COUNT_LIMIT,
    CliError,
    Database,
    cutoffs,
    fmt,
    table,
    to_json,
    with_conn,
)

#: How many late sources the text output names.
LATE_SOURCES_SHOWN = 5


def cmd_status(args: argparse.Namespace, cfg: Config) -> int:
    async def go(conn: psycopg.AsyncConnection[Any]) -> dict[str, Any]:
        await db.check_schema(conn)
        # First, and from the catalogs only: who locks pgwork's tables (the reads below would wait
        # behind them, up to the session's lock_timeout).
        holders = [asdict(h) for h in await store.lock_holders(conn)]
        try:
            await check_sources(conn)
            return {"lock_holders": holders, **await read(conn)}
        except psycopg.errors.LockNotAvailable:
            return {
                "lock_holders": holders or [asdict(h) for h in await store.lock_holders(conn)],
                "incomplete": True,
            }

    async def check_sources(conn: psycopg.AsyncConnection[Any]) -> None:
        """A health check naming a source that has no reminder (a misspelt name) would stay
        green for ever: it is an error of the check's, said as such (exit 2)."""
        if not args.source:
            return
        unknown = await store.sources_unknown(conn, sources=args.source)
        if unknown:
            raise CliError(
                f"--source {', '.join(unknown)}: no reminder has "
                f"{'this source' if len(unknown) == 1 else 'these sources'} "
                "(a misspelt name? `pgwork status` lists the late sources, `pgwork reminder` "
                "finds one by its source and key)",
                2,
            )

    async def read(conn: psycopg.AsyncConnection[Any]) -> dict[str, Any]:
        now = await store.db_now(conn)
        # Shown as they are: rows become plain mappings for the table and JSON printers.
        return {
            "work": [asdict(r) for r in await store.work_states(conn)],
            "lag": asdict(await store.lag(conn)),
            "lag_by_source": [asdict(r) for r in await store.lag_by_source(conn)],
            "set_aside": [asdict(r) for r in await store.set_aside_list(conn)],
            "lag_channel": await store.oldest_overdue_channel(conn),
            "materialiser": asdict(await store.materialiser_state(conn)),
            "daemons": [asdict(r) for r in await store.daemons(conn)],
            "retention": asdict(await store.retention_state(conn)),
            "channels": [channel_row(c) for c in await store.channel_states(conn)],
            "retention_backlog": await store.retention_backlog(
                conn, **cutoffs(cfg, now), limit=BACKLOG_COUNT_LIMIT
            ),
        }

    database = Database(cfg)
    try:
        st = with_conn(database.dsn, go, database.pooled)
    finally:
        database.close()
    holders = st["lock_holders"]
    if st.get("incomplete"):
        if args.json:
            print(to_json(st))
        else:
            print(_lock_holders(holders))
            print("status is incomplete: its reads waited for a lock past the lock timeout")
        return 4
    dead = sum(r["n"] for r in st["work"] if r["status"] == store.Status.DEAD)
    lag = st["lag"]["lag_seconds"]
    if args.json:
        print(to_json({**st, "dead_letters": dead}))
    else:
        print(table(st["work"], ["channel", "status", "n"]) if st["work"] else "no work rows")
        print(
            f"\nlag: {lag:.3f}s   oldest ready: {st['lag']['oldest_ready_seconds']:.3f}s   "
            f"due but not materialised: {st['lag']['unmaterialised_seconds']:.3f}s   "
            f"dead letters: {dead}"
        )
        late = [r for r in st["lag_by_source"] if r["lag_seconds"] > 0]
        if late:
            names = ", ".join(
                f"{r['source']} {r['lag_seconds']:.1f}s"
                + (" (not materialised)" if r["unmaterialised"] else "")
                for r in late[:LATE_SOURCES_SHOWN]
            )
            more = len(late) - LATE_SOURCES_SHOWN
            print(f"late sources: {names}" + (f" and {more} more" if more > 0 else ""))
        if st["set_aside"]:
            print(_set_aside(st["set_aside"]))
        m = st["materialiser"]
        age = m["cutoff_age_seconds"]
        where = (
            "never"
            if age is None
            else f"{age:.1f}s ago"
            if age >= 0
            else f"ahead by {-age:.1f}s (look-ahead)"
        )
        print(
            f"materialiser: last cutoff {fmt(m['last_cutoff'])} ({where}), "
            f"last pass {fmt(m['last_pass_at'])}, rows made in total {m['total_inserted']}"
        )
        held_back = [c for c in st["channels"] if c["state"] != "running" or c["next_retry_at"]]
        if held_back:
            print(
                "\n" + table(held_back, ["name", "state", "claimed", "next_retry_at", "why"]) + "\n"
            )
        r = st["retention"]
        backlog = st["retention_backlog"]
        backlog_s = f"at least {backlog}" if backlog >= BACKLOG_COUNT_LIMIT else str(backlog)
        print(
            f"retention: {'PAUSED, ' if r['paused'] else ''}last pass {fmt(r['last_pass_at'])}, "
            f"deleted {r['total_deleted']} in total, backlog {backlog_s}, "
            + (
                "nothing kept"
                if r["oldest_terminal_age_seconds"] is None
                else f"oldest kept {fmt(r['oldest_terminal_age_seconds'])}s"
            )
        )
        if st["daemons"]:
            shown = [
                {
                    **d,
                    "state": "GONE" if d["gone"] else "running",
                    "listener_up": "-"
                    if d["gone"]
                    else "off"
                    if d["listener_up"] is None
                    else d["listener_up"],
                }
                for d in st["daemons"]
            ]
            print(
                "\n"
                + table(
                    shown,
                    [
                        "id",
                        "state",
                        "version",
                        "started_at",
                        "heartbeat_age_seconds",
                        "listener_up",
                        "metrics_at",
                    ],
                )
            )
        else:
            print("no daemon has registered")
        if holders:
            print("\n" + _lock_holders(holders))
    if holders:
        return 4
    if args.max_lag is not None:
        over = [
            r
            for r in st["lag_by_source"]
            if r["lag_seconds"] > args.max_lag and (not args.source or r["source"] in args.source)
        ]
        # Without --source the overall lag decides, as before; it is each source's lag at most.
        if (lag > args.max_lag and not args.source) or over:
            worst = max([r["lag_seconds"] for r in over] or [lag])
            print(
                f"pgwork: lag {worst:.1f}s exceeds --max-lag {args.max_lag:g}s"
                + _late_sources(over)
                + ("" if args.source else _lag_cause(st)),
                file=sys.stderr,
            )
            return 1
    return 0


def _set_aside(rows: list[dict[str, Any]]) -> str:
    """The reminders set aside, one line each, with what to do."""
    lines = [
        f"SET ASIDE: the materialiser cannot make {len(rows)} reminder(s); fix or delete each "
        "(`pgwork reminder SOURCE KEY` shows why):"
    ]
    for r in rows:
        lines.append(
            f"  {r['source']} {r['business_key']} (id {r['reminder_id']}), due {fmt(r['fire_at'])}: "
            f"{r['error']} — since {fmt(r['since'])}, {r['tries']} tries, "
            f"{r['daemon_id']} tries again at {fmt(r['next_try_at'])}"
        )
    return "\n".join(lines)


def _late_sources(over: list[dict[str, Any]]) -> str:
    """The sources over the limit, latest first."""
    if not over:
        return ""
    names = ", ".join(
        f"source {r['source']} {r['lag_seconds']:.1f}s" for r in over[:LATE_SOURCES_SHOWN]
    )
    more = len(over) - LATE_SOURCES_SHOWN
    return f" ({names}" + (f" and {more} more" if more > 0 else "") + ")"


def _lock_holders(holders: list[dict[str, Any]]) -> str:
    """Who stops the daemon's statements, one line each."""
    lines = ["LOCKED: these sessions hold locks that stop claims, outcomes or the materialiser:"]
    # A table lock: "<mode> on <table>"; a lock a pgwork session waits for: what it waits on.
    for h in holders:
        lines.append("  " + store.LockHolder(**h).text())
    lines.append("  (end it with SELECT pg_terminate_backend(pid), or ask its owner to commit)")
    return "\n".join(lines)


def _lag_cause(st: dict[str, Any]) -> str:
    """Where the lag is: the oldest overdue row's channel, and whether it is paused (a receiver
    gone for good pauses its channel with 410: retire the channel if nobody will resume it)."""
    name = st.get("lag_channel")
    if name is None:
        return " (a reminder that is due has no work row yet: is a daemon running?)"
    chan = next((c for c in st["channels"] if c["name"] == name), None)
    if chan is not None and chan["state"] != "running":
        return (
            f" (the oldest overdue work is on channel {name}, {chan['state']}: {chan['why']}; "
            f"`pgwork channel resume {name}`, or `pgwork channel retire {name} --cancel` if "
            f"it is gone for good)"
        )
    return f" (the oldest overdue work is on channel {name})"
