"""The per-delivery histograms: exposed exactly as prometheus_client's own ``Histogram``."""

from __future__ import annotations

import random
import re

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from pgwork.metrics import _DURATION_BUCKETS, _LATENESS_BUCKETS, DeliveryHistogram, Metrics


def _without_created(text: str) -> str:
    # The creation instants differ (the two histograms were made apart): everything else may not.
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", text)


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
        assert "pgwork_x_seconds_bucket" in got and "_created" in got
        assert _without_created(got) == _without_created(want)


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
