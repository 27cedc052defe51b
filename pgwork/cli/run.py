"""`pgwork run`, `migrate` and `psql`."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .. import eventloop, logs
from ..config import Config
from ..embedded import EmbeddedError, wheel_bin_dir
from .common import (
    CliError,
    Database,
    migrate_schema,
)

if TYPE_CHECKING:
    from ..daemon import Daemon


def cmd_run(args: argparse.Namespace, cfg: Config) -> int:
    from ..daemon import STEPPED_ASIDE, Daemon
    from ..group import process_count
    from ..service import serve

    try:
        processes = process_count(getattr(args, "processes", "1"))
    except ValueError as e:
        raise CliError(str(e), 2) from None
    _load_channels(cfg)
    if processes > 1:
        return _run_group(args, cfg, processes)
    provider = None
    if cfg.tracing_enabled:
        from ..tracing import setup_sdk

        provider = setup_sdk()  # before the database: a missing extra is a config error
    database = Database(cfg, create=True)
    try:
        welcome = None
        if database.embedded:
            logs.say(migrate_schema(database.dsn), file=sys.stderr)
            welcome = partial(_print_welcome, database, cfg)

        stepped_aside: list[str] = []

        async def main() -> None:
            daemon = Daemon(cfg, database.dsn)  # in the loop: its events belong to it
            # The welcome once the daemon is ready (never above an error that stops it), with
            # where it serves its page and metrics, once bound.
            ready = None
            if welcome is not None:
                greet = welcome
                ready = lambda: greet(watch=_where_to_watch(daemon))  # noqa: E731
            await serve(daemon, on_ready=ready)
            if daemon.stepped_aside is not None:
                stepped_aside.append(daemon.stepped_aside)

        eventloop.run(main, cfg.event_loop)
        if stepped_aside:
            return STEPPED_ASIDE
    finally:
        database.close()
        if provider is not None:
            provider.shutdown()  # flush the spans still batched
    return 0


def _load_channels(cfg: Config) -> None:
    """Make every channel once before a database is touched: a python channel's target that
    cannot be imported is a configuration error (exit 2) before an embedded server is created,
    started and migrated for it. A channel opens nothing before its first delivery
    (pgwork.channels.Kind.make); the daemon makes them again in its own process."""
    from ..channels import make_channel

    for c in cfg.channels.values():
        make_channel(c)


def _run_group(args: argparse.Namespace, cfg: Config, processes: int) -> int:
    """The parent of ``processes`` daemons (pgwork.group): the database is resolved here (the
    embedded server started and migrated once), the children are told where it is."""
    from ..group import Group

    database = Database(cfg, create=True)
    try:
        welcome = None
        if database.embedded:
            logs.say(migrate_schema(database.dsn), file=sys.stderr)
            welcome = partial(_print_welcome, database, cfg)
        argv = (["--config", args.config] if args.config else []) + ["run"]
        return Group(cfg, database.dsn, processes, argv, on_ready=welcome).run()
    finally:
        database.close()


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


def _where_to_watch(daemon: Daemon) -> list[tuple[str, str]]:
    """The daemon's web page and metrics, where it serves them."""
    return [
        (what, f"http://{at}{path}")
        for what, at, path in (
            ("web page", daemon.web_at, "/"),
            ("metrics", daemon.metrics_at, "/metrics"),
        )
        if at
    ]


def _print_welcome(
    database: Database, cfg: Config | None = None, watch: list[tuple[str, str]] | None = None
) -> None:
    """How to schedule a first reminder, on a channel this daemon runs (`log` when it has one),
    and where to watch it (``watch``: what and its URL)."""
    assert database.server is not None
    names = list(cfg.channels) if cfg is not None else ["log"]
    channel = "log" if "log" in names or not names else names[0]
    seen = (
        "(a REMINDER line below)"
        if channel == "log"
        else "(its outcome in `pgwork dlq show` or the log)"
    )
    logs.say(
        "\npgwork is running on the embedded Postgres "
        f"(127.0.0.1:{database.server.port}, data in {database.server.data_dir}).\n"
        f"Schedule a reminder from another terminal with `{_this_command()} psql`:\n\n"
        "  INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient)\n"
        f"  VALUES ('demo', 'lease:42', now() + interval '10 seconds', '{channel}', "
        "'tenant@example.com');\n\n"
        f"It is delivered by the `{channel}` channel {seen} ten seconds later.\n"
        + "".join(f"Watch it: {what}: {url}\n" for what, url in watch or [])
        + "Ctrl-C stops.\n",
        file=sys.stderr,
    )


def cmd_migrate(args: argparse.Namespace, cfg: Config) -> int:
    database = Database(cfg)
    try:
        configured = list(cfg.channels.values()) if cfg.channels_configured else []
        print(
            migrate_schema(
                database.dsn,
                database.pooled,
                configured,
                wait_for_old=args.wait,
                step_aside_within=args.step_aside_within,
            )
        )
    finally:
        database.close()
    return 0


#: psql's connection options, by short and long name: the connection string pgwork passes
#: would win over them (or, for -d, be taken for a user name), so they go into it instead.
_CONNECTION = {"U": "user", "d": "dbname", "h": "host", "p": "port"}
_LONG = {"--username": "user", "--dbname": "dbname", "--host": "host", "--port": "port"}
#: psql's other short options that take a value (the rest of their cluster, or the next word).
_VALUED = set("cfvLoFPRT")


def connection_options(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """psql's arguments split into the connection options among them (-U, -d, -h, -p in any of
    psql's spellings: ``-U x``, ``-Ux``, ``-AtU x``, ``--username=x``, ``--username x``) and the
    rest, in their order."""
    asked: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        name, eq, value = tok.partition("=")
        if name in _LONG:
            if not eq and i < len(argv):
                value, i = argv[i], i + 1
            asked[_LONG[name]] = value
            continue
        if not tok.startswith("-") or tok.startswith("--") or tok == "-":
            rest.append(tok)
            continue
        kept = "-"
        for j, ch in enumerate(tok[1:], start=1):
            if ch in _CONNECTION or ch in _VALUED:
                value = tok[j + 1 :]
                if not value and i < len(argv):
                    value, i = argv[i], i + 1
                if ch in _CONNECTION:
                    asked[_CONNECTION[ch]] = value
                else:
                    rest.append(kept + ch)
                    rest.append(value)
                    kept = "-"
                break
            kept += ch
        if kept != "-":
            rest.append(kept)
    return asked, rest


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
        asked, rest = connection_options(args.psql_args)
        password = params.pop("password", None)
        if "user" in asked:  # the configured password is the configured user's
            password = None
        params.update(asked)
        env = {**os.environ, **({"PGPASSWORD": str(password)} if password else {})}
        dsn = make_conninfo("", **{k: v for k, v in params.items() if v is not None})
        return subprocess.call([psql, dsn, *rest], env=env)
    finally:
        database.close()
