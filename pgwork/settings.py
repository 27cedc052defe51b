"""What every channel is configured with, whatever its kind: :class:`ChannelConfig` and its
:class:`RetryPolicy`, declared with pgwork.options.option. Below the channels and the store,
which read them; pgwork/config.py reads them from the file (and re-exports them), each kind's
own options from the kind's module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .options import option


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = option(
        "max_attempts",
        "int",
        100,
        within=(1, 10_000),
        doc="attempts before dead letter (since the last redrive)",
    )
    base: float = option(
        "backoff_base",
        "duration",
        2.0,
        within=(0.001, 86400),
        doc=(
            "first step of the full-jitter exponential backoff: attempt n waits a "
            "random time up to `min(backoff_cap, backoff_base * 2^(n-1))`"
        ),
    )
    cap: float = option(
        "backoff_cap",
        "duration",
        3600.0,
        within=(0.001, 7 * 86400),
        doc="longest backoff between two attempts",
    )
    retry_for: float = option(
        "retry_for",
        "duration",
        86400.0,
        within=(0.001, 90 * 86400),
        doc=(
            "how long an occurrence is retried, from its due time or last redrive; then dead letter"
        ),
    )


@dataclass(frozen=True)
class ChannelConfig:
    name: str
    #: Its choices are the kinds pgwork.channels finds (the configuration checks them, the
    #: reference lists them): declared here, below the channels, they cannot be named here.
    kind: str = option("kind", "str", doc="the kind of channel, whose own options follow")
    concurrency: int = option(
        "concurrency",
        "int",
        16,
        within=(1, 10_000),
        doc=(
            "deliveries running at once per daemon for this channel (a daemon holds"
            " at most this plus what its workers start within 0.25 s, at most two "
            "claim batches)"
        ),
    )
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    attempt_timeout: float = option(
        "attempt_timeout",
        "duration",
        30.0,
        within=(0.01, 86400),
        doc=(
            "most one attempt may take in all (connect, send, every byte of the "
            "answer; a python target's call); past it the attempt is a retry (error"
            " class `AttemptTimeout`; checked four times per limit, at most once a "
            "second, so an attempt ends within a quarter of the limit after it)"
        ),
    )
    expire_after: float | None = option(
        "expire_after",
        "duration",
        None,
        within=(1, 400 * 86400),
        doc=("past its due time by this, an occurrence is closed as `expired`, never sent"),
    )
    catch_up: str = option(
        "catch_up",
        "str",
        "all",
        choices=("all", "latest", "none"),
        doc=(
            "occurrences already past when a reminder is written or moved: `all`, "
            "`latest` or `none` are sent"
        ),
    )
    rate_limit: float | None = option(
        "rate_limit",
        "rate",
        None,
        doc=('deliveries per second across all daemons (`50`, `"50/s"`, `"3000/min"`, `"100/h"`)'),
    )
    rate_burst: float | None = option(
        "rate_burst",
        "int",
        None,
        within=(1, 1_000_000),
        shown="a second's worth",
        doc="how many deliveries the rate limit lets go at once after a quiet spell",
    )
    global_concurrency: int | None = option(
        "global_concurrency",
        "int",
        None,
        within=(1, 1_000_000),
        doc="rows claimed (so deliveries in flight) across all daemons at most",
    )
    breaker_after: int | None = option(
        "breaker_after",
        "int",
        None,
        within=(1, 1_000_000),
        doc=("circuit breaker: failed attempts in a row (all daemons) that hold the channel"),
    )
    breaker_probe: float = option(
        "breaker_probe",
        "duration",
        30.0,
        within=(0.1, 86400),
        doc=(
            "circuit breaker: how long a tripped breaker holds the channel before "
            "one delivery probes it"
        ),
    )
    #: The kind's own options, as its module declares and reads them (an instance of its
    #: ``Kind.options``; None for a kind whose options are all defaults and that reads none).
    options: Any = None
