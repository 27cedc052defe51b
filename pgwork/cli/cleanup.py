"""`pgwork cleanup`: one retention pass (the systemd timer runs it)."""

from __future__ import annotations

import argparse
from typing import Any

import psycopg

from .. import db, logs, store
from ..config import Config
from .common import (
    CliError,
    Database,
    with_conn,
)


def cmd_cleanup(args: argparse.Namespace, cfg: Config) -> int:
    from ..duties.retention import Retention

    # retention.dsn alone (the cleanup timer's environment) names the database: no other one.
    database = None if cfg.retention_dsn else Database(cfg)
    dsn = cfg.retention_dsn or (database.dsn if database else "")
    pooled = cfg.pooler == "transaction"

    async def go(conn: psycopg.AsyncConnection[Any]) -> tuple[str, dict[str, Any]]:
        await db.check_schema(conn)
        if args.pause or args.resume:
            await store.retention_set_paused(conn, paused=bool(args.pause))
            return (
                "retention paused (every daemon stops at its next batch)"
                if args.pause
                else "retention resumed"
            ), {}
        r = Retention(cfg.retention)
        res = await r.run_once(conn, summary=False)
        if res.paused:
            raise CliError("retention is paused (`pgwork cleanup --resume` resumes it)", 1)
        return (
            f"deleted {res.deleted} work rows and {res.ledger_deleted} ledger rows in {res.batches} batches "
            f"({res.duration:.2f}s, longest batch {res.longest_batch * 1000:.0f} ms, {res.timeouts} timeouts)"
        ), {
            "deleted": res.deleted,
            "ledger_deleted": res.ledger_deleted,
            "batches": res.batches,
            "timeouts": res.timeouts,
        }

    try:
        text, fields = with_conn(dsn, go, pooled)
        logs.say(text, **fields)
    finally:
        if database is not None:
            database.close()
    return 0
