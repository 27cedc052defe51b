"""Prometheus metrics on an explicit registry (one per daemon, so tests can have several)."""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .options import ConfigError, listen_ports

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


# No `*_created` series: a counter's or a histogram's creation time (when the daemon first
# counted it) told an operator nothing, and each family had one, undocumented.
disable_created_metrics()  # type: ignore[no-untyped-call]


class DeliveryHistogram(Collector):
    """A labelled histogram for what is observed once per delivery, exposed exactly as
    prometheus_client's ``Histogram`` is (buckets, count, sum; no created: see above).

    ``Histogram.observe`` walks the buckets and takes two locks, and every delivery observes
    two (duration, lateness; bench/README.md, "Per-delivery code"). Here an observation is a binary search and two list
    updates, made only by the event loop's thread; a scrape (another thread) copies a child's
    list in one step, so it reads buckets, count and sum together."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: tuple[str, ...],
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError(f"{name}: buckets not in order")
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self._bounds = tuple(bounds)
        self._le = tuple(str(floatToGoString(b)) for b in bounds)  # type: ignore[no-untyped-call]
        self._children: dict[tuple[str, ...], DeliveryHistogram.Child] = {}
        registry.register(self)

    class Child:
        __slots__ = ("_bounds", "counts")

        def __init__(self, bounds: tuple[float, ...]) -> None:
            self._bounds = bounds
            #: One count per bucket (not cumulative: a value on a bound counts in its bucket),
            #: then the sum.
            self.counts: list[float] = [0] * len(bounds) + [0.0]

        def observe(self, amount: float) -> None:
            c = self.counts
            c[bisect_left(self._bounds, amount)] += 1
            c[-1] += amount

    def labels(self, *values: str) -> DeliveryHistogram.Child:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, not {values}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.Child(self._bounds)
        return child

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            counts = child.counts.copy()
            acc, buckets = 0.0, []
            for le, n in zip(self._le, counts, strict=False):
                acc += n
                buckets.append((le, acc))
            family.add_metric(list(values), buckets, counts[-1])
        yield family


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry(auto_describe=True)

        def counter(name: str, help: str, *labels: str) -> Counter:
            return Counter(name, help, labels, registry=r)

        def gauge(name: str, help: str, *labels: str) -> Gauge:
            return Gauge(name, help, labels, registry=r)

        def histogram(
            name: str, help: str, *labels: str, buckets: tuple[float, ...] = _DURATION_BUCKETS
        ) -> Histogram:
            return Histogram(name, help, labels, buckets=buckets, registry=r)

        # Delivery
        self.attempts = counter(
            "pgwork_attempts", "Delivery attempts by channel and outcome.", "channel", "outcome"
        )
        self.lateness = DeliveryHistogram(
            "pgwork_lateness_seconds",
            "Delivered at minus due at, per delivered occurrence.",
            ("channel",),
            _LATENESS_BUCKETS,
            r,
        )
        self.delivery_duration = DeliveryHistogram(
            "pgwork_delivery_duration_seconds",
            "Time spent in the channel per attempt.",
            ("channel",),
            _DURATION_BUCKETS,
            r,
        )
        self.claimed = counter("pgwork_claimed", "Rows claimed for delivery.", "channel")
        self.closed_at_claim = counter(
            "pgwork_closed_at_claim",
            "Rows the claim closed instead of sending (reason: cancelled, superseded, dead, "
            "expired).",
            "channel",
            "reason",
        )
        self.catch_up_skipped = counter(
            "pgwork_catch_up_skipped",
            "Occurrences the materialiser closed as expired under their channel's catch_up policy.",
        )
        self.channel_paused = gauge(
            "pgwork_channel_paused",
            "1 while the channel is paused (operator, or HTTP 410).",
            "channel",
        )
        self.channel_throttled = gauge(
            "pgwork_channel_throttled",
            "1 while the channel is throttled by its receiver (429, 502, 503, 504).",
            "channel",
        )
        self.channel_claimed = gauge(
            "pgwork_channel_claimed",
            "Rows of the channel claimed under live leases, all daemons.",
            "channel",
        )
        self.lease_reclaims = counter(
            "pgwork_lease_reclaims", "Rows claimed again after a lease expired.", "channel"
        )
        self.fenced = counter(
            "pgwork_fenced_completions",
            "Late outcomes refused because the lease had passed to another worker.",
        )
        self.duplicates = counter(
            "pgwork_duplicates_suppressed",
            "Receivers answering that they already had the occurrence.",
            "channel",
        )
        self.rows_held = gauge(
            "pgwork_rows_held",
            "Rows this daemon holds claimed: queued, being delivered, or waiting for their outcome to be written.",
            "channel",
        )
        self.deliveries_active = gauge(
            "pgwork_deliveries_active",
            "Deliveries inside the channel right now (at most its concurrency).",
            "channel",
        )
        self.outcome_flushes = counter("pgwork_outcome_flushes", "Outcome batches written.")
        self.outcomes_pending = gauge(
            "pgwork_outcomes_pending", "Outcomes waiting to be written to the database."
        )
        # Materialiser
        self.materialised = counter("pgwork_materialised_rows", "Work rows materialised.")
        self.materialiser_cutoff = gauge(
            "pgwork_materialiser_cutoff_timestamp_seconds",
            "The materialiser's recorded cutoff after this daemon's last pass (Unix time): "
            "every occurrence firing at or before it has its work row; held back by a reminder "
            "set aside or skipped.",
        )
        self.materialiser_pass = histogram(
            "pgwork_materialiser_pass_seconds",
            "Duration of complete materialiser passes.",
        )
        self.materialiser_locked = gauge(
            "pgwork_materialiser_locked_seconds",
            "How long the earliest due reminder has been skipped because another transaction holds its row lock (0 when none).",
        )
        self.materialiser_busy = gauge(
            "pgwork_materialiser_busy_seconds",
            "How long another materialiser has held the coordination lock (0 when free).",
        )
        # Loops
        self.listener_up = gauge("pgwork_listener_up", "1 while the LISTEN connection is up.")
        self.wakeups = counter(
            "pgwork_wakeups",
            "Loop wake-ups by duty and cause (notify, tick, timer, local).",
            "duty",
            "cause",
        )
        self.duty_failures = counter(
            "pgwork_duty_failures", "Passes of a duty that raised (and were retried).", "duty"
        )
        self.set_aside = counter(
            "pgwork_set_aside",
            "Steps that failed on part of their work, which was set aside so that the rest went on "
            "(materialiser: a reminder a page failed on; outcomes: a batch written in halves).",
            "duty",
        )
        self.materialiser_set_aside = gauge(
            "pgwork_materialiser_set_aside",
            "Reminders this daemon's pages leave out for now, because a page failed on each (retried later).",
        )
        self.duty_restarts = counter(
            "pgwork_duty_restarts", "Times a duty loop resumed after a failure.", "duty"
        )
        self.duty_last_success = gauge(
            "pgwork_duty_last_success_timestamp_seconds",
            "When a duty last completed a pass (Unix time).",
            "duty",
        )
        # Database-derived, refreshed by the metrics duty
        self.lag = gauge(
            "pgwork_lag_seconds",
            "Now minus the due time of the oldest overdue occurrence, materialised or not (0 when none).",
        )
        self.source_lag = gauge(
            "pgwork_source_lag_seconds",
            "pgwork_lag_seconds per source (app): its oldest overdue occurrence, materialised or "
            "not; a series for each late source, the most overdue metrics.source_lag_series (20) "
            "at most; paused: that occurrence's channel is paused.",
            "source",
            "paused",
        )
        self.channel_lag = gauge(
            "pgwork_channel_lag_seconds",
            "Per channel, how late its oldest overdue live row is (0 when none); paused: the "
            "channel is paused.",
            "channel",
            "paused",
        )
        self.source_dead = gauge(
            "pgwork_source_dead_letters",
            "Dead letters per source: the metrics.source_lag_series sources with the most.",
            "source",
        )
        self.oldest_ready = gauge(
            "pgwork_oldest_ready_seconds",
            "Age of the oldest claimable row since it became available.",
        )
        self.work_rows = gauge(
            "pgwork_work_rows",
            "Live work rows (ready: claimable now; waiting: not yet; claimed) and dead letters by "
            "channel and status.",
            "channel",
            "status",
        )
        self.dead_letters = gauge("pgwork_dead_letters", "Work rows in the dead state.")
        self.gauge_refresh = gauge(
            "pgwork_gauge_refresh_seconds",
            "How long the last refresh of the database-derived gauges took.",
        )
        # Retention
        self.retention_deleted = counter(
            "pgwork_retention_deleted_rows", "Terminal work rows deleted by retention."
        )
        self.retention_batch = histogram(
            "pgwork_retention_batch_seconds",
            "Duration of retention batches (one transaction each).",
        )
        self.retention_timeouts = counter(
            "pgwork_retention_timeouts",
            "Retention batches that hit their statement or lock timeout.",
        )
        self.retention_oldest = gauge(
            "pgwork_retention_oldest_terminal_age_seconds",
            "Age of the oldest terminal work row kept.",
        )
        self.retention_paused = gauge("pgwork_retention_paused", "1 while retention is paused.")
        self.retention_last_pass = gauge(
            "pgwork_retention_last_pass_timestamp_seconds",
            "When retention last completed a pass (Unix time).",
        )
        # Database health
        self.dead_tuples = gauge(
            "pgwork_table_dead_tuples",
            "Dead tuples in pgwork's tables (pg_stat_user_tables).",
            "table",
        )
        self.xmin_horizon_age = gauge(
            "pgwork_xmin_horizon_age_seconds",
            "Age of the oldest transaction in this database holding back vacuum.",
        )
        self.xmin_horizon_xids = gauge(
            "pgwork_xmin_horizon_age_xids",
            "Transaction-id age of the oldest xmin holding back vacuum (sessions and replication slots).",
        )


def serve_metrics(registry: CollectorRegistry, listen: str) -> tuple[Any, str]:
    """Serve ``registry`` on ``listen`` from a thread: HOST:PORT, HOST:0 (a free port the system
    picks) or HOST:FIRST-LAST (the first free port of the range). Returns the server (its
    ``shutdown()`` stops it) and the HOST:PORT it serves on.

    :raises ConfigError: naming ``metrics.listen`` when it cannot."""
    parsed = listen_ports(listen)
    if parsed is None:
        raise ConfigError(f"metrics.listen: not HOST:PORT (got {listen!r})")
    host, ports = parsed
    host = host or "127.0.0.1"
    error: Exception | None = None
    for port in ports:
        try:
            server, _thread = start_http_server(port, host, registry)
        except (OSError, ValueError, OverflowError) as e:
            error = e
            continue
        at = f"{host}:{server.server_port}"
        log.info("metrics on http://%s/metrics", at, extra={"metrics_at": at})
        return server, at
    raise ConfigError(f"metrics.listen: cannot serve on {listen!r}: {error}") from None
