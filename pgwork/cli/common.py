"""Shared by the commands: the database a command talks to (configured, or the embedded
server), errors with exit codes, and the table and JSON printers."""

from __future__ import annotations

import argparse
import getpass
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

import anyio
import psycopg

from .. import db, jsontext, logs, migration, store
from ..config import ChannelConfig, Config, ConfigError
from ..durations import interval_text, parse_duration
from ..embedded import LocalServer

LIBPQ_ENV = ("PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER", "PGSERVICE")


class CliError(Exception):
    """A one-line error for the operator; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"pgwork: {message} (see `{self.prog} --help`)\n")


def _blocked(data: Path) -> bool:
    """A file stands where a directory of the path should be (the embedded server cannot use
    the path at all: that error says so, below)."""
    return any(p.exists() and not p.is_dir() for p in (data, *data.parents))


class Database:
    """Where pgwork's database is: a DSN, the libpq environment, or the embedded server."""

    def __init__(self, cfg: Config, *, start_embedded: bool = True, create: bool = False) -> None:
        """``create``: with no database configured, make the embedded server's data directory
        when it has none (`pgwork run`); every other command refuses, saying what it looked for."""
        self.server: LocalServer | None = None
        #: Behind a transaction-pooling PgBouncer (``database.pooler``).
        self.pooled = cfg.pooler == "transaction"
        if cfg.dsn:
            self.dsn, self.embedded = cfg.dsn, False
        elif any(os.environ.get(v) for v in LIBPQ_ENV):
            self.dsn, self.embedded = "", False
        else:
            self.embedded = True
            data = Path(cfg.embedded_dir)
            if not create and not (data / "PG_VERSION").exists() and not _blocked(data):
                raise CliError(
                    "no database: PGWORK_DSN (or the libpq variables, PGHOST …) is not set, and "
                    f"there is no embedded server's data in {data.resolve()} (`pgwork run` makes it "
                    "there, in the directory it runs in): run this where `pgwork run` runs, or set "
                    "PGWORK_DSN",
                    2,
                )
            try:
                self.server = LocalServer(cfg.embedded_dir)
                if start_embedded:
                    self.server.start()
                    if create and self.server.orphaned_by is not None:
                        # `pgwork run` after a run that was killed (SIGKILL cannot be caught):
                        # its server is still up; this run uses it and stops it at the end.
                        self.server.take_over()
                        logs.say(
                            f"pgwork: the embedded server in {self.server.data_dir} was left "
                            f"running by pgwork process {self.server.orphaned_by}, which is gone "
                            "(killed?): using it, and stopping it when this run ends",
                            file=sys.stderr,
                            level=logging.WARNING,
                        )
            except OSError as e:
                raise ConfigError(
                    f"database.embedded_dir: cannot use {str(cfg.embedded_dir)!r} for the embedded "
                    f"server's data: {e.strerror or e}"
                ) from None
            self.dsn = self.server.dsn() if self.server.port else ""

    def close(self) -> None:
        if self.server is not None and self.server.started_here:
            self.server.stop()


def with_conn(
    dsn: str, fn: Callable[[psycopg.AsyncConnection[Any]], Awaitable[Any]], pooled: bool = False
) -> Any:
    async def main() -> Any:
        try:
            conn = await db.connect(dsn, timeout=5, pooled=pooled)
        except psycopg.OperationalError as e:
            raise CliError(
                f"cannot connect to the database ({db.describe(dsn)}): {db.refusal(e)}",
                3,
            ) from None
        try:
            return await fn(conn)
        finally:
            await conn.close()

    return anyio.run(main)


def migrate_schema(
    dsn: str,
    pooled: bool = False,
    channels: Sequence[ChannelConfig] = (),
    *,
    wait_for_old: float = 0.0,
    step_aside_within: float = 120.0,
) -> str:
    """Migrate, then register ``channels``, so that apps can schedule for them before any
    daemon has started."""

    async def go(conn: psycopg.AsyncConnection[Any]) -> str:
        done = await migration.migrate(
            conn, wait_for_old=wait_for_old, step_aside_within=step_aside_within
        )
        if channels:
            async with conn.transaction():
                await store.register_channels(conn, channels)
            done += f"; channels registered: {', '.join(c.name for c in channels)}"
        return done

    return str(with_conn(dsn, go, pooled))


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, datetime):
        return v.isoformat(sep=" ", timespec="seconds")
    if isinstance(v, timedelta):
        return interval_text(v)
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def to_json(v: Any) -> str:
    """A command's JSON: a payload as it is stored (``JsonText``), the rest as ``fmt`` says."""
    return jsontext.dumps(v, default=fmt, indent=2)


#: The status command counts the retention backlog up to this many rows.
BACKLOG_COUNT_LIMIT = 100_000


def cutoffs(cfg: Config, now: datetime) -> dict[str, datetime]:
    return {
        "done_before": now - timedelta(seconds=cfg.retention.keep),
        "dead_before": now - timedelta(seconds=cfg.retention.dead_keep),
    }


def operator_name() -> str:
    """Who ran a command that changes state (recorded with the change)."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


def count_arg(text: str) -> int:
    """A positive count (``--limit``)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= n <= 1_000_000:
        raise argparse.ArgumentTypeError(f"must be between 1 and 1000000 (got {n})")
    return n


def id_arg(text: str) -> int:
    """A work id: a positive bigint."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a work id: {text!r}") from None
    if not 1 <= n < 2**63:
        raise argparse.ArgumentTypeError(f"not a work id (ids are 1 to 2^63-1): {text}")
    return n


def duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
