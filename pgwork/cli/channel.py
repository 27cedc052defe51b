"""`pgwork channel`: list, pause, resume and retire channels."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

import psycopg

from .. import db, store
from ..config import Config
from ..history import channel_state
from .common import (
    CliError,
    Database,
    operator_name,
    table,
    to_json,
    with_conn,
)

CHANNEL_COLUMNS = [
    "name",
    "kind",
    "state",
    "claimed",
    "next_retry_at",
    "rate_limit",
    "global_concurrency",
    "catch_up",
    "why",
]


def channel_row(c: store.ChannelState) -> dict[str, Any]:
    """A channel as the list and status show it: its state in a word, and why."""
    state, why = channel_state(c)
    return {**asdict(c), "state": state, "why": why}


def cmd_channel(args: argparse.Namespace, cfg: Config) -> int:
    database = Database(cfg)

    async def go(conn: psycopg.AsyncConnection[Any]) -> Any:
        await db.check_schema(conn)
        if args.channel_cmd == "list":
            return [channel_row(c) for c in await store.channel_states(conn)]
        if args.channel_cmd == "retire":
            try:
                return await store.channel_retire(conn, channel=args.name, cancel=args.cancel)
            except psycopg.errors.InsufficientPrivilege:
                raise CliError(
                    "retiring a channel deletes rows the daemon's role may not: run it as the "
                    "schema's owner (the role that runs `pgwork migrate`)",
                    2,
                ) from None
        try:
            if args.channel_cmd == "pause":
                return await store.channel_pause(
                    conn, channel=args.name, reason=args.reason, actor=operator_name()
                )
            return await store.channel_resume(conn, channel=args.name, actor=operator_name())
        except psycopg.errors.NoDataFound:
            raise CliError(
                f"no channel named {args.name!r} (`pgwork channel list` shows them)", 1
            ) from None

    try:
        got = with_conn(database.dsn, go, database.pooled)
    finally:
        database.close()
    if args.channel_cmd == "list":
        if args.json:
            print(to_json(got))
        else:
            print(table(got, CHANNEL_COLUMNS) if got else "no channels registered")
    elif args.channel_cmd == "retire":
        return _retired(args.name, got, args.cancel)
    elif args.channel_cmd == "pause":
        print(
            f"paused channel {args.name}: every daemon holds its work until `pgwork channel resume`"
            if got
            else f"channel {args.name} was already paused"
        )
    else:
        print(
            f"resumed channel {args.name}"
            if got
            else f"channel {args.name} was not paused or throttled"
        )
    return 0


def _retired(name: str, use: store.ChannelUse | None, cancel: bool) -> int:
    if use is None:
        raise CliError(f"no channel named {name!r} (`pgwork channel list` shows them)", 1)
    if (use.reminders or use.live) and not cancel:
        raise CliError(
            f"channel {name} is still used: {use.reminders} reminder(s), {use.live} live work "
            f"row(s), {use.moved} of reminders since moved to another channel; pass --cancel to "
            f"delete those reminders and cancel their work (never sent; the moved ones go to "
            f"their channel). Nothing was changed.",
            1,
        )
    print(
        f"retired channel {name}"
        + (
            f"; deleted its {use.reminders} reminder(s) and cancelled {use.live} live work "
            f"row(s) (never sent; a delivery in flight is fenced)"
            if cancel
            else ""
        )
        + (
            f"; {use.moved} live row(s) of reminders since moved to another channel went there"
            if use.moved
            else ""
        )
        + (
            f". Still served by {', '.join(use.served_by)}: each stops claiming it now; remove it "
            "from their config, or a restart registers it again."
            if use.served_by
            else ". Remove it from every daemon's config: a daemon that still has it registers "
            "it again."
        )
    )
    return 0
