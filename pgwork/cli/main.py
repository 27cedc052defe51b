"""The parser, the command table, and how an error becomes one line and an exit code."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

import psycopg

from .. import build, db, logs
from ..config import Config, ConfigError, load
from ..embedded import EmbeddedError
from ..secrets import Secrets
from .channel import cmd_channel
from .cleanup import cmd_cleanup
from .common import CliError, Parser, count_arg, duration_arg, id_arg
from .dlq import cmd_dlq
from .reminder import cmd_reminder
from .run import cmd_migrate, cmd_psql, cmd_run
from .status import cmd_status
from .web import cmd_web

COMMANDS: dict[str, Callable[[argparse.Namespace, Config], int]] = {
    "run": cmd_run,
    "migrate": cmd_migrate,
    "psql": cmd_psql,
    "status": cmd_status,
    "cleanup": cmd_cleanup,
    "web": cmd_web,
    "dlq": cmd_dlq,
    "reminder": cmd_reminder,
    "channel": cmd_channel,
}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="pgwork", description="Postgres-backed deadline and work-queue daemon.")
    p.add_argument("--version", action="version", version=f"pgwork {build.version()}")
    p.add_argument(
        "--config", help="TOML config file (default: $PGWORK_CONFIG, else built-in defaults)"
    )
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)

    rn = sub.add_parser(
        "run",
        help="run the daemon (embedded Postgres when no database is configured)",
        description="Run every duty until SIGTERM/SIGINT. Without PGWORK_DSN or libpq "
        "variables, starts and migrates the embedded Postgres.",
    )
    rn.add_argument(
        "--processes",
        default="1",
        metavar="N|auto",
        help="run N daemon processes as one service (auto: one per core): one parent starts, "
        "supervises and stops them, and speaks sd_notify for the group",
    )
    mg = sub.add_parser(
        "migrate",
        help="install or upgrade the pgwork schema (idempotent)",
        description="Install or upgrade the schema in one transaction; safe to run "
        "concurrently; refuses a database newer than this pgwork. Before an upgrade, the "
        "running daemons are asked to step aside (each finishes what it holds and exits for "
        "its supervisor to start it again; it then waits for the migration); daemons older than "
        "that handshake are named, and the upgrade refused unless --wait gives them time to be "
        "stopped.",
    )
    mg.add_argument(
        "--wait",
        type=duration_arg,
        default=0.0,
        metavar="DURATION",
        help="wait this long for daemons that predate the handshake to be stopped (e.g. 10m)",
    )
    mg.add_argument(
        "--step-aside-within",
        type=duration_arg,
        default=120.0,
        metavar="DURATION",
        help="how long the running daemons get to step aside (2m)",
    )
    ps = sub.add_parser(
        "psql",
        help="open psql on pgwork's database",
        description="Open psql on the configured (or embedded) database. psql's -U, -d, -h "
        "and -p change that connection's user, database, host or port (the configured password "
        "goes only with the configured user).",
    )
    ps.add_argument("psql_args", nargs="*", help="arguments for psql (e.g. -c 'SELECT 1')")

    st = sub.add_parser(
        "status",
        help="work by state, lag, dead letters, materialiser, daemons",
        description="Show the queue's state. Exits 1 when lag exceeds --max-lag.",
    )
    st.add_argument("--json", action="store_true", help="print JSON")
    st.add_argument(
        "--max-lag",
        type=duration_arg,
        metavar="DURATION",
        help="exit 1 when lag exceeds this (e.g. 5m): usable as a health check",
    )
    st.add_argument(
        "--source",
        action="append",
        metavar="SOURCE",
        help="judge --max-lag by these sources' lag only (repeatable): one app's health check",
    )

    wb = sub.add_parser(
        "web",
        help="serve the operator's web page (overview, rows, dead letters; actions with web.token)",
        description="A small read-mostly page on web.listen (default 127.0.0.1:9463). Redrive, "
        "pause and resume need web.token (PGWORK_WEB_TOKEN); without one the page is read-only.",
    )
    wb.add_argument("--listen", metavar="HOST:PORT", help="overrides web.listen")

    cl = sub.add_parser(
        "cleanup",
        help="run one retention pass (for a systemd timer), or pause/resume retention",
        description="Delete terminal work older than retention.keep (dead letters: "
        "retention.dead_keep) in bounded batches, then exit. Uses retention.dsn "
        "when set (separate credentials).",
    )
    g = cl.add_mutually_exclusive_group()
    g.add_argument("--once", action="store_true", help="one pass, then exit (the default)")
    g.add_argument(
        "--pause", action="store_true", help="pause retention everywhere, without restarts"
    )
    g.add_argument("--resume", action="store_true", help="resume retention")

    dl = sub.add_parser(
        "dlq",
        help="list, show and redrive dead letters",
        description="Dead letters: work that failed permanently or spent its attempts.",
    )
    dsub = dl.add_subparsers(dest="dlq_cmd", required=True, parser_class=Parser)
    ls = dsub.add_parser(
        "list", help="list dead letters", description="List dead letters, newest first."
    )
    ls.add_argument("--channel")
    ls.add_argument("--source")
    ls.add_argument("--older-than", type=duration_arg, metavar="DURATION")
    ls.add_argument("--limit", type=count_arg, default=100)
    ls.add_argument("--json", action="store_true")
    sh = dsub.add_parser(
        "show",
        help="one dead letter and its attempts",
        description="Show one work row and its attempt ledger.",
    )
    sh.add_argument("id", type=id_arg)
    sh.add_argument("--json", action="store_true")
    rt = dsub.add_parser(
        "retrying",
        help="work that failed and waits for its next try",
        description="List rows waiting for a retry, the soonest first: attempts since the last "
        "redrive, when the next try is due, the last error.",
    )
    rt.add_argument("--channel")
    rt.add_argument("--limit", type=count_arg, default=100)
    rt.add_argument("--json", action="store_true")
    rd = dsub.add_parser(
        "redrive",
        help="give dead letters a fresh attempt budget",
        description="Make dead letters claimable again with a fresh attempt budget and "
        "the same operation id. Refuses work of deleted or moved reminders.",
    )
    rd.add_argument("ids", nargs="*", type=id_arg)
    rd.add_argument(
        "--all", action="store_true", help="every dead letter (with --channel: of that channel)"
    )
    rd.add_argument("--channel", help="with --all: only this channel's")
    rd.add_argument("--source", help="with --all: only this source's")
    rd.add_argument(
        "--dry-run",
        action="store_true",
        help="say what would be redriven, and redrive nothing (rolled back)",
    )
    rd.add_argument(
        "--since",
        type=duration_arg,
        metavar="DURATION",
        help="with --all: only rows that went dead within this long (e.g. 2h)",
    )
    rd.add_argument(
        "--reason-like",
        metavar="PATTERN",
        help="with --all: only rows whose dead reason matches this SQL LIKE pattern "
        "(e.g. 'attempt budget spent%%HTTP 5%%')",
    )

    rm = sub.add_parser(
        "reminder",
        help="what happened to one reminder",
        description="One reminder by its source and business key: the reminder, its next "
        "occurrences, every work row (the latest first) with each attempt (time, answer, "
        "duration, error, next try), dead-letter reason and last redrive, and what retention "
        "kept of older occurrences. Also for a deleted reminder whose rows remain.",
    )
    rm.add_argument("source")
    rm.add_argument("business_key", metavar="KEY")
    rm.add_argument("--limit", type=count_arg, default=100, help="occurrences shown (100)")
    rm.add_argument("--json", action="store_true")

    ch = sub.add_parser(
        "channel",
        help="list channels with their state; pause, resume or retire one",
        description="Channel state held in the database and honoured by every daemon: a "
        "paused channel's work waits (nothing dropped, no attempt counted) until resumed; "
        "the state survives restarts.",
    )
    csub = ch.add_subparsers(dest="channel_cmd", required=True, parser_class=Parser)
    cls_ = csub.add_parser("list", help="channels and their state")
    cls_.add_argument("--json", action="store_true")
    pa = csub.add_parser("pause", help="pause a channel in every daemon")
    pa.add_argument("name")
    pa.add_argument("--reason", help="why (shown by status and the channel list)")
    re_ = csub.add_parser("resume", help="resume a paused channel and lift any throttle")
    re_.add_argument("name")
    rt_ = csub.add_parser(
        "retire",
        help="remove a channel no daemon serves any more",
        description="Remove a channel that an old config registered. Refused while reminders "
        "name it or it has live work, unless --cancel says to delete those reminders (their "
        "unsent work is cancelled, never sent). Run as the schema's owner.",
    )
    rt_.add_argument("name")
    rt_.add_argument(
        "--cancel",
        action="store_true",
        help="delete the channel's reminders, cancelling their work",
    )
    return p


def _leaf(e: BaseException) -> BaseException:
    """The one exception inside (nested) single-member exception groups, as task groups raise."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e


def _explain(e: BaseException) -> tuple[str, int] | None:
    """A one-line message and exit status for errors an operator can act on; None for bugs."""
    if isinstance(e, ConfigError):
        return f"configuration error: {e}", 2
    if isinstance(e, db.SchemaError):
        return str(e), 2
    if isinstance(e, CliError):
        return str(e), e.code
    if isinstance(e, EmbeddedError):
        return f"embedded postgres: {e}", 3
    if isinstance(e, psycopg.Error):
        return f"database error: {db.refusal(e)}", 3
    return None


def _psql_split(argv: Sequence[str]) -> int | None:
    """Where `psql` is the command (skipping the value of --config): everything after it goes
    to psql as written, in its order (but a first -h or --help: pgwork's help for it)."""
    for i, tok in enumerate(argv):
        if tok == "psql" and (i == 0 or argv[i - 1] != "--config"):
            return i
        if not tok.startswith("-") and (i == 0 or argv[i - 1] != "--config"):
            return None  # another command
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    at = _psql_split(argv)
    if at is not None and argv[at + 1 : at + 2] not in (["-h"], ["--help"]):
        args = parser.parse_args(argv[: at + 1])
        args.psql_args = argv[at + 1 :]
    else:
        args = parser.parse_args(argv)
    try:
        # Only `run` sends: the other commands need no channel's secret.
        cfg = load(args.config, secrets=args.cmd == "run")
        logs.setup(cfg.log_format, cfg.log_level, cfg.log_redact)
        logs.add_secrets(Secrets.from_config(cfg))
        code = COMMANDS[args.cmd](args, cfg)
        sys.stdout.flush()  # here, not at exit: a reader gone away is handled below
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`pgwork status | head -1`): a quiet end, as for any command
        # line tool. stdout goes to /dev/null so that the interpreter's last flush cannot fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it
    except Exception as e:
        explained = _explain(_leaf(e))
        if explained is None:
            raise
        print(f"pgwork: {logs.redact(explained[0])}", file=sys.stderr)
        return explained[1]
