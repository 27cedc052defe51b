"""Connections, the schema check and `pgwork migrate`."""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import psycopg
from psycopg import AsyncConnection
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool

from . import SCHEMA_VERSION, store
from .queries import (
    Step,
    code_checksum,
    code_functions,
    code_sql,
    migration_sql,
    split_migration,
    tables_sql,
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
    # libpq's own: the DSN asks for TLS the server does not offer, or cannot verify.
    r"|server does not support SSL, but SSL was required"
    r'|root certificate file ".*" does not exist'
    r'|server certificate for ".*" does not match host name'
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
    while True:
        v = await schema_version(conn)
        if v is None or v > SCHEMA_VERSION:
            await check_schema(conn)  # raises, saying which
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
            "schema files disagree with pgwork/store.py"
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


#: How long a migration waits for each lock it needs (an app's or a daemon's transaction holding
#: the table): past it, the attempt is rolled back, so the apps queued behind its lock request go
#: on, and tried again after a pause, at most MIGRATE_ATTEMPTS times. A statement itself may take
#: as long as its table needs.
MIGRATE_LOCK_TIMEOUT = "2s"
MIGRATE_ATTEMPTS = 5
#: How long a migration's transaction waits for another's (which only another migrate, or the
#: schema's owner by hand, can hold): past it, the attempt fails naming who holds it.
MIGRATE_WAIT = "60s"


#: The first schema whose daemons take part in the migration handshake (they register their
#: schema version, and step aside when a migration asks).
HANDSHAKE_SINCE = 15


def _named(daemons: Sequence[store.LiveDaemon]) -> str:
    return ", ".join(f"{d.host}/{d.pid} (pgwork {d.version})" for d in daemons)


#: The first schema whose request to step aside stands in the owner's row
#: (pgwork.schema_version), claimed by the migrate's session; before it, in pgwork.config under a
#: session advisory lock, as that version's daemons read it.
OWNED_SINCE = 22
#: How long `pgwork migrate` waits for another migrate (its whole run) by default, seconds.
WAIT_FOR_OTHER = 900.0


async def migrate(
    conn: AsyncConnection[Any],
    *,
    wait_for_old: float = 0.0,
    step_aside_within: float = 120.0,
    wait_for_other: float = WAIT_FOR_OTHER,
    by: str | None = None,
    version: int = SCHEMA_VERSION,
    steps: Mapping[int, str] | None = None,
) -> str:
    """Bring the schema to ``version`` (this code's) in one transaction. Idempotent and safe to
    run concurrently: a second migrate waits for the first (up to ``wait_for_other`` seconds,
    naming it), then reads the version and finds nothing to do. Returns what it did.

    An upgrade first clears the way: daemons alive now that predate the migration handshake are
    waited for up to ``wait_for_old`` seconds, then named in the refusal; the others are asked to
    step aside (pgwork.schema_version.migration_requested_at, which only the schema's owner
    writes, and NOTIFY pgwork_migrate, which only makes them look) and waited for up to
    ``step_aside_within`` seconds: each stops claiming, finishes or gives back its rows and exits;
    a daemon that starts meanwhile waits. The request is cleared by the migration's commit, or
    when it does not happen. A lock the migration cannot get within ``MIGRATE_LOCK_TIMEOUT`` (or
    a deadlock) rolls the attempt back; it is tried again after a pause, ``MIGRATE_ATTEMPTS``
    times in all. A committed migration is never tried again: its indexes are built after it,
    once. ``steps``: migrations by version beyond the shipped ones (tests).

    :raises SchemaError: when the database is newer than the code.
    :raises MigrateRefused: when daemons that cannot step aside run, or did not step aside, or
        another migrate held the schema for longer than ``wait_for_other``, or the role is not
        allowed to change the schema (the daemon's or an app's).
    """
    try:
        return await _migrate(
            conn, wait_for_old, step_aside_within, wait_for_other, by, version, steps
        )
    except psycopg.errors.InsufficientPrivilege as e:
        raise MigrateRefused(
            f"`pgwork migrate` runs as the pgwork schema's owner; role {conn.info.user} may not "
            f"change it ({redact(str(e)).strip().splitlines()[0]})"
        ) from None


async def _migrate(
    conn: AsyncConnection[Any],
    wait_for_old: float,
    step_aside_within: float,
    wait_for_other: float,
    by: str | None,
    version: int,
    steps: Mapping[int, str] | None,
) -> str:
    by = by or f"{socket.gethostname()}/{os.getpid()}"
    v = await schema_version(conn)
    if v is not None and HANDSHAKE_SINCE <= v < min(OWNED_SINCE, version):
        # The previous protocol, which the running daemons of that version read; re-read under
        # its lock: another migrate may have moved the schema on meanwhile.
        await store.migration_hold_legacy(conn)
        try:
            v = await schema_version(conn)
            if v is not None and v < OWNED_SINCE:
                return await _migrate_asking(
                    conn, v, version, steps or {}, by, wait_for_old, step_aside_within, legacy=True
                )
        finally:
            with anyio.CancelScope(shield=True):
                await store.migration_release_legacy(conn)
    if v is None or v < OWNED_SINCE:
        # No schema yet, or one before the handshake: nobody to ask.
        return await _migrate_asking(
            conn, v, version, steps or {}, by, wait_for_old, step_aside_within, asked=False
        )
    v = await _claim(conn, by, wait_for_other)
    try:
        return await _migrate_asking(
            conn, v, version, steps or {}, by, wait_for_old, step_aside_within
        )
    finally:
        with anyio.CancelScope(shield=True):
            await store.migration_release(conn)


async def _claim(conn: AsyncConnection[Any], by: str, within: float) -> int:
    """Claim the schema's row for this migrate, waiting (between statements: no snapshot held)
    for one that holds it; returns the version read under the claim."""
    start = anyio.current_time()
    told = ""
    while True:
        try:
            v = await store.migration_claim(conn, by=by)
        except psycopg.errors.LockNotAvailable:
            v = None  # the other's migration transaction holds the table: it is running
        if v is not None:
            return v
        holder = await store.migration_holder(conn)
        if anyio.current_time() - start >= within:
            raise MigrateRefused(
                f"another `pgwork migrate` has held the schema for {within:g}s: {holder}"
            )
        if holder != told:
            told = holder
            log.warning("migrate: waiting for another `pgwork migrate`: %s", holder)
        await anyio.sleep(0.25)


async def _migrate_asking(
    conn: AsyncConnection[Any],
    v: int | None,
    version: int,
    steps: Mapping[int, str],
    by: str,
    wait_for_old: float,
    step_aside_within: float,
    *,
    asked: bool = True,
    legacy: bool = False,
) -> str:
    # Stale: an older version, or this version with another build's code (raises when this
    # build's code is older than the database's: nobody is asked to step aside for it).
    stale = v is not None and (
        v < version or (v == version >= CODE_SINCE and await other_code(conn) is not None)
    )
    asked = asked and stale
    if asked:
        await store.migration_request(conn, legacy=legacy, by=by)
        try:
            await _clear_the_way(conn, wait_for_old, step_aside_within)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await store.migration_clear(conn, legacy=legacy)
            raise
    elif stale:
        await _clear_the_way(conn, wait_for_old, step_aside_within)
    pause = 0.5
    for attempt in range(1, MIGRATE_ATTEMPTS + 1):
        try:
            said = await _migrate_once(conn, version, steps, legacy=legacy)
            break
        except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected) as e:
            if attempt == MIGRATE_ATTEMPTS:
                if asked:
                    await store.migration_clear(conn, legacy=legacy)
                holders = await store.migrate_lock_holders(conn)
                raise MigrateRefused(
                    f"migrate: a lock was not available {MIGRATE_ATTEMPTS} times "
                    f"({redact(str(e)).strip().splitlines()[0]}); holding pgwork's tables: "
                    f"{holders}"
                ) from e
            log.warning(
                "migrate: a lock was not available, rolled back; trying again in %.1fs",
                pause,
                extra={"attempt": attempt, "error": redact(str(e)).strip().splitlines()[0]},
            )
            await anyio.sleep(pause)
            pause *= 2
        except BaseException:
            if asked:
                with anyio.CancelScope(shield=True):
                    await store.migration_clear(conn, legacy=legacy)
            raise
    # After the commit, once: a failure here is the index's, never the migration's to retry.
    await _build_concurrently(conn, version, steps)
    return said


#: A step that alters a table apps write, or what is attached to it: the legacy steps (before
#: schema 12) did, in an order of their own.
_CHANGES_APPS_TABLES = re.compile(
    r"(ALTER TABLE|LOCK TABLE|ON)\s+pgwork\.(reminder|renewal_work|retired|lane|channel|app_source)\b"
    r"|DROP (VIEW|POLICY|TRIGGER)",
    re.IGNORECASE,
)


def _uncommented(sql: str) -> str:
    return re.sub(r"--[^\n]*", "", sql)


def _step(version: int, extra: Mapping[int, str]) -> Step:
    return split_migration(extra[version]) if version in extra else migration_sql(version)


_INDEX_NAME = re.compile(r"CREATE INDEX CONCURRENTLY IF NOT EXISTS (\w+)", re.IGNORECASE)
_INDEX_DROP = re.compile(r"DROP INDEX CONCURRENTLY IF EXISTS ", re.IGNORECASE)


async def _build_concurrently(
    conn: AsyncConnection[Any], version: int, extra: Mapping[int, str]
) -> None:
    """The indexes the migrations up to ``version`` build or drop after their commit, in
    order: each that is missing is built, one an interrupted build left invalid is dropped and
    built again, one a later version dropped is dropped if it is there. Outside any
    transaction; each waits for the transactions already running, never stops a write."""
    # (name, statement) of each build; (None, statement) of each drop.
    todo = [
        (m.group(1) if (m := _INDEX_NAME.search(statement)) else None, statement)
        for n in range(2, version + 1)
        for statement in _step(n, extra).concurrently
        if _INDEX_NAME.search(statement) or _INDEX_DROP.search(statement)
    ]
    if not todo:
        return
    await store.session_unbounded(conn)
    try:
        for name, statement in todo:
            if name is None:
                await conn.execute(statement)
                continue
            valid = await store.index_valid(conn, name=name)
            if valid is True:
                continue
            if valid is False:
                log.warning("migrate: index pgwork.%s was left invalid: building it again", name)
                await store.index_drop_concurrently(conn, name=name)
            await conn.execute(statement)
    finally:
        await store.session_bounded(conn)


async def _clear_the_way(conn: AsyncConnection[Any], wait_for_old: float, within: float) -> None:
    """Return once no daemon runs: those that predate the handshake stopped (by someone) within
    ``wait_for_old`` seconds, the others stepped aside within ``within``."""
    start = anyio.current_time()
    said: set[str] = set()
    while True:
        live = await store.migrate_daemons(conn)
        old = [d for d in live if (d.schema_version or 0) < HANDSHAKE_SINCE]
        waited = anyio.current_time() - start
        if old:
            if waited >= wait_for_old:
                raise MigrateRefused(
                    f"stop these daemons first (they predate the migration handshake): "
                    f"{_named(old)}; or run `pgwork migrate --wait 10m` to wait for them"
                )
            if "old" not in said:
                said.add("old")
                log.warning("migrate: waiting for daemons to stop: %s", _named(old))
        elif not live:
            return
        elif waited >= within:
            raise MigrateRefused(
                f"these daemons did not step aside within {within:g}s: {_named(live)}"
            )
        elif "asked" not in said:
            said.add("asked")
            log.info("migrate: asked the running daemons to step aside: %s", _named(live))
        await anyio.sleep(0.25)


async def _migrate_once(
    conn: AsyncConnection[Any], version: int, extra: Mapping[int, str], *, legacy: bool = False
) -> str:
    installed = await store.schema_installed(conn)
    async with conn.transaction():
        # The lock first, a LOCK statement, which holds no snapshot while it waits.
        await store.migrate_lock(conn, installed=installed, wait=MIGRATE_WAIT)
        await store.migrate_timeouts(conn, lock_timeout=MIGRATE_LOCK_TIMEOUT)
        v = await schema_version(conn)
        if v is None:
            functions, attaches = code_sql()
            await conn.execute(tables_sql())
            await conn.execute(functions)
            await conn.execute(attaches)
            await store.schema_version_set(conn, version)
            if version >= CODE_SINCE:
                await store.schema_code_set(conn, checksum=code_checksum())
            return f"installed pgwork schema version {version}"
        if v > version:
            raise SchemaError(
                f"the database's pgwork schema is version {v}, newer than this pgwork "
                f"(version {version}); refusing to touch it"
            )
        if v == version:
            other = await other_code(conn) if version >= CODE_SINCE else None
            if other is None:
                await store.time_zones_refresh(conn)
                return f"pgwork schema already at version {v}"
            await _apply_code(conn, [])
            await store.schema_code_set(conn, checksum=code_checksum())
            await store.migration_clear(conn)
            return (
                f"applied the changed SQL code at version {v} (code {other} -> {code_checksum()})"
            )
        steps = [_step(step, extra) for step in range(v + 1, version + 1)]
        if any(_CHANGES_APPS_TABLES.search(_uncommented(s.before)) for s in steps):
            await store.migrate_lock_apps_tables(conn)
        for step in steps:
            await conn.execute(step.before)
        await _apply_code(conn, steps)
        await store.schema_version_set(conn, version)
        if version >= CODE_SINCE:
            await store.schema_code_set(conn, checksum=code_checksum())
        # Committed with the migration: the daemons that waited see the new version at once.
        # From schema 22 on (a schema from 15 to 21 drops its request's columns in 022).
        if version >= OWNED_SINCE:
            await store.migration_clear(conn)
        elif legacy:
            await store.migration_clear(conn, legacy=True)
        return f"upgraded pgwork schema from version {v} to {version}"


async def _apply_code(conn: AsyncConnection[Any], steps: Sequence[Step]) -> None:
    """The code once, as it is now (a function that goes is a migration's DROP): the functions,
    the backfills of ``steps`` that call them, then what locks the apps' tables, so that those
    locks are held only until the commit that follows. Its functions are created first, and any
    other overload of their names dropped: one an older install left (a signature changed within
    a version) would make every reference ambiguous."""
    creates, names = code_functions()
    await conn.execute(creates)
    for dropped in await store.code_drop_stale(conn, names=list(names)):
        log.warning("migrate: %s (a signature this code no longer has)", dropped)
    functions, attaches = code_sql()
    await conn.execute(functions)
    for step in steps:
        if step.after.strip():
            await conn.execute(step.after)
    # The tables apps write, locked in the order their statements lock them (a reminder, then
    # through its triggers its work rows), so that no app statement and this migration each
    # hold what the other waits for.
    await store.migrate_attach_locks(conn)
    await conn.execute(attaches)
