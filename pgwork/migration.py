"""`pgwork migrate`: bring the schema to this code's version and its SQL code to this build's, in
one transaction under its lock, after clearing the way (daemons asked to step aside, older ones
waited for), each lock waited for a bounded time and the attempt tried again."""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import psycopg
from psycopg import AsyncConnection

from . import SCHEMA_VERSION, store
from .db import CODE_SINCE, MigrateRefused, SchemaError, other_code, redact, schema_version
from .queries import (
    Step,
    code_checksum,
    code_functions,
    code_sql,
    migration_sql,
    split_migration,
    tables_sql,
)

log = logging.getLogger("pgwork.migration")


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
    # The claim names this session by its pid and its application_name, set to a name of its
    # own for the run: a killed migrate's pid, taken by another session, is not this claim.
    session = f"pgwork migrate {secrets.token_hex(4)}"
    named = await store.migration_session_name(conn, name=session)
    try:
        v = await _claim(conn, f"{by} (session {session})", wait_for_other)
        try:
            return await _migrate_asking(
                conn, v, version, steps or {}, by, wait_for_old, step_aside_within
            )
        finally:
            with anyio.CancelScope(shield=True):
                await store.migration_release(conn)
    finally:
        with anyio.CancelScope(shield=True):
            await store.migration_session_name(conn, name=named)


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
        # What an upgrade does, not a fault: one line, the function's name (the old signature,
        # a dozen types long, is the server's business).
        log.info("migrate: pgwork.%s takes new arguments; its old definition is dropped", dropped)
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
