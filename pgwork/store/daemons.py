"""The bindings of room daemons: the statements of daemons and channels: registration, heartbeats,
a channel's state, pause, resume, retire (``pgwork/sql/queries/daemons.sql``), one typed
function each."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from .. import SCHEMA_VERSION

if TYPE_CHECKING:
    from ..settings import ChannelConfig

from ._bind import Conn, _column, _dicts, _exec, _rows, _value


async def register_channels(conn: Conn, channels: Sequence[ChannelConfig]) -> list[str]:
    """Register the channels (reminders naming them are accepted from then on) with their shared
    settings; returns those whose settings changed."""
    cs = list(channels)
    return await _column(
        conn,
        "register_channels",
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


async def channel_pause(conn: Conn, *, channel: str, reason: str | None, actor: str) -> bool:
    """Pause ``channel``; False if it was paused already. :raises psycopg.errors.NoDataFound:"""
    p = {"channel": channel, "reason": reason, "actor": actor}
    return await _value(conn, "channel_pause", bool, p)


async def channel_resume(conn: Conn, *, channel: str, actor: str) -> bool:
    """Resume ``channel`` and lift its throttle; False if it was neither."""
    return await _value(conn, "channel_resume", bool, {"channel": channel, "actor": actor})


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


async def daemon_heartbeat(
    conn: Conn, *, id: str, listener_up: bool | None, session_pid: int | None
) -> tuple[bool, str | None]:
    """Refresh this daemon's row: whether it was there (another daemon forgets a row it judged
    gone), and who asks the daemons to step aside for a migration (None: nobody)."""
    got = await _dicts(
        conn,
        "daemon_heartbeat",
        {"id": id, "listener_up": listener_up, "session_pid": session_pid},
    )
    return (True, got[0]["migration_requested_by"]) if got else (False, None)


async def daemon_session_lock(conn: Conn, *, id: str) -> int | None:
    """Take this daemon's session lock on ``conn``; its backend pid, or None when another session
    holds it."""
    got = await _column(conn, "daemon_session_lock", {"id": id})
    return int(got[0]) if got and got[0] is not None else None


async def daemon_unregister(conn: Conn, *, id: str) -> None:
    await _exec(conn, "daemon_unregister", {"id": id})


async def daemons_forget_gone(conn: Conn) -> list[str]:
    return await _column(conn, "daemons_forget_gone")


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
