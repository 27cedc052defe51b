"""The per-delivery histograms: exposed exactly as prometheus_client's own ``Histogram``."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from pgwork.metrics import _DURATION_BUCKETS, _LATENESS_BUCKETS, DeliveryHistogram, Metrics


@pytest.mark.parametrize("buckets", [_LATENESS_BUCKETS, _DURATION_BUCKETS])
def test_a_delivery_histogram_reads_as_a_prometheus_histogram(buckets: tuple[float, ...]) -> None:
    ours, theirs = CollectorRegistry(auto_describe=True), CollectorRegistry(auto_describe=True)
    fast = DeliveryHistogram("pgwork_x_seconds", "Help.", ("channel",), buckets, ours)
    plain = Histogram("pgwork_x_seconds", "Help.", ("channel",), buckets=buckets, registry=theirs)
    rnd = random.Random(12)
    # Every bound itself (a value on a bound counts in that bucket), just past each, past the
    # last, zero, and a spread of ordinary durations, under two channels (one needing escapes).
    values = [0.0, *buckets, *(b * 1.000001 for b in buckets), buckets[-1] * 10]
    values += [rnd.expovariate(2.0) for _ in range(2000)]
    for channel in ("hooks", 'odd "name" \\ here'):
        for v in values:
            fast.labels(channel).observe(v)
            plain.labels(channel).observe(v)
    for render in (generate_latest, generate_openmetrics):
        got, want = render(ours).decode(), render(theirs).decode()
        assert "pgwork_x_seconds_bucket" in got
        assert got == want


def test_every_series_on_the_page_is_a_documented_metric() -> None:
    """Issue 68: /metrics had 17 undocumented `*_created` series (prometheus_client's creation
    times of each counter and histogram). Every family exported is named in
    docs/observability.md, and no series is a creation time."""
    from pathlib import Path

    m = Metrics()
    m.lateness.labels("hooks").observe(0.02)
    m.attempts.labels("hooks", "delivered").inc()
    text = generate_latest(m.registry).decode()
    assert "_created" not in text
    doc = (Path(__file__).resolve().parent.parent / "docs" / "observability.md").read_text()
    families = {f.name for f in m.registry.collect()}
    undocumented = sorted(n for n in families if f"`{n}" not in doc)
    assert not undocumented, undocumented


def test_the_daemon_metrics_keep_their_names_and_type() -> None:
    m = Metrics()
    m.lateness.labels("hooks").observe(0.02)
    m.delivery_duration.labels("hooks").observe(0.002)
    text = generate_latest(m.registry).decode()
    assert "# TYPE pgwork_lateness_seconds histogram" in text
    assert 'pgwork_lateness_seconds_bucket{channel="hooks",le="0.025"} 1.0' in text
    assert 'pgwork_delivery_duration_seconds_count{channel="hooks"} 1.0' in text
    with pytest.raises(ValueError, match="takes labels"):
        m.lateness.labels("hooks", "extra")


@pytest.mark.anyio
async def test_the_per_source_lag_family_is_the_most_overdue_sources_only(dsn: str) -> None:
    """Issue 68, item 13: the per-source lag family had one series per source with anything left
    to make: 20,000 sources gave 20,050 series and 1 MiB a scrape, re-read by a 20,000-probe
    scan every interval. It holds the most overdue metrics.source_lag_series sources, read from
    the first due rows in due order."""
    import psycopg

    from pgwork.duties import gauges

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        # 3,000 sources, one overdue reminder each, source N due N seconds ago; one more source
        # with a reminder far ahead (nothing late).
        await c.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 'app' || lpad(g::text, 4, '0'), 'k', now() - g * interval '1 second', "
            "'log', 'r' FROM generate_series(1, 3000) g"
        )
        await c.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "VALUES ('quiet', 'k', now() + interval '1 day', 'log', 'r')"
        )
        reading = await gauges.read(c, 20)
    m = Metrics()
    gauges.publish(m, reading)
    shown = [s for s in m.registry.collect() if s.name == "pgwork_source_lag_seconds"]
    (family,) = shown
    names = [s.labels["source"] for s in family.samples]
    assert len(names) == 20, len(names)
    assert set(names) == {f"app{n:04d}" for n in range(2981, 3001)}  # the most overdue
    assert all(s.value >= 2980 for s in family.samples)


@pytest.mark.anyio
async def test_a_paused_channels_lag_is_labelled_and_dead_letters_are_counted_by_source(
    dsn: str,
) -> None:
    """Issue 68 (alerts): a deliberate pause must not page like a fault. The lag of work waiting
    on a paused channel carries paused="true" per source and per channel, a running channel's
    paused="false"; dead letters are counted per source, the most first."""
    import psycopg

    from pgwork.duties import gauges

    from .helpers import add, materialise, sync_queue

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        await add(c, "held", "now() - interval '5 minutes'", source="shop", channel="hook")
        await add(c, "late", "now() - interval '2 minutes'", source="crm", channel="log")
        await add(c, "ahead", "now() + interval '1 day'", source="crm", channel="test")
        for i in range(3):
            await add(c, f"d{i}", "now() - interval '1 hour'", source="billing", channel="test")
        await add(c, "d-shop", "now() - interval '1 hour'", source="shop", channel="test")
        await materialise(dsn)
        await c.execute(
            "UPDATE pgwork.renewal_work SET status = 'dead', finished_at = now(), attempts = 1, "
            "lease = 1, dead_reason = 'permanent failure' WHERE business_key LIKE 'd%%'"
        )
        await sync_queue(c)
        await c.execute("SELECT pgwork.pause_channel('hook', 'receiver upgrade', 'test')")
        reading = await gauges.read(c, 20)
    m = Metrics()
    gauges.publish(m, reading)

    def series(name: str) -> dict[tuple[str, ...], float]:
        (family,) = [f for f in m.registry.collect() if f.name == name]
        return {tuple(s.labels.values()): s.value for s in family.samples}

    by_source = series("pgwork_source_lag_seconds")
    assert set(by_source) == {("shop", "true"), ("crm", "false")}, by_source
    assert by_source[("shop", "true")] >= 300 and 120 <= by_source[("crm", "false")] < 300
    by_channel = series("pgwork_channel_lag_seconds")
    assert set(by_channel) == {("hook", "true"), ("log", "false"), ("test", "false")}
    assert by_channel[("hook", "true")] >= 300 and by_channel[("test", "false")] == 0
    assert series("pgwork_source_dead_letters") == {("billing",): 3, ("shop",): 1}
