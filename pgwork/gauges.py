"""Database-derived gauges: read in one place, by the daemon's metrics duty and by the benchmark
that holds their cost to O(live rows) against a 10M-row table."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection

from .db import fetch_all, fetch_one
from .metrics import Metrics


@dataclass(frozen=True)
class Reading:
    lag: dict[str, Any]
    states: list[dict[str, Any]]
    tables: list[dict[str, Any]]
    xmin: dict[str, Any]
    retention: dict[str, Any]
    #: How long the reading took, seconds.
    took: float

    @property
    def dead_letters(self) -> int:
        return sum(s["n"] for s in self.states if s["status"] == "dead")


async def read(conn: AsyncConnection[Any]) -> Reading:
    """Every gauge's query. Each reads an index bounded by live rows or dead letters, or the
    catalog, never the terminal rows retention keeps."""
    t0 = time.monotonic()
    lag = await fetch_one(conn, "lag")
    states = await fetch_all(conn, "work_states")
    tables = await fetch_all(conn, "table_health")
    xmin = await fetch_one(conn, "xmin_horizon")
    retention = await fetch_one(conn, "retention_state")
    return Reading(lag, states, tables, xmin, retention, time.monotonic() - t0)


def publish(m: Metrics, r: Reading) -> None:
    m.gauge_refresh.set(r.took)
    m.lag.set(r.lag["lag_seconds"])
    m.oldest_ready.set(r.lag["oldest_ready_seconds"])
    m.work_rows.clear()
    for s in r.states:
        m.work_rows.labels(s["channel"], s["status"]).set(s["n"])
    m.dead_letters.set(r.dead_letters)
    for t in r.tables:
        m.dead_tuples.labels(t["table"]).set(t["dead_tuples"])
    m.xmin_horizon_age.set(r.xmin["age_seconds"])
    m.xmin_horizon_xids.set(r.xmin["age_xids"])
    m.retention_paused.set(1 if r.retention["paused"] else 0)
    m.retention_oldest.set(r.retention["oldest_terminal_age_seconds"] or 0)
