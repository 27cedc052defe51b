"""The bindings of room gauges: the statements of gauges and status: lag, work counts, table
health, the xmin horizon, lock holders (``pgwork/sql/queries/gauges.sql``), one typed function
each."""

from __future__ import annotations

from dataclasses import dataclass

from ._bind import Conn, _dicts, _one, _rows


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
    #: That occurrence's channel is paused (late_sources only; lag_by_source says False).
    paused: bool = False


async def lag_by_source(conn: Conn) -> list[SourceLag]:
    """``lag`` per source, latest first."""
    return await _rows(conn, "lag_by_source", SourceLag)


async def late_sources(conn: Conn, *, limit: int) -> list[SourceLag]:
    """The ``limit`` most overdue sources, latest first (a bounded read: see the statement)."""
    return await _rows(conn, "late_sources", SourceLag, {"limit": limit})


@dataclass(frozen=True)
class ChannelLag:
    channel: str
    paused: bool
    lag_seconds: float


async def channel_lag(conn: Conn) -> list[ChannelLag]:
    """Per channel, how late its oldest overdue live row is."""
    return await _rows(conn, "channel_lag", ChannelLag)


@dataclass(frozen=True)
class SourceDead:
    source: str
    n: int


async def dead_by_source(conn: Conn, *, limit: int) -> list[SourceDead]:
    """The ``limit`` sources with the most dead letters."""
    return await _rows(conn, "dead_by_source", SourceDead, {"limit": limit})


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

    def text(self) -> str:
        """One line, as `pgwork status` and the daemon's log name it."""
        who = ", ".join(
            x
            for x in (
                self.application_name and f"application {self.application_name!r}",
                self.role and f"role {self.role}",
                self.held_s is not None and f"in its transaction for {self.held_s:.1f}s",
                self.state,
            )
            if x
        )
        return (
            f"pid {self.pid} ({who or 'details hidden: needs pg_read_all_stats'}): "
            f"{self.mode} on {self.relation}"
        )


async def lock_holders(conn: Conn) -> list[LockHolder]:
    return await _rows(conn, "lock_holders", LockHolder)


def holders_text(holders: list[LockHolder]) -> str:
    """The holders on one line, each once (a session may hold several locks that stop us)."""
    return "; ".join(dict.fromkeys(h.text() for h in holders))
