"""The bindings of room trends: the statements of trends: each channel's attempts per minute
(``pgwork/sql/queries/trends.sql``), one typed function each."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from ._bind import Conn, _exec, _rows, _value


async def trend_write(conn: Conn, *, written_by: str, minutes: str) -> None:
    """Write a daemon's minutes (a JSON array; see the statement), each value whole."""
    await _exec(conn, "trend_write", {"written_by": written_by, "minutes": minutes})


async def trend_prune(conn: Conn, *, keep_hours: int, limit: int) -> int:
    """Delete up to ``limit`` minutes older than ``keep_hours``; returns how many went."""
    return await _value(conn, "trend_prune", int, {"keep_hours": keep_hours, "limit": limit})


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
