"""Database-derived gauges: read in one place, by the daemon's metrics duty and by the benchmark
that holds their cost to O(live rows) against a 10M-row table."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskStatus
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from .. import store
from ..metrics import Metrics
from ..supervise import Next, Supervisor


@dataclass(frozen=True)
class Reading:
    lag: store.Lag
    sources: list[store.SourceLag]
    states: list[store.WorkState]
    tables: list[store.TableHealth]
    xmin: store.XminHorizon
    retention: store.RetentionState
    channels: list[store.ChannelState]
    #: How long the reading took, seconds.
    took: float
    channel_lag: list[store.ChannelLag] = field(default_factory=list)
    dead_by_source: list[store.SourceDead] = field(default_factory=list)

    @property
    def dead_letters(self) -> int:
        return sum(s.n for s in self.states if s.status == store.Status.DEAD)


async def read(conn: AsyncConnection[Any], sources_shown: int) -> Reading:
    """Every gauge's query. Each reads an index bounded by live rows or dead letters, or the
    catalog, never the terminal rows retention keeps; per source, the ``sources_shown`` most
    overdue only (metrics.source_lag_series)."""
    t0 = time.monotonic()
    lag = await store.lag(conn)
    sources = await store.late_sources(conn, limit=sources_shown)
    states = await store.work_states(conn)
    tables = await store.table_health(conn)
    xmin = await store.xmin_horizon(conn)
    retention = await store.retention_state(conn)
    channels = await store.channel_states(conn)
    by_channel = await store.channel_lag(conn)
    dead = await store.dead_by_source(conn, limit=sources_shown)
    return Reading(
        lag, sources, states, tables, xmin, retention, channels, time.monotonic() - t0,
        by_channel, dead,
    )  # fmt: skip


def publish(m: Metrics, r: Reading) -> None:
    m.gauge_refresh.set(r.took)
    m.lag.set(r.lag.lag_seconds)
    m.oldest_ready.set(r.lag.oldest_ready_seconds)
    m.source_lag.clear()
    for src in r.sources:
        m.source_lag.labels(src.source, _flag(src.paused)).set(src.lag_seconds)
    m.channel_lag.clear()
    for cl in r.channel_lag:
        m.channel_lag.labels(cl.channel, _flag(cl.paused)).set(cl.lag_seconds)
    m.source_dead.clear()
    for d in r.dead_by_source:
        m.source_dead.labels(d.source).set(d.n)
    m.work_rows.clear()
    for s in r.states:
        m.work_rows.labels(s.channel, s.status).set(s.n)
    m.dead_letters.set(r.dead_letters)
    for t in r.tables:
        m.dead_tuples.labels(t.table).set(t.dead_tuples)
    m.xmin_horizon_age.set(r.xmin.age_seconds)
    m.xmin_horizon_xids.set(r.xmin.age_xids)
    m.retention_paused.set(1 if r.retention.paused else 0)
    m.retention_oldest.set(r.retention.oldest_terminal_age_seconds or 0)
    # The channels the database has: one retired meanwhile leaves no series behind.
    for g in (m.channel_paused, m.channel_throttled, m.channel_claimed):
        g.clear()
    for c in r.channels:
        m.channel_paused.labels(c.name).set(1 if c.paused else 0)
        m.channel_throttled.labels(c.name).set(1 if c.throttled else 0)
        m.channel_claimed.labels(c.name).set(c.claimed)


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _listener_word(up: bool | None) -> str:
    return "off (pooler, no listen_dsn)" if up is None else "up" if up else "DOWN"


@dataclass(eq=False)
class Gauges:
    """The gauges duty: refreshes the database-derived gauges every ``interval`` (so a scrape
    never runs a query) and the one-line summary systemd shows. Runs only while metrics are on."""

    pool: AsyncConnectionPool[AsyncConnection[Any]]
    sup: Supervisor
    _: KW_ONLY
    interval: float
    rows_held: Callable[[], int]
    listener_up: Callable[[], bool | None]
    #: pgwork_source_lag_seconds series at most (metrics.source_lag_series).
    source_series: int = 20
    summary: str = field(default="running", init=False)

    async def step(self) -> Next:
        async with self.pool.connection() as conn:
            reading = await read(conn, self.source_series)
        publish(self.sup.metrics, reading)
        self.summary = (
            f"running: {self.rows_held()} rows held, lag {reading.lag.lag_seconds:.1f}s, "
            f"{reading.dead_letters} dead letters, "
            f"listener {_listener_word(self.listener_up())}"
        )
        return Next(self.interval, "tick")

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await self.sup.loop("metrics", self.step, task_status=task_status)
