"""Connections, and the schema check (`pgwork migrate` is pgwork.migration)."""

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
from .queries import (
    code_checksum,
)
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


class MigrateRefused(SchemaError):
    """`pgwork migrate` did not start: daemons that cannot step aside are running (named)."""


#: SQLSTATE classes of errors that are no reminder's doing: the connection (08), the transaction
#: (25, 40: a serialization failure or deadlock), a statement the server will not run (42: a
#: privilege, an undefined object), the server's resources (53), a lock not available (55), the
#: server's operator (57: a shutdown; not 57014, a statement timeout, which one row can cause),
#: the server's own system (58), its configuration (F0).
NO_ROWS_DOING = frozenset({"08", "25", "40", "42", "53", "55", "57", "58", "F0"})


def one_rows_doing(e: BaseException) -> bool:
    """Whether a statement's error may be one row's doing, decided by its SQLSTATE's class, so
    that no class of error a row can cause is missed: everything but ``NO_ROWS_DOING`` (a data
    error, a cardinality or constraint violation, a RAISE, a statement timeout, a limit of the
    server, a row it cannot read...). A materialiser page that fails so is retried in halves to
    find the reminder; the history of a reminder shows the rest of what happened to it. An
    error with no SQLSTATE (a lost connection) is nobody's row."""
    if not isinstance(e, psycopg.DatabaseError) or e.sqlstate is None:
        return False
    return e.sqlstate == "57014" or e.sqlstate[:2] not in NO_ROWS_DOING


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


#: The daemon's sessions plan each statement once: psycopg prepares it at its first execution
#: (not its sixth) and PostgreSQL uses the generic plan at once (not after five custom ones).
#: The claim's plan costs ~3 ms of Postgres CPU and the outcome flush's ~1 ms, so each new
#: connection paid ~40 ms of planning in its first dozen claims and flushes, and the first
#: deliveries after a start, each a custom plan, were that much later
#: (tests/test_hot_path.py::test_the_daemons_pool_plans_each_statement_once_per_connection).
#: bench/plans.py shows the daemon's statements reading the same rows with their generic plans
#: as with custom ones. A plan kept is only as good as the statistics it was made with, and a
#: daemon that starts on empty tables (a fresh install) or before a burst makes them while the
#: tables look tiny, where a sequential scan looks cheapest: its claims and outcome flushes then
#: read every work row, on every call, until an ANALYZE (12.9 ms a claim during the rent-day
#: crunch instead of ~0.3). Every statement the daemon repeats reads its rows by key, so its
#: sessions plan without sequential scans (a table with no index is still scanned)
#: (tests/test_hot_path.py::test_a_daemon_planned_on_an_empty_table_reads_its_rows_by_key).
PLAN_ONCE = {"plan_cache_mode": "force_generic_plan", "enable_seqscan": "off"}


def make_pool(
    dsn: str, size: int, timeout: float, *, pooled: bool = False, plan_once: bool = False
) -> AsyncConnectionPool[AsyncConnection[Any]]:
    """A pool of ``size`` sessions; ``plan_once``: the daemon's (see PLAN_ONCE). Behind
    PgBouncer nothing is prepared (see _pooled_kwargs), so ``plan_once`` changes nothing."""
    once = plan_once and not pooled
    return AsyncConnectionPool(
        session_conninfo(dsn, PLAN_ONCE if once else None, pooled=pooled),
        # All connections stay open: a duty never waits for a new one on the hot path.
        min_size=size,
        max_size=size,
        timeout=timeout,
        open=False,
        kwargs={
            "autocommit": True,
            "connect_timeout": max(1, int(timeout)),
            **_pooled_kwargs(pooled),
            **({"prepare_threshold": 0} if once else {}),
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
#: is: the database or the role does not exist, the password or the method is refused; or what
#: libpq says of a TLS setting the server cannot meet. (Its English text: a server with other
#: lc_messages is retried as any other failure.)
_REFUSED_FOR_GOOD = re.compile(
    r'FATAL:\s+(database ".*" does not exist|role ".*" does not exist'
    r"|password authentication failed|no pg_hba\.conf entry|.* authentication failed)"
    # A transaction pooler (PgBouncer) refusing the session settings pgwork sends at connect.
    r"|unsupported startup parameter"
    # libpq's own: the server asks for a password and none was given (not in the DSN, no
    # PGPASSWORD, no readable .pgpass): an env file without it, a .pgpass the user cannot read.
    r"|fe_sendauth: no password supplied"
    # libpq's own: the DSN asks for TLS the server does not offer, or cannot verify.
    r"|server does not support SSL, but SSL was required"
    r'|root certificate file ".*" does not exist'
    r'|server certificate for ".*" does not match host name'
)


def refused_for_good(e: psycopg.OperationalError) -> bool:
    """The server refused the connection for a reason a retry will not change."""
    return bool(_REFUSED_FOR_GOOD.search(str(e)))


def refusal(e: psycopg.Error) -> str:
    """A connection error's first line, redacted, with what to look at when libpq had no
    password to give."""
    text = redact(str(e)).strip().splitlines()[0]
    if "no password supplied" in text:
        text += (
            " (the server asks for a password and none was given: not in PGWORK_DSN, nor in "
            "PGPASSWORD, nor in a .pgpass this user can read; check the service's env file)"
        )
    if "unsupported startup parameter" in text:
        text += (
            " (a transaction pooler such as PgBouncer refuses the settings pgwork sends as it "
            'connects: set database.pooler = "transaction", or PGWORK_DATABASE_POOLER=transaction, '
            "and give LISTEN a direct connection with database.listen_dsn)"
        )
    return text


async def wait_until_reachable(
    dsn: str,
    *,
    timeout: float,
    stop: anyio.Event,
    on_failure: Callable[[], None] | None = None,
    on_wait: Callable[[str], None] | None = None,
    pooled: bool = False,
) -> bool:
    """Wait until the database answers (retrying with backoff, logging each failure) and its
    schema is this code's, with no migration asking the daemons to step aside: while the schema
    is older or a migration runs, wait for `pgwork migrate` (``on_wait`` is told why). Returns
    False when ``stop`` is set first.

    :raises SchemaError: when the schema is missing or newer than this code.
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
        return await _wait_for_schema(conn, stop, on_wait)
    finally:
        await conn.close()


#: How often a daemon waiting for `pgwork migrate` looks again.
SCHEMA_POLL = 1.0


async def _wait_for_schema(
    conn: AsyncConnection[Any], stop: anyio.Event, on_wait: Callable[[str], None] | None
) -> bool:
    told = ""
    forgot = False
    while True:
        v = await schema_version(conn)
        if v is None or v > SCHEMA_VERSION:
            await check_schema(conn)  # raises, saying which
        if v == SCHEMA_VERSION and not forgot:
            forgot = True
            await _forget_a_killed_migrate(conn)
        asked_by = await store.migration_pending(conn)
        # Raises when this build's code was replaced there (it is older).
        other = await other_code(conn) if v == SCHEMA_VERSION else None
        if v == SCHEMA_VERSION and asked_by is None and other is None:
            return True
        why = (
            f"`pgwork migrate` ({asked_by}) is migrating: waiting for it"
            if asked_by is not None
            else f"the database's pgwork SQL code is another build's ({other}; this pgwork's is "
            f"{code_checksum()}): waiting for `pgwork migrate`"
            if other is not None
            else f"the database's pgwork schema is version {v}, older than this pgwork "
            f"(version {SCHEMA_VERSION}): waiting for `pgwork migrate`"
        )
        if why != told:
            told = why
            log.warning(why)
            if on_wait is not None:
                on_wait(why)
        with anyio.move_on_after(SCHEMA_POLL):
            await stop.wait()
        if stop.is_set():
            return False


async def _forget_a_killed_migrate(conn: AsyncConnection[Any]) -> None:
    """A `pgwork migrate` killed mid-run leaves its claim (and request) in the owner's row;
    nobody obeys it, and the first daemon to start clears it (``migration_forget_stale``). A
    role without the grant (an older install's) leaves it to the next migrate."""
    try:
        if await store.migration_forget_stale(conn):
            log.info("cleared the claim of a `pgwork migrate` that is gone (killed mid-run)")
    except psycopg.DatabaseError as e:
        log.debug("could not clear a gone migrate's claim: %s", e)


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
    other = await other_code(conn)
    if other is not None:
        raise SchemaError(
            f"the database's pgwork SQL code is another build's ({other}; this pgwork's is "
            f"{code_checksum()}): run `pgwork migrate`"
        )
    fields = await store.type_fields(conn, "pgwork.claimed")
    if fields != store.Claimed._fields:
        raise SchemaError(
            f"pgwork.claimed has the fields {', '.join(fields)}; this pgwork reads "
            f"{', '.join(store.Claimed._fields)}: the type was changed by hand, or this code's "
            "schema files disagree with pgwork/store/"
        )


#: The first schema that records its SQL code's checksum (pgwork.schema_version.code_checksum):
#: from it on, a build whose code differs at the same version migrates by applying its code.
CODE_SINCE = 25


async def other_code(conn: AsyncConnection[Any]) -> str | None:
    """At a version that records it: the database's SQL code checksum when it is not this
    build's (``"none recorded"`` before a migrate recorded one); None when it is.

    :raises SchemaError: when this build's code is among those the database's replaced: the
        database runs newer code, and this build may neither run nor migrate there.
    """
    mine = code_checksum()
    got = await store.schema_code(conn)
    if got.code_checksum == mine:
        return None
    if mine in got.code_replaced:
        raise SchemaError(
            f"the database runs newer SQL code than this pgwork (code {got.code_checksum}; this "
            f"build's {mine} was replaced there): upgrade pgwork before running it here"
        )
    return got.code_checksum or "none recorded"
