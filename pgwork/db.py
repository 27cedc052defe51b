"""Connections, the schema check and `pgwork migrate`."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import anyio
import psycopg
from psycopg import AsyncConnection
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool

from . import SCHEMA_VERSION, store
from .queries import code_sql, migration_sql, tables_sql
from .supervise import Backoff

log = logging.getLogger("pgwork.db")

#: Session settings of every daemon connection: the timeouts keep a stuck statement or a
#: forgotten transaction from holding locks (and the xmin horizon) for long.
SESSION_SETTINGS = {
    "lock_timeout": "5s",
    "statement_timeout": "60s",
    "idle_in_transaction_session_timeout": "60s",
    # No JIT: pgwork's statements are short, and the planner's estimates for a generic plan
    # (a LIMIT it cannot see) pass jit_above_cost. PostgreSQL 15 with LLVM then compiled the
    # claim on every execution: 115 ms of a 126 ms claim.
    "jit": "off",
    # Every statement relies on READ COMMITTED (a page's snapshot must be younger than the lock
    # it takes: see pgwork.materialise_page), whatever a database or role default says.
    "default_transaction_isolation": "read committed",
    "application_name": "pgwork",
}


class SchemaError(Exception):
    """The database's pgwork schema is missing, older or newer than this code."""


def redact(text: str) -> str:
    """``text`` with anything that looks like a password removed (DSNs, URIs, error messages)."""
    if "://" not in text and "password" not in text.casefold():
        return text  # neither pattern can match (most log lines: two regular expressions saved)
    text = re.sub(r"(://[^:/@\s]*:)[^@\s]*@", r"\1***@", text)
    return re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", r"\1***", text, flags=re.IGNORECASE)


def describe(dsn: str) -> str:
    """A DSN as it may be logged: host, port, database and user, never the password."""
    try:
        d = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparsable dsn>"
    host = d.get("host") or "(libpq default host)"
    return f"{d.get('user') or '(default user)'}@{host}:{d.get('port') or 5432}/{d.get('dbname') or '(default db)'}"


def session_conninfo(dsn: str, extra: dict[str, str] | None = None, *, pooled: bool = False) -> str:
    """``dsn`` plus pgwork's session settings, keeping any options already in it. ``pooled``
    (behind a transaction-pooling PgBouncer): no ``options`` startup parameter, which PgBouncer
    refuses and could not keep per session anyway; set the timeouts on the role instead
    (docs/operations.md, PgBouncer)."""
    d = conninfo_to_dict(dsn)
    if pooled:
        if "application_name" in d:
            return dsn
        return make_conninfo(dsn, application_name=SESSION_SETTINGS["application_name"])
    settings = {**SESSION_SETTINGS, **(extra or {})}
    # In libpq's options, a space inside a value is escaped with a backslash.
    opts = " ".join(
        f"-c {k}={_escape_option(v)}" for k, v in settings.items() if k != "application_name"
    )
    extra = {"options": f"{d.get('options', '')} {opts}".strip()}
    if "application_name" not in d:
        extra["application_name"] = SESSION_SETTINGS["application_name"]
    return make_conninfo(dsn, **extra)


def _escape_option(value: str) -> str:
    return value.replace("\\", "\\\\").replace(" ", "\\ ")


def _pooled_kwargs(pooled: bool) -> dict[str, Any]:
    # A transaction-pooling PgBouncer before 1.21 cannot keep a prepared statement: every
    # statement goes unprepared (one round trip either way, with the extended protocol).
    return {"prepare_threshold": None} if pooled else {}


async def connect(
    dsn: str, *, timeout: float = 5.0, pooled: bool = False, **kwargs: Any
) -> AsyncConnection[Any]:
    return await AsyncConnection.connect(
        session_conninfo(dsn, pooled=pooled),
        autocommit=True,
        connect_timeout=max(1, int(timeout)),
        **_pooled_kwargs(pooled),
        **kwargs,
    )


def make_pool(
    dsn: str, size: int, timeout: float, *, pooled: bool = False
) -> AsyncConnectionPool[AsyncConnection[Any]]:
    return AsyncConnectionPool(
        session_conninfo(dsn, pooled=pooled),
        # All connections stay open: a duty never waits for a new one on the hot path.
        min_size=size,
        max_size=size,
        timeout=timeout,
        open=False,
        kwargs={
            "autocommit": True,
            "connect_timeout": max(1, int(timeout)),
            **_pooled_kwargs(pooled),
        },
        # No check on every checkout (a round trip per pass): a broken connection fails its pass,
        # which is retried, and the pool replaces it.
        # 0 means: when replacing a lost connection fails, give up on it at once (psycopg_pool
        # would otherwise retry in the background on a doubling delay, which after a long outage
        # leaves the pool short for as long again). The pool grows back on demand: the next
        # checkout opens a connection, and the revival probe makes every duty check out within
        # about a second of the database answering (supervise.Revival).
        reconnect_timeout=0,
        name="pgwork",
    )


async def probe(dsn: str, timeout: float, pooled: bool = False) -> None:
    """Connect and disconnect: :raises: whatever connecting raises."""
    conn = await connect(dsn, timeout=timeout, pooled=pooled)
    await conn.close()


#: What a server answers, as libpq reports it, when a connection will never be let in as it
#: is: the database or the role does not exist, the password or the method is refused. (Its
#: English text: a server with other lc_messages is retried as any other failure.)
_REFUSED_FOR_GOOD = re.compile(
    r'FATAL:\s+(database ".*" does not exist|role ".*" does not exist'
    r"|password authentication failed|no pg_hba\.conf entry|.* authentication failed)"
)


def refused_for_good(e: psycopg.OperationalError) -> bool:
    """The server refused the connection for a reason a retry will not change."""
    return bool(_REFUSED_FOR_GOOD.search(str(e)))


async def wait_until_reachable(
    dsn: str,
    *,
    timeout: float,
    stop: anyio.Event,
    on_failure: Callable[[], None] | None = None,
    pooled: bool = False,
) -> bool:
    """Wait until the database answers (retrying with backoff, logging each failure) and check
    its schema. Returns False when ``stop`` is set first.

    :raises SchemaError: when the schema is missing, older or newer than this code.
    """
    conn: AsyncConnection[Any] | None = None
    final: psycopg.OperationalError | None = None

    async def attempt() -> None:
        nonlocal conn, final
        try:
            conn = await connect(dsn, timeout=timeout, pooled=pooled)
        except psycopg.OperationalError as e:
            if not refused_for_good(e):
                raise
            final = e  # the server's answer will not change: no retry

    def failed(e: Exception, delay: float) -> None:
        log.error(
            "database unreachable (%s); retrying in %.1fs: %s",
            describe(dsn),
            delay,
            redact(str(e)).strip(),
            extra={"error_class": type(e).__name__},
        )
        if on_failure is not None:
            on_failure()

    if not await Backoff().until_done(attempt, failed, stop):
        return False
    if final is not None:
        raise final
    if conn is None:
        return False
    try:
        await check_schema(conn)
    finally:
        await conn.close()
    return True


async def schema_version(conn: AsyncConnection[Any]) -> int | None:
    if not await store.schema_installed(conn):
        return None
    return await store.schema_version(conn)


async def check_schema(conn: AsyncConnection[Any]) -> None:
    """:raises SchemaError: when the schema is not exactly the one this code expects."""
    v = await schema_version(conn)
    if v is None:
        raise SchemaError("this database has no pgwork schema: run `pgwork migrate` first")
    if v > SCHEMA_VERSION:
        raise SchemaError(
            f"the database's pgwork schema is version {v}, newer than this pgwork "
            f"(which knows version {SCHEMA_VERSION}): upgrade pgwork before running it here"
        )
    if v < SCHEMA_VERSION:
        raise SchemaError(
            f"the database's pgwork schema is version {v}, older than this pgwork "
            f"(version {SCHEMA_VERSION}): run `pgwork migrate`"
        )


#: How long a migration waits for each lock it needs (an app's or a daemon's transaction holding
#: the table): past it, the attempt is rolled back, so the apps queued behind its lock request go
#: on, and tried again after a pause, at most MIGRATE_ATTEMPTS times. A statement itself may take
#: as long as its table needs.
MIGRATE_LOCK_TIMEOUT = "2s"
MIGRATE_ATTEMPTS = 5


async def migrate(conn: AsyncConnection[Any]) -> str:
    """Bring the schema to this code's version in one transaction. Idempotent and safe to run
    concurrently (an advisory lock serialises runs). Returns what it did. A lock it cannot get
    within ``MIGRATE_LOCK_TIMEOUT`` (or a deadlock) rolls the attempt back; it is tried again
    after a pause, ``MIGRATE_ATTEMPTS`` times in all, then the last error is raised.

    :raises SchemaError: when the database is newer than the code.
    """
    pause = 0.5
    for attempt in range(1, MIGRATE_ATTEMPTS + 1):
        try:
            return await _migrate_once(conn)
        except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected) as e:
            if attempt == MIGRATE_ATTEMPTS:
                raise
            log.warning(
                "migrate: a lock was not available, rolled back; trying again in %.1fs",
                pause,
                extra={"attempt": attempt, "error": redact(str(e)).strip().splitlines()[0]},
            )
            await anyio.sleep(pause)
            pause *= 2
    raise AssertionError("unreachable")


async def _migrate_once(conn: AsyncConnection[Any]) -> str:
    async with conn.transaction():
        await store.migrate_lock(conn)
        # After the advisory lock: a second migrate waits for the first whatever it takes.
        await store.migrate_timeouts(conn, lock_timeout=MIGRATE_LOCK_TIMEOUT)
        v = await schema_version(conn)
        if v is None:
            await conn.execute(tables_sql())
            await conn.execute(code_sql())
            await store.schema_version_set(conn, SCHEMA_VERSION)
            return f"installed pgwork schema version {SCHEMA_VERSION}"
        if v > SCHEMA_VERSION:
            raise SchemaError(
                f"the database's pgwork schema is version {v}, newer than this pgwork "
                f"(version {SCHEMA_VERSION}); refusing to touch it"
            )
        if v == SCHEMA_VERSION:
            await store.time_zones_refresh(conn)
            return f"pgwork schema already at version {v}"
        steps = [migration_sql(step) for step in range(v + 1, SCHEMA_VERSION + 1)]
        for before, _after in steps:
            await conn.execute(before)
        # The code once, as it is now (a renamed or dropped signature is a migration's DROP).
        await conn.execute(code_sql())
        for _before, after in steps:
            if after.strip():
                await conn.execute(after)
        await store.schema_version_set(conn, SCHEMA_VERSION)
        return f"upgraded pgwork schema from version {v} to {SCHEMA_VERSION}"
