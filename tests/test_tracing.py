"""W3C trace context from the reminder an app wrote to the webhook request that delivers it, and
the optional OpenTelemetry spans (claim -> deliver -> outcome) joined to the app's trace. Real
Postgres, real HTTP, an in-memory span exporter."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from . import sink
from .helpers import config, count, python_channel, rows, running, until, webhook_channel
from .receiver import Receiver

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("clean_sink")]

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"


async def _schedule(
    conn: psycopg.AsyncConnection[Any],
    key: str,
    channel: str,
    traceparent: str | None,
    tracestate: str | None = None,
) -> None:
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient, "
        "traceparent, tracestate) VALUES ('app', %s, now(), %s, 'r', %s, %s)",
        (key, channel, traceparent, tracestate),
    )


async def _delivered(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    return await count(conn, "status = 'delivered'") == n


async def test_the_reminders_trace_context_reaches_the_receiver(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    with Receiver() as receiver:
        await _schedule(conn, "traced", "hook", TRACEPARENT, "vendor=abc,other=1")
        await _schedule(conn, "untraced", "hook", None)
        async with running(config(webhook_channel(receiver.url)), dsn):
            await until(lambda: _delivered(conn, 2), what="both delivered")
            # A move with a new trace: the new occurrence carries the new context.
            moved = f"00-{'a' * 32}-{'b' * 16}-01"
            await conn.execute(
                "UPDATE pgwork.reminder SET due_at = now(), traceparent = %s, tracestate = NULL "
                "WHERE business_key = 'traced'",
                (moved,),
            )
            await until(lambda: _delivered(conn, 3), what="the moved occurrence delivered")
    sent = [
        (r.body["business_key"], r.headers.get("traceparent"), r.headers.get("tracestate"))
        for r in receiver.requests
    ]
    assert sorted(sent, key=str) == sorted(
        [
            ("traced", TRACEPARENT, "vendor=abc,other=1"),
            ("untraced", None, None),
            ("traced", moved, None),
        ],
        key=str,
    )
    carried = await rows(
        conn, "SELECT DISTINCT traceparent FROM pgwork.renewal_work WHERE business_key = 'traced'"
    )
    assert {r["traceparent"] for r in carried} == {TRACEPARENT, moved}


async def test_a_python_channel_sees_the_trace_context(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await _schedule(conn, "k", "test", TRACEPARENT, "v=1")
    async with running(config(python_channel()), dsn):
        await until(lambda: _delivered(conn, 1), what="delivered")
    assert [(d.traceparent, d.tracestate) for d in sink.DELIVERED] == [(TRACEPARENT, "v=1")]


@pytest.mark.parametrize(
    ("traceparent", "tracestate"),
    [
        ("garbage", None),
        (f"00-{TRACE.upper()}-{PARENT}-01", None),  # W3C: lower-case hex only
        (f"00-{'0' * 32}-{PARENT}-01", None),  # an all-zero trace id is invalid
        (f"00-{TRACE}-{'0' * 16}-01", None),  # so is an all-zero parent id
        (f"ff-{TRACE}-{PARENT}-01", None),  # version ff is forbidden
        (TRACEPARENT, "x" * 513),
        (TRACEPARENT, "a=1\nb=2"),
    ],
)
async def test_malformed_trace_context_is_refused_by_name(
    conn: psycopg.AsyncConnection[Any], traceparent: str, tracestate: str | None
) -> None:
    with pytest.raises(psycopg.errors.CheckViolation, match="reminder_trace"):
        await _schedule(conn, "bad", "test", traceparent, tracestate)
    assert await rows(conn, "SELECT id FROM pgwork.reminder") == []


async def test_spans_for_claim_deliver_outcome_join_the_apps_trace(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with Receiver() as receiver:
        await _schedule(conn, "traced", "hook", TRACEPARENT)
        await _schedule(conn, "untraced", "hook", None)
        async with running(
            config(webhook_channel(receiver.url), tracing_enabled=True),
            dsn,
            tracer_provider=provider,
        ):
            await until(lambda: _delivered(conn, 2), what="both delivered")
            await until(lambda: _ended(exporter, 8), what="the spans of both deliveries to end")
    spans = exporter.get_finished_spans()
    traced = [s for s in spans if s.context.trace_id == int(TRACE, 16)]
    names = sorted(s.name for s in traced)
    assert names == ["pgwork.claim", "pgwork.deliver hook", "pgwork.job hook", "pgwork.outcome"]
    by_name = {s.name: s for s in traced}
    job = by_name["pgwork.job hook"]
    assert job.parent is not None and job.parent.span_id == int(PARENT, 16)  # the app's span
    assert job.attributes is not None and job.attributes["pgwork.outcome"] == "delivered"
    for child in ("pgwork.claim", "pgwork.deliver hook", "pgwork.outcome"):
        parent = by_name[child].parent
        assert parent is not None and parent.span_id == job.context.span_id, child
    deliver = by_name["pgwork.deliver hook"]
    assert deliver.attributes is not None
    assert deliver.attributes["http.response.status_code"] == 200
    # The receiver got the deliver span's context: its work joins the same trace.
    got = {r.body["business_key"]: r.headers.get("traceparent") for r in receiver.requests}
    assert got["traced"] == f"00-{TRACE}-{deliver.context.span_id:016x}-01"
    # Without an app trace, a delivery starts its own trace, and still sends its context.
    assert got["untraced"] is not None and TRACE not in got["untraced"]
    untraced = [s for s in spans if s.context.trace_id != int(TRACE, 16)]
    assert len(untraced) == 4 and all(
        s.context.trace_id == untraced[0].context.trace_id for s in untraced
    )


async def _ended(exporter: InMemorySpanExporter, n: int) -> bool:
    return len(exporter.get_finished_spans()) >= n
