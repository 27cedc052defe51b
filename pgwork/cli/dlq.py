"""`pgwork dlq`: list, show and redrive dead letters; list what waits for a retry."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import psycopg

from .. import store
from ..config import Config
from ..history import attempts_text
from .common import (
    CliError,
    Database,
    fmt,
    operator_name,
    table,
    to_json,
    with_conn,
)


def cmd_dlq(args: argparse.Namespace, cfg: Config) -> int:
    database = Database(cfg)
    try:
        return int(_dlq(args, database.dsn, database.pooled))
    finally:
        database.close()


async def _channel_named(
    conn: psycopg.AsyncConnection[Any], channel: str | None, *, found: bool
) -> None:
    """A listing filtered by a channel that found nothing: a channel that does not exist is an
    error (a misspelt name must not read as "nothing wrong there"), as `channel pause` has it."""
    if channel is not None and not found and not await store.channel_exists(conn, channel):
        raise CliError(f"no channel named {channel!r} (`pgwork channel list` shows them)", 1)


def _dlq(args: argparse.Namespace, dsn: str, pooled: bool = False) -> int:
    if args.dlq_cmd == "list":
        older = timedelta(seconds=args.older_than) if args.older_than is not None else None

        async def lst(conn: psycopg.AsyncConnection[Any]) -> list[dict[str, Any]]:
            got = await store.dlq_list(
                conn,
                channel=args.channel,
                source=args.source,
                older_than=older,
                limit=args.limit,
            )
            await _channel_named(conn, args.channel, found=bool(got))
            return [asdict(r) for r in got]

        rows = with_conn(dsn, lst, pooled)
        if args.json:
            print(to_json(rows))
        elif rows:
            print(
                table(
                    [
                        {**r, "attempts": attempts_text(r["attempts"], r["attempts_base"])}
                        for r in rows
                    ],
                    [
                        "id",
                        "channel",
                        "source",
                        "business_key",
                        "due_at",
                        "attempts",
                        "finished_at",
                        "dead_reason",
                    ],
                )
            )
        else:
            print("no dead letters")
        return 0
    if args.dlq_cmd == "retrying":

        async def waiting(conn: psycopg.AsyncConnection[Any]) -> list[dict[str, Any]]:
            got = await store.retrying(conn, channel=args.channel, limit=args.limit)
            await _channel_named(conn, args.channel, found=bool(got))
            return got

        got = with_conn(dsn, waiting, pooled)
        if args.json:
            print(to_json(got))
        elif got:
            print(
                table(
                    got,
                    [
                        "id",
                        "channel",
                        "source",
                        "business_key",
                        "attempts",
                        "retry_at",
                        "last_error",
                    ],
                )
            )
        else:
            print("nothing waits for a retry")
        return 0
    if args.dlq_cmd == "show":

        async def show(
            conn: psycopg.AsyncConnection[Any],
        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            return (
                await store.work_get(conn, id=args.id),
                await store.work_attempts(conn, id=args.id),
            )

        work, attempts = with_conn(dsn, show, pooled)
        if not work:
            raise CliError(f"no work row with id {args.id}", 1)
        if args.json:
            print(to_json({"work": work[0], "attempts": attempts}))
        else:
            for k, v in work[0].items():
                print(f"{k:>14}: {fmt(v)}")
            print()
            print(
                table(
                    attempts,
                    [
                        "lease",
                        "attempt",
                        "outcome",
                        "retry_at",
                        "http_status",
                        "error_class",
                        "started_at",
                        "daemon_id",
                        "error",
                    ],
                )
                if attempts
                else "no attempts recorded"
            )
        return 0
    # redrive
    if not args.all and not args.ids:
        raise CliError("dlq redrive needs work ids or --all", 2)
    if (
        args.since is not None or args.reason_like is not None or args.source is not None
    ) and not args.all:
        raise CliError("dlq redrive: --since, --reason-like and --source select among --all", 2)
    operator = operator_name()

    async def redrive(
        conn: psycopg.AsyncConnection[Any],
    ) -> tuple[list[store.Redriven], dict[int, str]]:
        async with conn.transaction() as tx:
            got = await store.dlq_redrive(
                conn,
                all=bool(args.all),
                ids=args.ids or [],
                channel=args.channel,
                source=args.source,
                operator=operator,
                since=timedelta(seconds=args.since) if args.since is not None else None,
                reason_like=args.reason_like,
            )
            missed = [i for i in args.ids or [] if i not in {r.id for r in got}]
            statuses = {w.id: w.status for w in await store.work_statuses(conn, missed)}
            if args.dry_run:
                raise psycopg.Rollback(tx)
        return got, statuses

    verdicts, statuses = with_conn(dsn, redrive, pooled)
    found = {r.id for r in verdicts}
    ok = [r.id for r in verdicts if r.verdict == "ok"]
    refused = [r for r in verdicts if r.verdict != "ok"]
    for r in refused:
        print(
            f"pgwork: not redriven: work {r.id} belongs to a {r.verdict} reminder "
            f"({'deleted' if r.verdict == 'cancelled' else 'its deadline moved'}); it must not be sent",
            file=sys.stderr,
        )
    for i in args.ids or []:
        if i in found:
            continue
        if i in statuses:
            print(
                f"pgwork: not redriven: work {i} is not a dead letter (it is {statuses[i]})",
                file=sys.stderr,
            )
        else:
            print(
                f"pgwork: not redriven: work {i} does not exist (never made, or deleted by "
                "retention)",
                file=sys.stderr,
            )
    print(
        f"{'would redrive' if args.dry_run else 'redrove'} {len(ok)} dead "
        f"letter{'' if len(ok) == 1 else 's'}"
        + (f": {', '.join(map(str, ok))}" if ok and len(ok) <= 20 else "")
        + (" (a dry run: nothing was redriven)" if args.dry_run else "")
    )
    return 0 if not refused and len(found) >= len(set(args.ids or [])) else 1
