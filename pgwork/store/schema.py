"""The bindings of room schema: the statements of the schema: its version and code, migrate's locks
and steps, the step-aside handshake (``pgwork/sql/queries/schema.sql``), one typed function
each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import LiteralString, cast

from ._bind import Conn, _dicts, _exec, _one, _rows, _value


async def schema_installed(conn: Conn) -> bool:
    return await _value(conn, "schema_installed", bool)


async def schema_version(conn: Conn) -> int:
    return await _value(conn, "schema_version", int)


@dataclass(frozen=True)
class SchemaCode:
    code_checksum: str | None
    code_replaced: list[str]


async def schema_code(conn: Conn) -> SchemaCode:
    return await _one(conn, "schema_code", SchemaCode)


async def schema_code_set(conn: Conn, *, checksum: str) -> None:
    await _exec(conn, "schema_code_set", {"checksum": checksum})


async def schema_version_set(conn: Conn, version: int) -> None:
    await _exec(conn, "schema_version_set", {"version": version})


async def migrate_lock(conn: Conn, *, installed: bool, wait: str) -> None:
    """The migration transaction's lock, its first statement (see migrate_lock); ``installed``:
    whether the schema's table exists to be locked."""
    if installed:
        await _exec(conn, "migrate_wait", {"wait": wait})
        await _exec(conn, "migrate_lock")
    else:
        await _exec(conn, "migrate_lock_install")


async def migrate_lock_holders(conn: Conn) -> str:
    """The sessions holding locks on pgwork's tables, as a log line names them."""
    got = await _dicts(conn, "migrate_lock_holders", {})
    return (
        ", ".join(
            f"pid {g['pid']} ({g['usename']}, {g['application_name'] or 'no application_name'}, "
            f"{g['client_addr'] or 'local'}, {g['state']}: {g['locks']})"
            for g in got
        )
        or "nobody now"
    )


async def migrate_timeouts(conn: Conn, *, lock_timeout: str) -> None:
    await _exec(conn, "migrate_timeouts", {"lock_timeout": lock_timeout})


async def migrate_lock_apps_tables(conn: Conn) -> None:
    await _exec(conn, "migrate_lock_apps_tables")


async def migrate_attach_locks(conn: Conn) -> None:
    await _exec(conn, "migrate_attach_locks")


async def index_valid(conn: Conn, *, name: str) -> bool | None:
    """Whether pgwork's index ``name`` is valid; None: there is none."""
    got = await _dicts(conn, "index_valid", {"name": name})
    return got[0]["valid"] if got else None


async def index_drop_concurrently(conn: Conn, *, name: str) -> None:
    """Drop an index an interrupted concurrent build left invalid (outside a transaction)."""
    got = await _dicts(conn, "index_drop_concurrently", {"name": name})
    # The statement the server quoted (format %I) for the one name it found in pgwork.
    await conn.execute(cast(LiteralString, got[0]["statement"]))


async def code_drop_stale(conn: Conn, *, names: list[str]) -> list[str]:
    """Drop each overload of a code function's name that this migration did not write; returns
    the names of the functions whose old signature went."""
    got = await _dicts(conn, "code_drop_stale", {"names": names})
    for r in got:
        # The statement the server quoted (regprocedure), for a function it found in pgwork.
        await conn.execute(cast(LiteralString, r["statement"]))
    return [r["name"] for r in got]


async def session_unbounded(conn: Conn) -> None:
    await _exec(conn, "session_unbounded")


async def session_bounded(conn: Conn) -> None:
    await _exec(conn, "session_bounded")


async def time_zones_refresh(conn: Conn) -> None:
    await _exec(conn, "time_zones_refresh")


@dataclass(frozen=True)
class LiveDaemon:
    id: str
    host: str
    pid: int
    version: str
    #: None: it predates the migration handshake.
    schema_version: int | None


async def migrate_daemons(conn: Conn) -> list[LiveDaemon]:
    """The daemons alive now, whatever the schema's version (``pgwork migrate``)."""
    return await _rows(conn, "migrate_daemons", LiveDaemon)


async def migration_request(conn: Conn, *, legacy: bool, by: str) -> None:
    """Ask the running daemons to step aside (NOTIFY pgwork_migrate). ``legacy``: a schema from
    15 to 21, whose daemons read the request in pgwork.config (under migration_hold_legacy);
    otherwise this session holds the claim (``migration_claim``)."""
    await _exec(conn, "migration_request_legacy" if legacy else "migration_request", {"by": by})


async def migration_clear(conn: Conn, *, legacy: bool = False) -> None:
    await _exec(conn, "migration_clear_legacy" if legacy else "migration_clear")


async def migration_pending(conn: Conn) -> str | None:
    """Who asks the daemons to step aside now (None: nobody): a request in the owner's row
    whose migrate's session is alive (one left by a killed migrate is nobody's)."""
    got = await _dicts(conn, "migration_pending", {})
    return got[0]["migration_requested_by"] if got else None


async def migration_forget_stale(conn: Conn) -> bool:
    """Clear a killed migrate's claim and request (its session is gone); True if one was."""
    got = await _dicts(conn, "migration_forget_stale", {})
    return bool(got and got[0]["cleared"])


async def migration_session_name(conn: Conn, *, name: str) -> str:
    """Set this session's application_name to ``name``; returns the one it had."""
    got = await _dicts(conn, "migration_session_name", {"name": name})
    return str(got[0]["previous"])


async def migration_hold_legacy(conn: Conn) -> None:
    await _exec(conn, "migration_hold_legacy")


async def migration_release_legacy(conn: Conn) -> None:
    await _exec(conn, "migration_release_legacy")


async def migration_claim(conn: Conn, *, by: str) -> int | None:
    """Claim the schema's row for this migrate; returns the version read under its lock, or
    None when another live migrate holds it."""
    got = await _dicts(conn, "migration_claim", {"by": by})
    return int(got[0]["version"]) if got else None


async def migration_holder(conn: Conn) -> str:
    """The migrate holding the schema's row, as a log line names it."""
    got = await _dicts(conn, "migration_holder", {})
    if not got or got[0]["migration_requester"] is None:
        return "nobody"
    return f"{got[0]['migration_requested_by']} (session pid {got[0]['migration_requester']})"


async def migration_release(conn: Conn) -> None:
    await _exec(conn, "migration_release")
