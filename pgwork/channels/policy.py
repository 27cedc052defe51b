"""The retry policy: what an attempt's outcome means for its row (delivered, retried after a
delay, or dead), in one pure function."""

from __future__ import annotations

import random
from typing import NamedTuple

from ..settings import RetryPolicy
from ..store import Status
from .types import Delivered, Failed, Outcome


def backoff_delay(policy: RetryPolicy, attempt: int) -> float:
    """Full jitter: a random delay in [0, min(cap, base * 2**(attempt-1))]."""
    ceiling = min(policy.cap, policy.base * 2 ** min(attempt - 1, 60))
    return random.uniform(0, ceiling)


class Decision(NamedTuple):
    """What an attempt's outcome means for its row."""

    #: The ledger's outcome: delivered, duplicate, retry or failed.
    ledger: str
    #: The row's new status: delivered, ready (a retry) or dead.
    status: Status
    #: Seconds until the retry (a ready row); None otherwise.
    retry_in: float | None
    #: The error the ledger and the row keep (the dead reason of a dead row).
    error: str | None


def decide(
    outcome: Outcome, attempts_used: int, policy: RetryPolicy, tried_for: float = 0.0
) -> Decision:
    """What an attempt's outcome means for its row.
    ``attempts_used`` counts this attempt, relative to the last redrive; ``tried_for`` is how
    long the occurrence has been tried, seconds (from its due time or its last redrive).

    A retry goes dead once either budget is spent: ``max_attempts``, or the ``retry_for``
    window (a retry that would fall after the window's end is made at its end instead: the
    last try). A paused channel's row (``Retry.pause``) always waits: a pause is not a failure
    of the occurrence."""
    if isinstance(outcome, Delivered):
        return Decision(
            "duplicate" if outcome.duplicate else "delivered", Status.DELIVERED, None, None
        )
    if isinstance(outcome, Failed):
        return Decision("failed", Status.DEAD, None, f"permanent failure: {outcome.error}")
    if outcome.pause is not None:
        return Decision(
            "retry", Status.READY, 0.0, f"{outcome.error} (channel paused: {outcome.pause})"
        )
    if attempts_used >= policy.max_attempts:
        return Decision(
            "retry",
            Status.DEAD,
            None,
            f"attempt budget spent ({attempts_used} attempts); last error: {outcome.error}",
        )
    left = policy.retry_for - tried_for
    if left <= 0:
        return Decision(
            "retry",
            Status.DEAD,
            None,
            f"retry window spent (retry_for {policy.retry_for:g}s, {attempts_used} attempts); "
            f"last error: {outcome.error}",
        )
    delay = outcome.delay if outcome.delay is not None else backoff_delay(policy, attempts_used)
    return Decision("retry", Status.READY, min(delay, left), outcome.error)
