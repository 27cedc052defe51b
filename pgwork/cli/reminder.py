"""`pgwork reminder SOURCE KEY`: what happened to one reminder."""

from __future__ import annotations

import argparse
from typing import Any

import psycopg

from ..config import Config
from ..history import History, reminder_history, took_ms
from .common import CliError, Database, fmt, table, to_json, with_conn


def cmd_reminder(args: argparse.Namespace, cfg: Config) -> int:
    database = Database(cfg)
    try:

        async def read(conn: psycopg.AsyncConnection[Any]) -> History:
            return await reminder_history(
                conn,
                source=args.source,
                business_key=args.business_key,
                limit=args.limit,
                expire_after=cfg.expire_after(),
            )

        h = with_conn(database.dsn, read, database.pooled)
    finally:
        database.close()
    if not h.known:
        raise CliError(
            f"no reminder {args.source!r} / {args.business_key!r}, and no work rows for one",
            1,
        )
    print(to_json(h.as_json()) if args.json else render(h))
    return 0


def render(h: History) -> str:
    out: list[str] = []
    r = h.reminder
    if r is None:
        out.append(f"reminder {h.source} / {h.business_key}: deleted (its work rows remain)")
    else:
        when = (
            f"due_local {fmt(r['due_local'])} {r['due_tz']}"
            if r["due_local"] is not None
            else f"due_at {fmt(r['due_at'])}"
        )
        out.append(f"reminder {r['id']}: {h.source} / {h.business_key}")
        out.append(
            f"  channel {r['channel']} · recipient {r['recipient']} · {when}"
            f" · remind_before {{{', '.join(fmt(b) for b in r['remind_before'])}}}"
            + (f" · recur {r['recur']}" if r["recur"] else "")
            + (" · PAUSED" if r["paused"] else "")
        )
        if h.upcoming_error is not None:
            out.append(
                f"  its next sends cannot be worked out ({h.upcoming_error}): the materialiser "
                "sets it aside and names it in its log; fix or delete the row"
            )
        if h.set_aside is not None:
            out.append(f"  {h.set_aside_text()}")
        if h.locked_by:
            out.append(f"  {h.locked_text()}")
        if h.upcoming:
            out += [
                "",
                ("next deadline of the series" if r["recur"] else "its deadline") + ", each send:",
                table(h.upcoming, ["send_at", "deadline", "remind_before", "state"]),
            ]
    for w in h.occurrences:
        out += [
            "",
            f"work {w['id']}: {w['state']} · deadline {fmt(w['deadline'])}"
            f" · send {fmt(w['due_at'])} ({fmt(w['occurrence'])} before)"
            f" · {w['attempts']} attempt(s) · operation {w['operation_id']}",
        ]
        if w["state"] == "retry waiting":
            out.append(f"  next try at {fmt(w['available_at'])}")
        if w["dead_reason"]:
            out.append(f"  dead: {w['dead_reason']}")
        if w["redriven_at"]:
            out.append(f"  last redriven {fmt(w['redriven_at'])} by {w['redriven_by']}")
        if w["attempts_ledger"]:
            out.append(
                table(
                    [{**a, "took": took_ms(a["took"])} for a in w["attempts_ledger"]],
                    [
                        "attempt",
                        "outcome",
                        "started_at",
                        "took",
                        "http_status",
                        "retry_at",
                        "error",
                    ],
                )
            )
    if h.retired:
        out += ["", "removed by retention (outcome kept, never sent again):"]
        out.append(table(h.retired, ["deadline", "occurrence", "status", "finished_at"]))
    return "\n".join(out)
