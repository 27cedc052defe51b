"""The `pgwork` command: run, migrate, psql, status, dlq."""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

import anyio
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from . import __version__, db, eventloop, logs, store
from .config import ChannelConfig, Config, ConfigError, load
from .durations import parse_duration
from .embedded import EmbeddedError, LocalServer, wheel_bin_dir
from .secrets import Secrets

log = logging.getLogger("pgwork.cli")

LIBPQ_ENV = ("PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER", "PGSERVICE")


class CliError(Exception):
    """A one-line error for the operator; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"pgwork: {message} (see `{self.prog} --help`)\n")


# -- database resolution -------------------------------------------------------------------


class Database:
    """Where pgwork's database is: a DSN, the libpq environment, or the embedded server."""

    def __init__(self, cfg: Config, *, start_embedded: bool = True) -> None:
        self.server: LocalServer | None = None
        #: Behind a transaction-pooling PgBouncer (``database.pooler``).
        self.pooled = cfg.pooler == "transaction"
        if cfg.dsn:
            self.dsn, self.embedded = cfg.dsn, False
        elif any(os.environ.get(v) for v in LIBPQ_ENV):
            self.dsn, self.embedded = "", False
        else:
            self.embedded = True
            try:
                self.server = LocalServer(cfg.embedded_dir)
                if start_embedded:
                    self.server.start()
            except OSError as e:
                raise ConfigError(
                    f"database.embedded_dir: cannot use {str(cfg.embedded_dir)!r} for the embedded "
                    f"server's data: {e.strerror or e}"
                ) from None
            self.dsn = self.server.dsn() if self.server.port else ""

    def close(self) -> None:
        if self.server is not None and self.server.started_here:
            self.server.stop()


def _with_conn(
    dsn: str, fn: Callable[[psycopg.AsyncConnection[Any]], Awaitable[Any]], pooled: bool = False
) -> Any:
    async def main() -> Any:
        try:
            conn = await db.connect(dsn, timeout=5, pooled=pooled)
        except psycopg.OperationalError as e:
            raise CliError(
                f"cannot connect to the database ({db.describe(dsn)}): "
                f"{db.redact(str(e)).strip().splitlines()[0]}",
                3,
            ) from None
        try:
            return await fn(conn)
        finally:
            await conn.close()

    return anyio.run(main)


# -- commands ------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace, cfg: Config) -> int:
    from .daemon import Daemon
    from .service import serve

    provider = None
    if cfg.tracing_enabled:
        from .tracing import setup_sdk

        provider = setup_sdk()  # before the database: a missing extra is a config error
    database = Database(cfg)
    try:
        if database.embedded:
            print(_migrate(database.dsn), file=sys.stderr)
            _print_welcome(database)

        async def main() -> None:
            await serve(Daemon(cfg, database.dsn))

        eventloop.run(main, cfg.event_loop)
    finally:
        database.close()
        if provider is not None:
            provider.shutdown()  # flush the spans still batched
    return 0


def _this_command() -> str:
    """How the user runs this pgwork again: ``pgwork`` when that name on PATH is this program,
    else the path it was started by, or ``python -m pgwork``."""
    started = Path(sys.argv[0])
    if started.name == "__main__.py":
        return f"{sys.executable} -m pgwork"
    found = shutil.which("pgwork")
    if found and Path(found).resolve() == started.resolve():
        return "pgwork"
    return str(started)


def _print_welcome(database: Database) -> None:
    assert database.server is not None
    print(
        "\npgwork is running on the embedded Postgres "
        f"(127.0.0.1:{database.server.port}, data in {database.server.data_dir}).\n"
        f"Schedule a reminder from another terminal with `{_this_command()} psql`:\n\n"
        "  INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient)\n"
        "  VALUES ('demo', 'lease:42', now() + interval '10 seconds', 'log', 'tenant@example.com');\n\n"
        "It is delivered by the `log` channel (a REMINDER line below) ten seconds later. Ctrl-C stops.\n",
        file=sys.stderr,
    )


def _migrate(dsn: str, pooled: bool = False, channels: Sequence[ChannelConfig] = ()) -> str:
    """Migrate, then register ``channels``, so that apps can schedule for them before any
    daemon has started."""

    async def go(conn: psycopg.AsyncConnection[Any]) -> str:
        done = await db.migrate(conn)
        if channels:
            async with conn.transaction():
                await store.register_channels(conn, channels)
            done += f"; channels registered: {', '.join(c.name for c in channels)}"
        return done

    return str(_with_conn(dsn, go, pooled))


def cmd_migrate(args: argparse.Namespace, cfg: Config) -> int:
    database = Database(cfg)
    try:
        configured = list(cfg.channels.values()) if cfg.channels_configured else []
        print(_migrate(database.dsn, database.pooled, configured))
    finally:
        database.close()
    return 0


def cmd_psql(args: argparse.Namespace, cfg: Config) -> int:
    database = Database(cfg)
    try:
        psql = shutil.which("psql")
        if database.server is not None and database.server.psql_path().exists():
            psql = str(database.server.psql_path())
        if psql is None:
            with contextlib.suppress(EmbeddedError):
                bundled = wheel_bin_dir() / "psql"
                psql = str(bundled) if bundled.exists() else None
        if psql is None:
            raise CliError("psql is not installed (apt-get install postgresql-client)", 2)
        # The password goes to psql through its environment, never its command line (which
        # any user can read in the process list).
        params = conninfo_to_dict(database.dsn)
        password = params.pop("password", None)
        env = {**os.environ, **({"PGPASSWORD": str(password)} if password else {})}
        dsn = make_conninfo("", **{k: v for k, v in params.items() if v is not None})
        return subprocess.call([psql, dsn, *args.psql_args], env=env)
    finally:
        database.close()


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, datetime):
        return v.isoformat(sep=" ", timespec="seconds")
    if isinstance(v, timedelta):
        return str(v)
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _json(v: Any) -> str:
    return json.dumps(v, default=_fmt, indent=2)


#: The status command counts the retention backlog up to this many rows.
BACKLOG_COUNT_LIMIT = 100_000


def cmd_status(args: argparse.Namespace, cfg: Config) -> int:
    async def go(conn: psycopg.AsyncConnection[Any]) -> dict[str, Any]:
        await db.check_schema(conn)
        # First, and from the catalogs only: who locks pgwork's tables (the reads below would wait
        # behind them, up to the session's lock_timeout).
        holders = [asdict(h) for h in await store.lock_holders(conn)]
        try:
            return {"lock_holders": holders, **await read(conn)}
        except psycopg.errors.LockNotAvailable:
            return {
                "lock_holders": holders or [asdict(h) for h in await store.lock_holders(conn)],
                "incomplete": True,
            }

    async def read(conn: psycopg.AsyncConnection[Any]) -> dict[str, Any]:
        now = await store.db_now(conn)
        # Shown as they are: rows become plain mappings for the table and JSON printers.
        return {
            "work": [asdict(r) for r in await store.work_states(conn)],
            "lag": asdict(await store.lag(conn)),
            "materialiser": asdict(await store.materialiser_state(conn)),
            "daemons": [asdict(r) for r in await store.daemons(conn)],
            "retention": asdict(await store.retention_state(conn)),
            "channels": [_channel_row(c) for c in await store.channel_states(conn)],
            "retention_backlog": await store.retention_backlog(
                conn, **_cutoffs(cfg, now), limit=BACKLOG_COUNT_LIMIT
            ),
        }

    database = Database(cfg)
    try:
        st = _with_conn(database.dsn, go, database.pooled)
    finally:
        database.close()
    holders = st["lock_holders"]
    if st.get("incomplete"):
        if args.json:
            print(_json(st))
        else:
            print(_lock_holders(holders))
            print("status is incomplete: its reads waited for a lock past the lock timeout")
        return 4
    dead = sum(r["n"] for r in st["work"] if r["status"] == "dead")
    lag = st["lag"]["lag_seconds"]
    if args.json:
        print(_json({**st, "dead_letters": dead}))
    else:
        print(_table(st["work"], ["channel", "status", "n"]) if st["work"] else "no work rows")
        print(
            f"\nlag: {lag:.3f}s   oldest ready: {st['lag']['oldest_ready_seconds']:.3f}s   "
            f"due but not materialised: {st['lag']['unmaterialised_seconds']:.3f}s   "
            f"dead letters: {dead}"
        )
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
            f"materialiser: last cutoff {_fmt(m['last_cutoff'])} ({where}), "
            f"last pass {_fmt(m['last_pass_at'])}, rows made in total {m['total_inserted']}"
        )
        held_back = [c for c in st["channels"] if c["state"] != "running" or c["next_retry_at"]]
        if held_back:
            print(
                "\n"
                + _table(held_back, ["name", "state", "claimed", "next_retry_at", "why"])
                + "\n"
            )
        r = st["retention"]
        backlog = st["retention_backlog"]
        backlog_s = f"at least {backlog}" if backlog >= BACKLOG_COUNT_LIMIT else str(backlog)
        print(
            f"retention: {'PAUSED, ' if r['paused'] else ''}last pass {_fmt(r['last_pass_at'])}, "
            f"deleted {r['total_deleted']} in total, backlog {backlog_s}, "
            + (
                "nothing kept"
                if r["oldest_terminal_age_seconds"] is None
                else f"oldest kept {_fmt(r['oldest_terminal_age_seconds'])}s"
            )
        )
        if st["daemons"]:
            shown = [
                {
                    **d,
                    "state": "GONE" if d["gone"] else "running",
                    "listener_up": "off" if d["listener_up"] is None else d["listener_up"],
                }
                for d in st["daemons"]
            ]
            print(
                "\n"
                + _table(
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
    if args.max_lag is not None and lag > args.max_lag:
        print(f"pgwork: lag {lag:.1f}s exceeds --max-lag {args.max_lag:g}s", file=sys.stderr)
        return 1
    return 0


def _lock_holders(holders: list[dict[str, Any]]) -> str:
    """Who stops the daemon's statements, one line each."""
    lines = ["LOCKED: these sessions hold locks that stop claims, outcomes or the materialiser:"]
    for h in holders:
        who = ", ".join(
            x
            for x in (
                h["application_name"] and f"application {h['application_name']!r}",
                h["role"] and f"role {h['role']}",
                h["held_s"] is not None and f"in its transaction for {h['held_s']:.1f}s",
                h["state"],
            )
            if x
        )
        lines.append(
            f"  pid {h['pid']} ({who or 'details hidden: needs pg_read_all_stats'}): "
            f"{h['mode']} on {h['relation']}"
        )
    lines.append("  (end it with SELECT pg_terminate_backend(pid), or ask its owner to commit)")
    return "\n".join(lines)


def cmd_web(args: argparse.Namespace, cfg: Config) -> int:
    """Serve the operator's page until SIGINT or SIGTERM."""
    import signal

    from . import web

    if args.listen:
        from .config import _check_listen

        _check_listen("--listen", args.listen)
        cfg = replace(cfg, web_listen=args.listen)
    logs.add_secrets(Secrets.from_config(cfg))
    database = Database(cfg)

    async def main() -> None:
        pool = db.make_pool(database.dsn, 2, cfg.connect_timeout, pooled=database.pooled)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with pool, anyio.create_task_group() as tg:
                at = await tg.start(web.serve, pool, cfg)
                actions = "actions need web.token" if cfg.web_token else "read-only (no web.token)"
                print(f"pgwork web on http://{at}/ ({actions}); Ctrl-C stops", file=sys.stderr)
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    break

    try:
        _with_conn(database.dsn, db.check_schema, database.pooled)  # a clear error, exit 3 or 2
        anyio.run(main)
    finally:
        database.close()
    return 0


def cmd_cleanup(args: argparse.Namespace, cfg: Config) -> int:
    from .duties.retention import Retention

    database = Database(cfg)
    dsn = cfg.retention_dsn or database.dsn

    async def go(conn: psycopg.AsyncConnection[Any]) -> str:
        await db.check_schema(conn)
        if args.pause or args.resume:
            await store.retention_set_paused(conn, paused=bool(args.pause))
            return (
                "retention paused (every daemon stops at its next batch)"
                if args.pause
                else "retention resumed"
            )
        r = Retention(cfg.retention)
        res = await r.run_once(conn)
        if res.paused:
            raise CliError("retention is paused (`pgwork cleanup --resume` resumes it)", 1)
        return (
            f"deleted {res.deleted} work rows and {res.ledger_deleted} ledger rows in {res.batches} batches "
            f"({res.duration:.2f}s, longest batch {res.longest_batch * 1000:.0f} ms, {res.timeouts} timeouts)"
        )

    try:
        print(_with_conn(dsn, go, database.pooled))
    finally:
        database.close()
    return 0


def _cutoffs(cfg: Config, now: datetime) -> dict[str, datetime]:
    return {
        "done_before": now - timedelta(seconds=cfg.retention.keep),
        "dead_before": now - timedelta(seconds=cfg.retention.dead_keep),
    }


def cmd_dlq(args: argparse.Namespace, cfg: Config) -> int:
    database = Database(cfg)
    try:
        return int(_dlq(args, database.dsn, database.pooled))
    finally:
        database.close()


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
            return [asdict(r) for r in got]

        rows = _with_conn(dsn, lst, pooled)
        if args.json:
            print(_json(rows))
        elif rows:
            print(
                _table(
                    rows,
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
    if args.dlq_cmd == "show":

        async def show(
            conn: psycopg.AsyncConnection[Any],
        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            return (
                await store.work_get(conn, id=args.id),
                await store.work_attempts(conn, id=args.id),
            )

        work, attempts = _with_conn(dsn, show, pooled)
        if not work:
            raise CliError(f"no work row with id {args.id}", 1)
        if args.json:
            print(_json({"work": work[0], "attempts": attempts}))
        else:
            for k, v in work[0].items():
                print(f"{k:>14}: {_fmt(v)}")
            print()
            print(
                _table(
                    attempts,
                    [
                        "lease",
                        "attempt",
                        "outcome",
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
    if (args.since is not None or args.reason_like is not None) and not args.all:
        raise CliError("dlq redrive: --since and --reason-like select among --all", 2)
    operator = _operator()

    async def redrive(conn: psycopg.AsyncConnection[Any]) -> list[store.Redriven]:
        return await store.dlq_redrive(
            conn,
            all=bool(args.all),
            ids=args.ids or [],
            channel=args.channel,
            operator=operator,
            since=timedelta(seconds=args.since) if args.since is not None else None,
            reason_like=args.reason_like,
        )

    verdicts: list[store.Redriven] = _with_conn(dsn, redrive, pooled)
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
        if i not in found:
            print(f"pgwork: not redriven: work {i} is not a dead letter", file=sys.stderr)
    print(
        f"redrove {len(ok)} dead letters"
        + (f": {', '.join(map(str, ok))}" if ok and len(ok) <= 20 else "")
    )
    return 0 if not refused and len(found) >= len(set(args.ids or [])) else 1


def _operator() -> str:
    """Who ran a command that changes state (recorded with the change)."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


_CHANNEL_COLUMNS = [
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


def _channel_row(c: store.ChannelState) -> dict[str, Any]:
    """A channel as the list and status show it: its state in a word, and why."""
    if c.paused:
        state, why = (
            "PAUSED",
            f"{c.paused_reason or 'no reason given'} (by {c.paused_by}, {_fmt(c.paused_at)})",
        )
    elif c.throttled:
        state = "THROTTLED"
        why = f"{c.throttle_reason or ''}; held {c.throttled_for_seconds or 0:.1f}s more" + (
            f", at most {c.throttle_limit} claimed" if c.throttle_limit else ""
        )
    else:
        state, why = "running", ""
    return {**asdict(c), "state": state, "why": why}


def cmd_channel(args: argparse.Namespace, cfg: Config) -> int:
    database = Database(cfg)

    async def go(conn: psycopg.AsyncConnection[Any]) -> Any:
        await db.check_schema(conn)
        if args.channel_cmd == "list":
            return [_channel_row(c) for c in await store.channel_states(conn)]
        try:
            if args.channel_cmd == "pause":
                return await store.channel_pause(
                    conn, channel=args.name, reason=args.reason, actor=_operator()
                )
            return await store.channel_resume(conn, channel=args.name, actor=_operator())
        except psycopg.errors.NoDataFound:
            raise CliError(
                f"no channel named {args.name!r} (`pgwork channel list` shows them)", 1
            ) from None

    try:
        got = _with_conn(database.dsn, go, database.pooled)
    finally:
        database.close()
    if args.channel_cmd == "list":
        if args.json:
            print(_json(got))
        else:
            print(_table(got, _CHANNEL_COLUMNS) if got else "no channels registered")
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


# -- entry point ---------------------------------------------------------------------------


def _count_arg(text: str) -> int:
    """A positive count (``--limit``)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= n <= 1_000_000:
        raise argparse.ArgumentTypeError(f"must be between 1 and 1000000 (got {n})")
    return n


def _id_arg(text: str) -> int:
    """A work id: a positive bigint."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a work id: {text!r}") from None
    if not 1 <= n < 2**63:
        raise argparse.ArgumentTypeError(f"not a work id (ids are 1 to 2^63-1): {text}")
    return n


def _duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pgwork", description="Postgres-backed deadline and work-queue daemon.")
    p.add_argument("--version", action="version", version=f"pgwork {__version__}")
    p.add_argument(
        "--config", help="TOML config file (default: $PGWORK_CONFIG, else built-in defaults)"
    )
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    sub.add_parser(
        "run",
        help="run the daemon (embedded Postgres when no database is configured)",
        description="Run every duty until SIGTERM/SIGINT. Without PGWORK_DSN or libpq "
        "variables, starts and migrates the embedded Postgres.",
    )
    sub.add_parser(
        "migrate",
        help="install or upgrade the pgwork schema (idempotent)",
        description="Install or upgrade the schema in one transaction; safe to run "
        "concurrently; refuses a database newer than this pgwork.",
    )
    ps = sub.add_parser(
        "psql",
        help="open psql on pgwork's database",
        description="Open psql on the configured (or embedded) database.",
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
        type=_duration_arg,
        metavar="DURATION",
        help="exit 1 when lag exceeds this (e.g. 5m): usable as a health check",
    )

    wb = sub.add_parser(
        "web",
        help="serve the operator's web page (overview, rows, dead letters; actions with web.token)",
        description="A small read-mostly page on web.listen (default 127.0.0.1:9465). Redrive, "
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
    dsub = dl.add_subparsers(dest="dlq_cmd", required=True, parser_class=_Parser)
    ls = dsub.add_parser(
        "list", help="list dead letters", description="List dead letters, newest first."
    )
    ls.add_argument("--channel")
    ls.add_argument("--source")
    ls.add_argument("--older-than", type=_duration_arg, metavar="DURATION")
    ls.add_argument("--limit", type=_count_arg, default=100)
    ls.add_argument("--json", action="store_true")
    sh = dsub.add_parser(
        "show",
        help="one dead letter and its attempts",
        description="Show one work row and its attempt ledger.",
    )
    sh.add_argument("id", type=_id_arg)
    sh.add_argument("--json", action="store_true")
    rd = dsub.add_parser(
        "redrive",
        help="give dead letters a fresh attempt budget",
        description="Make dead letters claimable again with a fresh attempt budget and "
        "the same operation id. Refuses work of deleted or moved reminders.",
    )
    rd.add_argument("ids", nargs="*", type=_id_arg)
    rd.add_argument(
        "--all", action="store_true", help="every dead letter (with --channel: of that channel)"
    )
    rd.add_argument("--channel")
    rd.add_argument(
        "--since",
        type=_duration_arg,
        metavar="DURATION",
        help="with --all: only rows that went dead within this long (e.g. 2h)",
    )
    rd.add_argument(
        "--reason-like",
        metavar="PATTERN",
        help="with --all: only rows whose dead reason matches this SQL LIKE pattern "
        "(e.g. 'attempt budget spent%%HTTP 5%%')",
    )

    ch = sub.add_parser(
        "channel",
        help="list channels with their state; pause or resume one",
        description="Channel state held in the database and honoured by every daemon: a "
        "paused channel's work waits (nothing dropped, no attempt counted) until resumed; "
        "the state survives restarts.",
    )
    csub = ch.add_subparsers(dest="channel_cmd", required=True, parser_class=_Parser)
    cls_ = csub.add_parser("list", help="channels and their state")
    cls_.add_argument("--json", action="store_true")
    pa = csub.add_parser("pause", help="pause a channel in every daemon")
    pa.add_argument("name")
    pa.add_argument("--reason", help="why (shown by status and the channel list)")
    re_ = csub.add_parser("resume", help="resume a paused channel and lift any throttle")
    re_.add_argument("name")
    return p


COMMANDS: dict[str, Callable[[argparse.Namespace, Config], int]] = {
    "run": cmd_run,
    "migrate": cmd_migrate,
    "psql": cmd_psql,
    "status": cmd_status,
    "cleanup": cmd_cleanup,
    "web": cmd_web,
    "dlq": cmd_dlq,
    "channel": cmd_channel,
}


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
        return f"database error: {db.redact(str(e)).strip().splitlines()[0]}", 3
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.cmd != "psql":
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.psql_args = [*extra, *args.psql_args]
    try:
        cfg = load(args.config)
        logs.setup(cfg.log_format, cfg.log_level, cfg.log_redact)
        logs.add_secrets(Secrets.from_config(cfg))
        return COMMANDS[args.cmd](args, cfg)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        explained = _explain(_leaf(e))
        if explained is None:
            raise
        print(f"pgwork: {logs.redact(explained[0])}", file=sys.stderr)
        return explained[1]


if __name__ == "__main__":
    sys.exit(main())
