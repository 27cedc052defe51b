"""Optional OpenTelemetry spans for deliveries (``tracing.enabled``, the ``pgwork[otel]`` extra).

Off (the default) nothing here is imported and the delivery path checks one attribute: no cost.
On, each claimed occurrence gets a span ``pgwork.job`` from its claim until its outcome is
durable, with three children: ``pgwork.claim`` (the claim statement), ``pgwork.deliver`` (the
channel call) and ``pgwork.outcome`` (from the outcome's hand-off to its commit). The job span is
a child of the reminder's own ``traceparent`` when the app wrote one, so a delivery joins the trace
of the request that scheduled it; a webhook request carries the ``pgwork.deliver`` span's context
as its ``traceparent``, so the receiver's work joins it too.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from . import __version__
from .config import ConfigError
from .store import ClaimKey

#: Nanoseconds between time.monotonic() and the wall clock, fixed at import (span times are
#: wall-clock nanoseconds; the worker measures with the monotonic clock).
_WALL_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def _ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9) + _WALL_OFFSET_NS


def _require() -> None:
    try:
        import opentelemetry.trace  # noqa: F401
    except ImportError:
        raise ConfigError(
            "tracing.enabled: OpenTelemetry is not installed (pip install 'pgwork[otel]')"
        ) from None


def setup_sdk(service_name: str = "pgwork") -> Any:
    """For `pgwork run`: unless the process already has a tracer provider, install the SDK's
    with an OTLP/HTTP exporter configured by the standard ``OTEL_EXPORTER_OTLP_*`` variables.
    Returns the provider (its ``shutdown()`` flushes), or None when one was already set."""
    _require()
    from opentelemetry import trace

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ConfigError(
            "tracing.enabled: the OpenTelemetry SDK or its OTLP exporter is not installed "
            "(pip install 'pgwork[otel]')"
        ) from None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


class Tracer:
    """Spans of one daemon's deliveries. Every method is called only when tracing is on."""

    def __init__(self, provider: Any = None) -> None:
        _require()
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self._tracer = (provider or trace.get_tracer_provider()).get_tracer("pgwork", __version__)
        self._propagator = TraceContextTextMapPropagator()
        #: (work id, lease) -> the job span, from claim to durable outcome.
        self._jobs: dict[ClaimKey, Any] = {}
        #: (work id, lease) -> the outcome span, from hand-off to commit.
        self._outcomes: dict[ClaimKey, Any] = {}

    def claimed(self, rows: Iterable[Any], channel: str, started: float, ended: float) -> None:
        """Rows one claim statement took (``started``/``ended``: monotonic seconds)."""
        trace = self._trace
        for row in rows:
            parent = None
            if row.traceparent:
                carrier = {"traceparent": row.traceparent}
                if row.tracestate:
                    carrier["tracestate"] = row.tracestate
                parent = self._propagator.extract(carrier)
            job = self._tracer.start_span(
                f"pgwork.job {channel}",
                context=parent,
                kind=trace.SpanKind.CONSUMER,
                start_time=_ns(started),
                attributes={
                    "pgwork.channel": channel,
                    "pgwork.work_id": row.id,
                    "pgwork.lease": row.lease,
                    "pgwork.attempt": row.attempts,
                    "pgwork.source": row.source,
                    "pgwork.operation_id": str(row.operation_id),
                    "pgwork.due_at": row.due_at.isoformat(),
                },
            )
            self._jobs[(row.id, row.lease)] = job
            self._tracer.start_span(
                "pgwork.claim",
                context=trace.set_span_in_context(job),
                start_time=_ns(started),
                attributes={"pgwork.channel": channel},
            ).end(end_time=_ns(ended))

    def deliver_start(
        self, key: ClaimKey, channel: str, remote: bool
    ) -> tuple[Any, str | None, str | None]:
        """The deliver span (a client's when the channel sends to another host: ``remote``),
        and the traceparent/tracestate a request should carry (its own)."""
        trace = self._trace
        job = self._jobs.get(key)
        span = self._tracer.start_span(
            f"pgwork.deliver {channel}",
            context=trace.set_span_in_context(job) if job is not None else None,
            kind=trace.SpanKind.CLIENT if remote else trace.SpanKind.INTERNAL,
            attributes={"pgwork.channel": channel, "pgwork.work_id": key[0]},
        )
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        return span, carrier.get("traceparent"), carrier.get("tracestate")

    def deliver_end(
        self,
        key: ClaimKey,
        span: Any,
        outcome: str,
        http_status: int | None,
        error: str | None,
    ) -> None:
        span.set_attribute("pgwork.outcome", outcome)
        if http_status is not None:
            span.set_attribute("http.response.status_code", http_status)
        if error:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, error))
        span.end()
        job = self._jobs.get(key)
        self._outcomes[key] = self._tracer.start_span(
            "pgwork.outcome",
            context=self._trace.set_span_in_context(job) if job is not None else None,
        )

    def settled(self, key: ClaimKey, outcome: str, accepted: bool) -> None:
        """The outcome is durable (``accepted``: not fenced): both spans end."""
        span = self._outcomes.pop(key, None)
        if span is not None:
            span.set_attribute("pgwork.fenced", not accepted)
            span.end()
        job = self._jobs.pop(key, None)
        if job is not None:
            job.set_attribute("pgwork.outcome", outcome if accepted else "fenced")
            job.end()

    def released(self, keys: Iterable[ClaimKey]) -> None:
        """Rows given back unstarted (a stop, a pause, a throttle): their job spans end."""
        for key in keys:
            job = self._jobs.pop(key, None)
            if job is not None:
                job.set_attribute("pgwork.outcome", "released")
                job.end()
