"""Prometheus metrics on an explicit registry (one per daemon, so tests can have several)."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .config import ConfigError

log = logging.getLogger("pgwork.metrics")

_LATENESS_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
    900,
    3600,
)
_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry(auto_describe=True)
        # Delivery
        self.attempts = Counter(
            "pgwork_attempts",
            "Delivery attempts by channel and outcome.",
            ["channel", "outcome"],
            registry=r,
        )
        self.lateness = Histogram(
            "pgwork_lateness_seconds",
            "Delivered at minus due at, per delivered occurrence.",
            ["channel"],
            buckets=_LATENESS_BUCKETS,
            registry=r,
        )
        self.delivery_duration = Histogram(
            "pgwork_delivery_duration_seconds",
            "Time spent in the channel per attempt.",
            ["channel"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.claimed = Counter(
            "pgwork_claimed", "Rows claimed for delivery.", ["channel"], registry=r
        )
        self.closed_at_claim = Counter(
            "pgwork_closed_at_claim",
            "Rows the claim closed instead of sending (reason: cancelled, superseded, dead).",
            ["channel", "reason"],
            registry=r,
        )
        self.lease_reclaims = Counter(
            "pgwork_lease_reclaims",
            "Rows claimed again after a lease expired.",
            ["channel"],
            registry=r,
        )
        self.fenced = Counter(
            "pgwork_fenced_completions",
            "Late outcomes refused because the lease had passed to another worker.",
            registry=r,
        )
        self.duplicates = Counter(
            "pgwork_duplicates_suppressed",
            "Receivers answering that they already had the occurrence.",
            ["channel"],
            registry=r,
        )
        self.rows_held = Gauge(
            "pgwork_rows_held",
            "Rows this daemon holds claimed: queued, being delivered, or waiting for their "
            "outcome to be written.",
            ["channel"],
            registry=r,
        )
        self.deliveries_active = Gauge(
            "pgwork_deliveries_active",
            "Deliveries inside the channel right now (at most its concurrency).",
            ["channel"],
            registry=r,
        )
        self.outcome_flushes = Counter(
            "pgwork_outcome_flushes", "Outcome batches written.", registry=r
        )
        self.outcomes_pending = Gauge(
            "pgwork_outcomes_pending", "Outcomes waiting to be written to the database.", registry=r
        )
        # Materialiser
        self.materialised = Counter(
            "pgwork_materialised_rows", "Work rows materialised.", registry=r
        )
        self.materialiser_cutoff = Gauge(
            "pgwork_materialiser_cutoff_timestamp_seconds",
            "Cutoff of this daemon's last complete materialiser pass (Unix time).",
            registry=r,
        )
        self.materialiser_pass = Histogram(
            "pgwork_materialiser_pass_seconds",
            "Duration of complete materialiser passes.",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.materialiser_locked = Gauge(
            "pgwork_materialiser_locked_seconds",
            "How long the earliest due reminder has been skipped because another transaction "
            "holds its row lock (0 when none).",
            registry=r,
        )
        self.materialiser_busy = Gauge(
            "pgwork_materialiser_busy_seconds",
            "How long another materialiser has held the coordination lock (0 when free).",
            registry=r,
        )
        # Loops
        self.listener_up = Gauge(
            "pgwork_listener_up", "1 while the LISTEN connection is up.", registry=r
        )
        self.wakeups = Counter(
            "pgwork_wakeups",
            "Loop wake-ups by duty and cause (notify, tick, timer, local).",
            ["duty", "cause"],
            registry=r,
        )
        self.duty_failures = Counter(
            "pgwork_duty_failures",
            "Passes of a duty that raised (and were retried).",
            ["duty"],
            registry=r,
        )
        self.duty_restarts = Counter(
            "pgwork_duty_restarts",
            "Times a duty loop resumed after a failure.",
            ["duty"],
            registry=r,
        )
        self.duty_last_success = Gauge(
            "pgwork_duty_last_success_timestamp_seconds",
            "When a duty last completed a pass (Unix time).",
            ["duty"],
            registry=r,
        )
        # Database-derived, refreshed by the metrics duty
        self.lag = Gauge(
            "pgwork_lag_seconds",
            "Now minus the due time of the oldest overdue occurrence, materialised or not "
            "(0 when none).",
            registry=r,
        )
        self.oldest_ready = Gauge(
            "pgwork_oldest_ready_seconds",
            "Age of the oldest claimable row since it became available.",
            registry=r,
        )
        self.work_rows = Gauge(
            "pgwork_work_rows",
            "Live work rows (ready, claimed) and dead letters by channel and status.",
            ["channel", "status"],
            registry=r,
        )
        self.dead_letters = Gauge("pgwork_dead_letters", "Work rows in the dead state.", registry=r)
        self.gauge_refresh = Gauge(
            "pgwork_gauge_refresh_seconds",
            "How long the last refresh of the database-derived gauges took.",
            registry=r,
        )
        # Retention
        self.retention_deleted = Counter(
            "pgwork_retention_deleted_rows", "Terminal work rows deleted by retention.", registry=r
        )
        self.retention_batch = Histogram(
            "pgwork_retention_batch_seconds",
            "Duration of retention batches (one transaction each).",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.retention_timeouts = Counter(
            "pgwork_retention_timeouts",
            "Retention batches that hit their statement or lock timeout.",
            registry=r,
        )
        self.retention_oldest = Gauge(
            "pgwork_retention_oldest_terminal_age_seconds",
            "Age of the oldest terminal work row kept.",
            registry=r,
        )
        self.retention_paused = Gauge(
            "pgwork_retention_paused", "1 while retention is paused.", registry=r
        )
        self.retention_last_pass = Gauge(
            "pgwork_retention_last_pass_timestamp_seconds",
            "When retention last completed a pass (Unix time).",
            registry=r,
        )
        # Database health
        self.dead_tuples = Gauge(
            "pgwork_table_dead_tuples",
            "Dead tuples in pgwork's tables (pg_stat_user_tables).",
            ["table"],
            registry=r,
        )
        self.xmin_horizon_age = Gauge(
            "pgwork_xmin_horizon_age_seconds",
            "Age of the oldest transaction in this database holding back vacuum.",
            registry=r,
        )
        self.xmin_horizon_xids = Gauge(
            "pgwork_xmin_horizon_age_xids",
            "Transaction-id age of the oldest xmin holding back vacuum (sessions and replication slots).",
            registry=r,
        )


def serve_metrics(registry: CollectorRegistry, listen: str) -> Any:
    """Serve ``registry`` on ``listen`` (HOST:PORT) from a thread; returns the server (its
    ``shutdown()`` stops it). :raises ConfigError: naming ``metrics.listen`` when it cannot."""
    host, _, port = listen.rpartition(":")
    try:
        server, _thread = start_http_server(int(port), host or "127.0.0.1", registry)
    except (OSError, ValueError, OverflowError) as e:
        raise ConfigError(f"metrics.listen: cannot serve on {listen!r}: {e}") from None
    log.info("metrics on http://%s/metrics", listen)
    return server
