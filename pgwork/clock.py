"""The database's clock, read from this process: every stored time and every lateness figure is
by the database's clock, whatever the host's clock says."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from psycopg import AsyncConnection

from . import store

log = logging.getLogger("pgwork.clock")

#: A host clock further than this from the database's is reported at start, seconds.
SKEW_WARNING = 1.0


class Clock:
    """Maps this process's monotonic clock to the database's wall clock. ``sync`` reads
    ``now()`` (at the middle of the round trip); until the first sync the host clock stands in."""

    def __init__(self) -> None:
        self._mono = time.monotonic()
        self._db = datetime.now(UTC)
        self._db_s = self._db.timestamp()
        #: Database clock minus host clock, seconds (positive: the host is behind).
        self.skew = 0.0

    def db_time(self, mono: float) -> datetime:
        """The database-clock instant at monotonic time ``mono``."""
        return self._db + timedelta(seconds=mono - self._mono)

    def epoch(self, mono: float) -> float:
        """The database-clock instant at monotonic time ``mono``, as seconds since the epoch."""
        return self._db_s + (mono - self._mono)

    def seconds_since(self, instant: datetime, mono: float) -> float:
        """Seconds from ``instant`` to monotonic time ``mono``, by the database's clock: what
        ``(db_time(mono) - instant).total_seconds()`` is, in float arithmetic (a lateness figure
        per delivery: half the time of building the datetime and the timedelta)."""
        return self._db_s + (mono - self._mono) - instant.timestamp()

    def now(self) -> datetime:
        return self.db_time(time.monotonic())

    async def sync(self, conn: AsyncConnection[Any]) -> float:
        """Read the database's clock; returns the skew (database minus host), seconds."""
        t0 = time.monotonic()
        db_now = await store.db_now(conn)
        t1 = time.monotonic()
        host_now = datetime.now(UTC) - timedelta(seconds=(t1 - t0) / 2)
        self._mono, self._db, self._db_s = (t0 + t1) / 2, db_now, db_now.timestamp()
        self.skew = (db_now - host_now).total_seconds()
        return self.skew

    def warn_if_skewed(self) -> None:
        if abs(self.skew) > SKEW_WARNING:
            log.warning(
                "this host's clock is %.1fs %s the database's; pgwork times everything by the "
                "database's clock, but check NTP on this host",
                abs(self.skew),
                "behind" if self.skew > 0 else "ahead of",
                extra={"skew_s": round(self.skew, 3)},
            )
