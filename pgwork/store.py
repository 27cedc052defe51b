"""Typed access to every statement in ``sql/queries.sql``: one function per statement, keyword
parameters, rows as frozen dataclasses. Callers never pass a statement name or read an untyped
dict, so mypy checks every call and a renamed column fails at its first use, naming the field.

The SQL stays in ``queries.sql`` (one place, readable as SQL); this module only binds it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from functools import partial
from typing import TYPE_CHECKING, Any, LiteralString, NamedTuple, TypeAlias, TypeVar, cast
from uuid import UUID

from psycopg import AsyncConnection, AsyncCursor, AsyncRawCursor, Error
from psycopg.pq import TransactionStatus
from psycopg.rows import (
    AsyncRowFactory,
    BaseRowFactory,
    RowMaker,
    class_row,
    dict_row,
    tuple_row,
)

from . import SCHEMA_VERSION
from .queries import P, Q

if TYPE_CHECKING:
    from .config import ChannelConfig

Conn = AsyncConnection[Any]


class Status(StrEnum):
    """A work row's status, as pgwork.renewal_work's constraint spells them (a str: rows from
    the database compare equal to these)."""

    READY = "ready"
    CLAIMED = "claimed"
    DELIVERED = "delivered"
    DEAD = "dead"
    CANCELLED = "cancelled"
    SUPERSEDED = "superseded"
    EXPIRED = "expired"


T = TypeVar("T")


def _cursor(conn: Conn, name: str, row_factory: AsyncRowFactory[T]) -> AsyncCursor[T]:
    """A cursor for statement ``name``: a raw one for those converted to ``$n`` at import
    (``queries.P``: too long for psycopg's conversion cache), which ``_execute`` sends as such."""
    if name in P:
        return AsyncRawCursor(conn, row_factory=row_factory)
    return conn.cursor(row_factory=row_factory)


async def _execute(cur: AsyncCursor[Any], name: str, params: dict[str, Any]) -> None:
    """Run statement ``name`` on a cursor made by ``_cursor`` for it."""
    pos = P.get(name)
    if pos is None:
        await cur.execute(Q[name], params)
    else:
        await cur.execute(pos.sql, pos.args(params))


async def _rows(
    conn: Conn, name: str, cls: type[T], params: dict[str, Any] | None = None
) -> list[T]:
    async with _cursor(conn, name, class_row(cls)) as cur:
        await _execute(cur, name, params or {})
        return await cur.fetchall()


NT = TypeVar("NT", bound=tuple[Any, ...])


def _tuple_rows(cls: type[NT]) -> BaseRowFactory[NT]:
    """Rows as the named tuple ``cls``, built positionally. The result's column names are checked
    against the fields once per result, so a statement whose columns drift from the class fails
    at once, naming both, instead of filling fields with the wrong values."""
    expected: tuple[str, ...] = cls._fields  # type: ignore[attr-defined]

    def factory(cur: Any) -> RowMaker[NT]:
        names = _column_names(cur)
        if names != expected:
            raise TypeError(f"{cls.__name__}: the statement returns {names}, not {expected}")
        return partial(tuple.__new__, cls)

    return factory


def _column_names(cur: Any) -> tuple[str, ...]:
    """The current result's column names, read from the result itself (``cur.description``
    builds a Column object per column: a sixth of the page call's client side)."""
    res = cur.pgresult
    if res is None:
        return ()
    return tuple((res.fname(i) or b"").decode() for i in range(res.nfields))


async def _one(conn: Conn, name: str, cls: type[T], params: dict[str, Any] | None = None) -> T:
    got = await _rows(conn, name, cls, params)
    if len(got) != 1:
        raise RuntimeError(f"{name}: expected one row, got {len(got)}")
    return got[0]


async def _exec(conn: Conn, name: str, params: dict[str, Any] | None = None) -> None:
    async with _cursor(conn, name, tuple_row) as cur:
        await _execute(cur, name, params or {})


async def _dicts(conn: Conn, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """For the inspection commands, which show every column as it is."""
    async with _cursor(conn, name, dict_row) as cur:
        await _execute(cur, name, params)
        return await cur.fetchall()


# -- schema ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Installed:
    installed: bool


@dataclass(frozen=True)
class _Version:
    version: int


async def schema_installed(conn: Conn) -> bool:
    return (await _one(conn, "schema_installed", _Installed)).installed


async def schema_version(conn: Conn) -> int:
    return (await _one(conn, "schema_version", _Version)).version


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
    the statements run."""
    got = await _dicts(conn, "code_drop_stale", {"names": names})
    for r in got:
        # The statement the server quoted (regprocedure), for a function it found in pgwork.
        await conn.execute(cast(LiteralString, r["statement"]))
    return [r["statement"] for r in got]


async def session_unbounded(conn: Conn) -> None:
    await _exec(conn, "session_unbounded")


async def session_bounded(conn: Conn) -> None:
    await _exec(conn, "session_bounded")


async def time_zones_refresh(conn: Conn) -> None:
    await _exec(conn, "time_zones_refresh")


@dataclass(frozen=True)
class _Now:
    now: datetime


async def db_now(conn: Conn) -> datetime:
    return (await _one(conn, "db_now", _Now)).now


@dataclass(frozen=True)
class _Standby:
    standby: bool


async def is_standby(conn: Conn) -> bool:
    return (await _one(conn, "is_standby", _Standby)).standby


async def listen(conn: Conn) -> None:
    await _exec(conn, "listen")


async def ping(conn: Conn) -> None:
    await _exec(conn, "ping")


# -- materialiser ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Page:
    cutoff: datetime
    scanned: int
    made: int
    made_due: int
    #: Occurrences closed as expired by the channel's catch_up policy instead of sent (the
    #: page's column name; the pass calls them ``caught_up``).
    skipped: int
    notified: int
    earliest_made: datetime | None
    last_at: datetime | None
    last_id: int | None
    #: Series whose share of the page ended short of the cutoff: the next pass goes on.
    unfinished: int


_PAGE_COLUMNS = tuple(f.name for f in fields(Page))


async def materialise_page(
    conn: Conn,
    *,
    coordinate: bool,
    cutoff: datetime | None,
    lookahead: timedelta,
    after_at: datetime | None,
    after_id: int,
    limit: int,
    origin: str = "",
    take: Sequence[ClaimRequest] = (),
    aside: Sequence[int] = (),
) -> tuple[Page | None, list[Claimed]]:
    """One page, one statement (its own transaction): the coordination lock, the page, and the
    rows it inserted claimed for the channels in ``take`` (up to each one's ``limit``; they share
    one lease length and daemon). The page is None when another materialiser holds the lock.
    ``origin`` is the payload of the page's NOTIFY (a daemon's listener skips its own: its
    workers were told)."""
    params = {
        "coordinate": coordinate,
        "cutoff": cutoff,
        "lookahead": lookahead,
        "after_at": after_at,
        "after_id": after_id,
        "limit": limit,
        "origin": origin,
        # One JSON text, not three arrays: psycopg's dumping of the arrays cost more than the
        # rest of the call's client side together.
        "take": json.dumps(
            [
                {
                    "channel": t.channel,
                    "room": t.limit,
                    "expire_after_s": t.expire_after.total_seconds() if t.expire_after else None,
                }
                for t in take
            ]
        ),
        "lease": take[0].lease if take else timedelta(0),
        "daemon_id": take[0].daemon_id if take else "",
        "aside": list(aside),
    }
    assert all(t.lease == params["lease"] and t.daemon_id == params["daemon_id"] for t in take)
    async with conn.cursor() as cur:
        if any(t.synchronous for t in take):
            # The page function commits without waiting for the WAL flush; a page that claims
            # for a channel whose claims are synchronous takes that back before its commit
            # (same transaction, same round trip).
            async with _one_round_trip(conn):
                await cur.execute(Q["materialise_page"], params)
                await conn.execute(Q["commit_synchronously"])
        else:
            await cur.execute(Q["materialise_page"], params)
        names = _column_names(cur)
        if names != _PAGE_COLUMNS + Claimed._fields:
            raise TypeError(f"materialise_page returns {names}, not the Page and Claimed fields")
        got = await cur.fetchall()
    n = len(_PAGE_COLUMNS)
    if not got:
        return None, []
    page = Page(*got[0][:n])
    return page, [tuple.__new__(Claimed, r[n:]) for r in got if r[n] is not None]


@dataclass(frozen=True)
class DueReminder:
    id: int
    source: str
    business_key: str
    fire_at: datetime


@dataclass(frozen=True)
class SetAside:
    """A reminder a materialiser's page failed on, left out of pages for a while."""

    reminder_id: int
    source: str
    business_key: str
    #: The occurrence it failed on.
    fire_at: datetime
    #: The daemon that last tried it.
    daemon_id: str
    since: datetime
    tried_at: datetime
    next_try_at: datetime
    tries: int
    error: str


async def set_aside_record(
    conn: Conn, reminder: DueReminder, *, daemon_id: str, wait: float, error: str
) -> None:
    await _exec(
        conn,
        "set_aside_record",
        {
            "reminder_id": reminder.id,
            "source": reminder.source,
            "business_key": reminder.business_key,
            "fire_at": reminder.fire_at,
            "daemon_id": daemon_id,
            "wait": wait,
            "error": error,
        },
    )


async def set_aside_forget(conn: Conn) -> int:
    """Forgets the reminders no longer stuck; returns how many are left."""
    got = await _dicts(conn, "set_aside_forget", {})
    return int(got[0]["left_aside"])


async def set_aside_list(
    conn: Conn, *, reminder_id: int | None = None, limit: int = 100
) -> list[SetAside]:
    return await _rows(
        conn, "set_aside_list", SetAside, {"reminder_id": reminder_id, "limit": limit}
    )


async def next_due_reminder(
    conn: Conn,
    *,
    cutoff: datetime | None,
    lookahead: timedelta,
    after_at: datetime | None,
    after_id: int,
    aside: Sequence[int],
) -> DueReminder | None:
    got = await _rows(
        conn,
        "next_due_reminder",
        DueReminder,
        {
            "cutoff": cutoff,
            "lookahead": lookahead,
            "after_at": after_at,
            "after_id": after_id,
            "aside": list(aside),
        },
    )
    return got[0] if got else None


async def materialise_record_pass(
    conn: Conn, *, cutoff: datetime, made: int, duration_ms: float
) -> None:
    await _exec(
        conn,
        "materialise_record_pass",
        {"cutoff": cutoff, "made": made, "duration_ms": duration_ms},
    )


@dataclass(frozen=True)
class NextFire:
    at: datetime | None
    id: int | None
    after_cutoff_s: float | None
    #: The earliest occurrence of the reminders set aside (None: none due at all).
    aside_at: datetime | None = None


async def next_fire_at(conn: Conn, *, cutoff: datetime, aside: Sequence[int] = ()) -> NextFire:
    return await _one(conn, "next_fire_at", NextFire, {"cutoff": cutoff, "aside": list(aside)})


@dataclass(frozen=True)
class MaterialiserState:
    last_cutoff: datetime | None
    last_pass_at: datetime | None
    last_inserted: int
    last_duration_ms: float
    total_inserted: int
    cutoff_age_seconds: float | None


async def materialiser_state(conn: Conn) -> MaterialiserState:
    return await _one(conn, "materialiser_state", MaterialiserState)


# -- daemons and channels --------------------------------------------------------------------


@dataclass(frozen=True)
class _Name:
    name: str


async def register_channels(conn: Conn, channels: Sequence[ChannelConfig]) -> list[str]:
    """Register the channels (reminders naming them are accepted from then on) with their shared
    settings; returns those whose settings changed."""
    cs = list(channels)
    got = await _rows(
        conn,
        "register_channels",
        _Name,
        {
            "names": [c.name for c in cs],
            "kinds": [c.kind for c in cs],
            "catch_up": [c.catch_up for c in cs],
            "global_concurrency": [c.global_concurrency for c in cs],
            "rate_limit": [c.rate_limit for c in cs],
            "rate_burst": [c.rate_burst for c in cs],
            "breaker_after": [c.breaker_after for c in cs],
            "breaker_probe": [
                timedelta(seconds=c.breaker_probe) if c.breaker_after else None for c in cs
            ],
        },
    )
    return [r.name for r in got]


@dataclass(frozen=True)
class ChannelState:
    name: str
    kind: str
    paused: bool
    paused_at: datetime | None
    paused_by: str | None
    paused_reason: str | None
    #: The throttle stops a claim now: held until its Retry-After, or its limit all taken.
    throttled: bool
    throttled_for_seconds: float | None
    #: Rows it may have claimed at once after a throttle (None: no limit); each success
    #: raises it by one, and it is lifted at ``throttle_from``.
    throttle_limit: int | None
    throttle_from: int | None
    #: When a receiver last throttled it (or the breaker tripped).
    throttled_at: datetime | None
    throttle_reason: str | None
    global_concurrency: int | None
    rate_limit: float | None
    rate_burst: float | None
    catch_up: str
    claimed: int
    next_retry_at: datetime | None

    @property
    def recovering(self) -> bool:
        """Claiming again after a throttle, under a limit not reached yet."""
        return self.throttle_limit is not None and not self.throttled


async def channel_states(conn: Conn) -> list[ChannelState]:
    return await _rows(conn, "channel_states", ChannelState)


@dataclass(frozen=True)
class _Changed:
    changed: bool


async def channel_pause(conn: Conn, *, channel: str, reason: str | None, actor: str) -> bool:
    """Pause ``channel``; False if it was paused already. :raises psycopg.errors.NoDataFound:"""
    p = {"channel": channel, "reason": reason, "actor": actor}
    return (await _one(conn, "channel_pause", _Changed, p)).changed


async def channel_resume(conn: Conn, *, channel: str, actor: str) -> bool:
    """Resume ``channel`` and lift its throttle; False if it was neither."""
    return (
        await _one(conn, "channel_resume", _Changed, {"channel": channel, "actor": actor})
    ).changed


@dataclass(frozen=True)
class ChannelUse:
    #: Reminders that name the channel, and the live (ready, claimed) work rows a retire with
    #: ``cancel`` closes (their reminders' or orphaned ones).
    reminders: int
    live: int
    #: Live rows on the channel whose reminder names another one now: moved there, not closed.
    moved: int = 0
    #: The live daemons that registered it ("id (host, pid N)").
    served_by: list[str] = field(default_factory=list)


async def channel_retire(conn: Conn, *, channel: str, cancel: bool) -> ChannelUse | None:
    """Remove ``channel`` when nothing uses it (or, ``cancel``, after deleting its reminders);
    None if there is no such channel. Returns what used it: when that is anything and not
    ``cancel``, nothing is changed. Needs the schema owner's rights (it deletes reminders)."""
    async with conn.transaction():
        got = await _rows(conn, "channel_retire_hold", ChannelUse, {"channel": channel})
        if not got:
            return None
        use = got[0]
        if (use.reminders or use.live) and not cancel:
            return use
        await _exec(conn, "channel_retire_cancel", {"channel": channel})
        await _exec(conn, "channel_retire_close_work", {"channel": channel})
        await _exec(conn, "channel_retire", {"channel": channel})
        return use


async def daemon_register(
    conn: Conn,
    *,
    id: str,
    host: str,
    pid: int,
    version: str,
    heartbeat_every: timedelta,
    listener_up: bool | None,
    metrics_at: str | None = None,
    channels: Sequence[str] = (),
) -> None:
    await _exec(
        conn,
        "daemon_register",
        {
            "schema_version": SCHEMA_VERSION,
            "id": id,
            "host": host,
            "pid": pid,
            "version": version,
            "heartbeat_every": heartbeat_every,
            "listener_up": listener_up,
            "metrics_at": metrics_at,
            "channels": list(channels),
        },
    )


async def daemon_heartbeat(conn: Conn, *, id: str, listener_up: bool | None) -> str | None:
    """Refresh this daemon's row; returns who asks the daemons to step aside for a migration
    (None: nobody)."""
    got = await _dicts(conn, "daemon_heartbeat", {"id": id, "listener_up": listener_up})
    return got[0]["migration_requested_by"] if got else None


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


async def daemon_unregister(conn: Conn, *, id: str) -> None:
    await _exec(conn, "daemon_unregister", {"id": id})


@dataclass(frozen=True)
class _Id:
    id: Any


async def daemons_forget_gone(conn: Conn) -> list[str]:
    return [r.id for r in await _rows(conn, "daemons_forget_gone", _Id)]


@dataclass(frozen=True)
class DaemonRow:
    id: str
    host: str
    pid: int
    version: str
    started_at: datetime
    heartbeat_at: datetime
    #: None: this daemon runs without a listener (behind a pooler, no listen_dsn).
    listener_up: bool | None
    #: HOST:PORT of its metrics (None: metrics off).
    metrics_at: str | None
    heartbeat_age_seconds: float
    gone: bool


async def daemons(conn: Conn) -> list[DaemonRow]:
    return await _rows(conn, "daemons", DaemonRow)


# -- claim, outcomes, leases -----------------------------------------------------------------


@dataclass(frozen=True)
class Occurrence:
    """One occurrence of a reminder: what every attempt to send it shares."""

    #: Stable idempotency key of the occurrence (same on every attempt and after redrive).
    operation_id: UUID
    source: str
    business_key: str
    #: The reminder's deadline.
    deadline: datetime
    #: How long before the deadline this send is (``timedelta(0)``: at the deadline).
    occurrence: timedelta
    #: When this occurrence was due (deadline minus occurrence).
    due_at: datetime
    channel: str


#: What a claim is known by: (work id, lease), the row and the lease that claimed it (the
#: fencing token); every change after the claim names both. A plain tuple under a name: one is
#: made for every row claimed and every outcome settled, and a NamedTuple costs ten times more.
ClaimKey: TypeAlias = tuple[int, int]


class Identity(NamedTuple):
    """This daemon, as the ledger and the daemon table name it."""

    daemon_id: str
    host: str
    pid: int


class Claimed(NamedTuple):
    """A row the claim statement touched: claimed for delivery (``status == 'claimed'``), or
    closed instead of sent (cancelled, superseded, dead).

    A named tuple, read positionally (see ``_tuple_rows``): the claim returns up to a batch of
    these per statement, one per delivery (a frozen dataclass from keywords: bench/README.md,
    "Per-delivery code"; the column names are checked once, test_hot_path.py::
    test_claimed_rows_are_read_by_column_name_checked_once). The fields are in the statement's
    column order; the occurrence's own fields mean what they mean in ``Occurrence``."""

    id: int
    reminder_id: int
    source: str
    business_key: str
    deadline: datetime
    occurrence: timedelta
    due_at: datetime
    channel: str
    operation_id: UUID
    status: str
    attempts: int
    attempts_base: int
    lease: int
    #: Since when this occurrence has been tried (its due time, or its last redrive): the
    #: channel's retry_for counts from here.
    retry_since: datetime
    prev_status: str
    recipient: str | None
    #: The payload as JSON text, exactly as stored.
    payload: str | None
    #: W3C trace context the reminder was written with (None: none).
    traceparent: str | None
    tracestate: str | None
    #: An occurrence of a recurring reminder: its deadline as local time, and the zone (None
    #: for a one-off).
    deadline_local: datetime | None
    time_zone: str | None


async def type_fields(conn: Conn, name: str) -> tuple[str, ...]:
    """The fields of the composite type ``name``, in order: pgwork.claimed (what ``Claimed``'s
    must be) and pgwork.outcome (what ``duties.outcomes.Record.json_text`` writes)."""
    return tuple(r["name"] for r in await _dicts(conn, "type_fields", {"type": name}))


@dataclass(frozen=True)
class ClaimRequest:
    """One channel's claim: up to ``limit`` rows the channel's gate allows."""

    channel: str
    limit: int
    max_attempts: int
    lease: timedelta
    daemon_id: str
    expire_after: timedelta | None = None
    #: Commit the claim after the WAL flush (``database.synchronous_claims``).
    synchronous: bool = False

    def params(self) -> dict[str, Any]:
        return {
            "channel": self.channel,
            "limit": self.limit,
            "max_attempts": self.max_attempts,
            "lease": self.lease,
            "daemon_id": self.daemon_id,
            "expire_after": self.expire_after,
            "synchronous_commit": "on" if self.synchronous else "off",
        }


async def claim_work(conn: Conn, req: ClaimRequest) -> list[Claimed]:
    """One statement: the lanes and the limit's lock are taken first, whatever this daemon's
    config says (a throttle limit, the breaker's probe: the channel row's to say), then the
    rows (pgwork/sql/code/claim.sql)."""
    async with _cursor(conn, "claim_work", _tuple_rows(Claimed)) as cur:
        await _execute(cur, "claim_work", req.params())
        return await cur.fetchall()


@asynccontextmanager
async def _one_round_trip(conn: Conn) -> AsyncIterator[None]:
    """A transaction of the statements sent in the block, in one round trip: BEGIN, the
    statements and COMMIT in one pipeline. psycopg's ``conn.transaction()`` in a pipeline
    syncs when it begins and when it commits (more round trips: the no-op burn-down did 19k
    instead of 23k jobs/s with it; bench/HISTORY.md, issue 26). On an error the transaction is
    rolled back here, so the connection goes back to the pool idle. In a transaction the caller
    opened (tests), the statements are simply part of it."""
    if conn.info.transaction_status == TransactionStatus.INTRANS:
        async with conn.pipeline():
            yield
        return
    try:
        async with conn.pipeline():
            await conn.execute("BEGIN")
            yield
            await conn.execute("COMMIT")
    except BaseException:
        if not conn.closed and conn.info.transaction_status != TransactionStatus.IDLE:
            with suppress(Error):
                await conn.rollback()
        raise


@dataclass(frozen=True)
class GateReading:
    """What the database says of a channel's gate: when its claim can next get rows (see
    next_available). ``deliver.gate.Gate`` is the worker's state built from it."""

    #: Seconds until the next row is claimable (negative: now); None when none.
    wait_s: float | None
    #: Paused, or retired (its row gone).
    paused: bool
    #: The channel's row is gone (`pgwork channel retire`): this daemon stops claiming it.
    retired: bool
    #: Seconds until a throttle's not_before passes (0: not held).
    hold_s: float | None
    #: Seconds until the rate limit has tokens for a small batch (None: no rate limit).
    tokens_s: float | None
    #: The global concurrency or throttle limit is reached.
    full: bool


async def next_available(conn: Conn, *, channel: str) -> GateReading:
    return await _one(conn, "next_available", GateReading, {"channel": channel})


@dataclass(frozen=True)
class Unapplied:
    """A record the outcome statement did not apply now: fenced, or ``already`` applied."""

    fenced_id: int
    lease: int
    already: bool


async def record_outcomes(
    conn: Conn, *, outcomes: str, daemon_id: str, host: str, pid: int
) -> list[Unapplied]:
    return await _rows(
        conn,
        "record_outcomes",
        Unapplied,
        {"outcomes": outcomes, "daemon_id": daemon_id, "host": host, "pid": pid},
    )


@dataclass(frozen=True)
class LeaseKept:
    """A row whose lease an extension renewed (``extend_leases``)."""

    id: int
    lease: int


async def extend_leases(
    conn: Conn, *, work_id: list[int], lease_no: list[int], lease: timedelta
) -> list[LeaseKept]:
    return await _rows(
        conn,
        "extend_leases",
        LeaseKept,
        {"work_id": work_id, "lease_no": lease_no, "lease": lease},
    )


async def release_leases(
    conn: Conn,
    *,
    work_id: list[int],
    lease_no: list[int],
    daemon_id: str,
    host: str,
    pid: int,
) -> list[int]:
    got = await _rows(
        conn,
        "release_leases",
        _Id,
        {
            "work_id": work_id,
            "lease_no": lease_no,
            "daemon_id": daemon_id,
            "host": host,
            "pid": pid,
        },
    )
    return [r.id for r in got]


# -- trends ----------------------------------------------------------------------------------


async def trend_write(conn: Conn, *, written_by: str, minutes: str) -> None:
    """Write a daemon's minutes (a JSON array; see the statement), each value whole."""
    await _exec(conn, "trend_write", {"written_by": written_by, "minutes": minutes})


async def trend_prune(conn: Conn, *, keep_hours: int, limit: int) -> int:
    """Delete up to ``limit`` minutes older than ``keep_hours``; returns how many went."""
    return (await _one(conn, "trend_prune", _N, {"keep_hours": keep_hours, "limit": limit})).n


@dataclass(frozen=True)
class TrendMinute:
    minute: datetime
    delivered: int
    failed: int
    dead: int
    fenced: int
    #: Seconds an attempt took, on average and at most (None: no attempt that minute).
    took_mean: float | None
    took_max: float | None


async def channel_trend(conn: Conn, *, channel: str, minutes: int) -> list[TrendMinute]:
    """A channel's last ``minutes`` minutes with anything recorded, oldest first."""
    return await _rows(conn, "channel_trend", TrendMinute, {"channel": channel, "minutes": minutes})


# -- dead letters ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DeadLetter:
    id: int
    source: str
    business_key: str
    channel: str
    deadline: datetime
    occurrence: timedelta
    due_at: datetime
    attempts: int
    dead_reason: str
    finished_at: datetime
    operation_id: UUID


async def dlq_list(
    conn: Conn,
    *,
    channel: str | None,
    source: str | None,
    older_than: timedelta | None,
    limit: int,
) -> list[DeadLetter]:
    return await _rows(
        conn,
        "dlq_list",
        DeadLetter,
        {"channel": channel, "source": source, "older_than": older_than, "limit": limit},
    )


async def work_get(conn: Conn, *, id: int) -> list[dict[str, Any]]:
    """Every column of one work row and its reminder, for ``pgwork dlq show``."""
    return await _dicts(conn, "work_get", {"id": id})


async def work_attempts(conn: Conn, *, id: int) -> list[dict[str, Any]]:
    """The attempt ledger of one work row, every column, for ``pgwork dlq show``."""
    return await _dicts(conn, "work_attempts", {"id": id})


@dataclass(frozen=True)
class Redriven:
    id: int
    #: ok, or why not: cancelled, superseded.
    verdict: str
    notified: int


async def dlq_redrive(
    conn: Conn,
    *,
    all: bool,
    ids: list[int],
    channel: str | None,
    operator: str,
    since: timedelta | None = None,
    reason_like: str | None = None,
    source: str | None = None,
) -> list[Redriven]:
    return await _rows(
        conn,
        "dlq_redrive",
        Redriven,
        {
            "all": all,
            "ids": ids,
            "channel": channel,
            "source": source,
            "operator": operator,
            "since": since,
            "reason_like": reason_like,
        },
    )


async def live_page(
    conn: Conn,
    *,
    channel: str,
    statuses: list[str],
    after: tuple[str, datetime, int] | None,
    limit: int,
) -> list[dict[str, Any]]:
    """One keyset page of a channel's live rows (``after``: the last row's source, available_at
    and id; None: the first page)."""
    src, at, id_ = after or ("", datetime.min.replace(tzinfo=UTC), 0)
    return await _dicts(
        conn,
        "live_page",
        {
            "channel": channel,
            "statuses": statuses,
            "after_source": src,
            "after_at": at,
            "after_id": id_,
            "limit": limit,
        },
    )


async def dead_page(
    conn: Conn,
    *,
    channel: str | None,
    source: str | None,
    reason_like: str | None,
    before: tuple[datetime, int] | None,
    limit: int,
    since: timedelta | None = None,
) -> list[dict[str, Any]]:
    """One keyset page of dead letters, newest first (``before``: the last row's finished_at and
    id; None: the first page)."""
    at, id_ = before or (datetime.max.replace(tzinfo=UTC), 2**63 - 1)
    return await _dicts(
        conn,
        "dead_page",
        {
            "channel": channel,
            "source": source,
            "since": since,
            "reason_like": reason_like,
            "before_at": at,
            "before_id": id_,
            "limit": limit,
        },
    )


async def reminders_page(
    conn: Conn, *, source: str, prefix: str, after: str, limit: int, scan: int = 2000
) -> list[dict[str, Any]]:
    """A source's reminders whose key starts with ``prefix``, by key, after ``after`` ('' for
    the first page), each with its latest work row's status."""
    return await _dicts(
        conn,
        "reminders_page",
        {"source": source, "prefix": prefix, "after": after, "limit": limit, "scan": scan},
    )


# -- gauges and status -----------------------------------------------------------------------


@dataclass(frozen=True)
class WorkState:
    channel: str
    status: str
    n: int


async def work_states(conn: Conn) -> list[WorkState]:
    return await _rows(conn, "work_states", WorkState)


@dataclass(frozen=True)
class Lag:
    lag_seconds: float
    oldest_ready_seconds: float
    unmaterialised_seconds: float


async def lag(conn: Conn) -> Lag:
    return await _one(conn, "lag", Lag)


@dataclass(frozen=True)
class TableHealth:
    table: str
    dead_tuples: int
    live_tuples: int


@dataclass(frozen=True)
class SourceLag:
    source: str
    lag_seconds: float
    #: Its oldest due occurrence has no work row yet (no daemon, the materialiser behind, or the
    #: reminder set aside).
    unmaterialised: bool


async def lag_by_source(conn: Conn) -> list[SourceLag]:
    """``lag`` per source, latest first."""
    return await _rows(conn, "lag_by_source", SourceLag)


async def oldest_overdue_channel(conn: Conn) -> str | None:
    """The channel of the oldest overdue live row, if any."""
    got = await _dicts(conn, "oldest_overdue_channel", {})
    return str(got[0]["channel"]) if got else None


async def table_health(conn: Conn) -> list[TableHealth]:
    return await _rows(conn, "table_health", TableHealth)


@dataclass(frozen=True)
class XminHorizon:
    age_seconds: float
    age_xids: int


async def xmin_horizon(conn: Conn) -> XminHorizon:
    return await _one(conn, "xmin_horizon", XminHorizon)


@dataclass(frozen=True)
class LockHolder:
    """A session holding a lock on a pgwork table that stops the daemon's work."""

    relation: str
    mode: str
    pid: int
    role: str | None
    application_name: str | None
    state: str | None
    #: Seconds its transaction (or, outside one, its session) has been open.
    held_s: float | None


async def lock_holders(conn: Conn) -> list[LockHolder]:
    return await _rows(conn, "lock_holders", LockHolder)


# -- retention -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Paused:
    paused: bool


async def retention_paused(conn: Conn) -> bool:
    return (await _one(conn, "retention_paused", _Paused)).paused


async def retention_set_paused(conn: Conn, *, paused: bool) -> None:
    await _exec(conn, "retention_set_paused", {"paused": paused})


@dataclass(frozen=True)
class Batch:
    scanned: int
    deleted: int
    ledger_deleted: int
    retired: int
    #: Series tombstones deleted: their deadline is two days past (no edit can bring it back).
    pruned: int
    last_at: datetime | None
    last_id: int | None


async def retention_delete_batch(
    conn: Conn,
    *,
    done_before: datetime,
    dead_before: datetime,
    after_at: datetime | None,
    after_id: int,
    limit: int,
    statement_timeout: str,
    lock_timeout: str,
) -> Batch:
    """One batch in its own transaction, under its own statement and lock timeouts (batch_limits,
    sent in the same round trip)."""
    params = {
        "done_before": done_before,
        "dead_before": dead_before,
        "after_at": after_at,
        "after_id": after_id,
        "limit": limit,
    }
    limits = {"statement_timeout": statement_timeout, "lock_timeout": lock_timeout}
    async with conn.pipeline(), conn.transaction():
        await conn.execute(Q["batch_limits"], limits)
        cur = conn.cursor(row_factory=class_row(Batch))
        await cur.execute(Q["retention_delete_batch"], params)
    got = await cur.fetchall()
    if len(got) != 1:
        raise RuntimeError(f"retention_delete_batch: expected one row, got {len(got)}")
    return got[0]


async def retention_record_pass(conn: Conn, *, deleted: int) -> None:
    await _exec(conn, "retention_record_pass", {"deleted": deleted})


@dataclass(frozen=True)
class RetentionState:
    last_pass_at: datetime | None
    last_deleted: int
    total_deleted: int
    paused: bool
    oldest_terminal_age_seconds: float | None


async def retention_state(conn: Conn) -> RetentionState:
    return await _one(conn, "retention_state", RetentionState)


@dataclass(frozen=True)
class _N:
    n: int


async def retention_backlog(
    conn: Conn, *, done_before: datetime, dead_before: datetime, limit: int
) -> int:
    """Terminal rows past their keep, counted up to ``limit``."""
    got = await _one(
        conn,
        "retention_backlog",
        _N,
        {"done_before": done_before, "dead_before": dead_before, "limit": limit},
    )
    return got.n


@dataclass(frozen=True)
class WorkStatus:
    id: int
    status: str


async def work_statuses(conn: Conn, ids: Sequence[int]) -> list[WorkStatus]:
    return await _rows(conn, "work_statuses", WorkStatus, {"ids": list(ids)})


@dataclass(frozen=True)
class _Exists:
    exists: bool


async def channel_exists(conn: Conn, name: str) -> bool:
    return (await _one(conn, "channel_exists", _Exists, {"name": name})).exists


async def retrying(conn: Conn, *, channel: str | None, limit: int) -> list[dict[str, Any]]:
    """Rows waiting for their next try, the soonest first (``pgwork dlq retrying``)."""
    return await _dicts(conn, "retrying", {"channel": channel, "limit": limit})


async def history_reminder(conn: Conn, *, source: str, business_key: str) -> dict[str, Any] | None:
    """The reminder as stored, or None (``pgwork reminder``)."""
    got = await _dicts(conn, "history_reminder", {"source": source, "business_key": business_key})
    return got[0] if got else None


async def history_upcoming(conn: Conn, *, source: str, business_key: str) -> list[dict[str, Any]]:
    """Its next occurrences and where each stands (``pgwork.reminder_status``)."""
    return await _dicts(conn, "history_upcoming", {"source": source, "business_key": business_key})


async def history_lockers(conn: Conn, *, reminder_id: int) -> list[dict[str, Any]]:
    """The sessions whose open transaction holds its row (the materialiser skips it meanwhile)."""
    return await _dicts(conn, "history_lockers", {"reminder_id": reminder_id})


async def history_work(
    conn: Conn, *, reminder_id: int | None, source: str, business_key: str, limit: int
) -> list[dict[str, Any]]:
    """Its work rows, the latest first: by the reminder's id, or by source and key once the
    reminder is gone."""
    if reminder_id is not None:
        return await _dicts(
            conn, "history_work_of_reminder", {"reminder_id": reminder_id, "limit": limit}
        )
    return await _dicts(
        conn,
        "history_work_of_key",
        {"source": source, "business_key": business_key, "limit": limit},
    )


async def history_attempts(conn: Conn, *, work_ids: Sequence[int]) -> list[dict[str, Any]]:
    """The attempt ledger of these work rows."""
    return await _dicts(conn, "history_attempts", {"work_ids": list(work_ids)})


async def history_retired(conn: Conn, *, reminder_id: int, limit: int) -> list[dict[str, Any]]:
    """The tombstones retention left of its older occurrences."""
    return await _dicts(conn, "history_retired", {"reminder_id": reminder_id, "limit": limit})
