"""The retry policy: what an attempt's outcome means for its row (delivered, retried after a
delay, or dead), in one pure function."""

from __future__ import annotations

import random

from ..config import RetryPolicy
from .types import Delivered, Failed, Outcome


def backoff_delay(policy: RetryPolicy, attempt: int) -> float:
    """Full jitter: a random delay in [0, min(cap, base * 2**(attempt-1))]."""
    ceiling = min(policy.cap, policy.base * 2 ** min(attempt - 1, 60))
    return random.uniform(0, ceiling)


def decide(
    outcome: Outcome, attempts_used: int, policy: RetryPolicy, tried_for: float = 0.0
) -> tuple[str, str, float | None, str | None]:
    """(ledger outcome, new status, retry delay, error) for an attempt's outcome.
    ``attempts_used`` counts this attempt, relative to the last redrive; ``tried_for`` is how
    long the occurrence has been tried, seconds (from its due time or its last redrive).

    A retry goes dead once either budget is spent: ``max_attempts``, or the ``retry_for``
    window (a retry that would fall after the window's end is made at its end instead: the
    last try). A paused channel's row (``Retry.pause``) always waits: a pause is not a failure
    of the occurrence."""
    if isinstance(outcome, Delivered):
        return ("duplicate" if outcome.duplicate else "delivered"), "delivered", None, None
    if isinstance(outcome, Failed):
        return "failed", "dead", None, f"permanent failure: {outcome.error}"
    if outcome.pause is not None:
        return "retry", "ready", 0.0, f"{outcome.error} (channel paused: {outcome.pause})"
    if attempts_used >= policy.max_attempts:
        return (
            "retry",
            "dead",
            None,
            f"attempt budget spent ({attempts_used} attempts); last error: {outcome.error}",
        )
    left = policy.retry_for - tried_for
    if left <= 0:
        return (
            "retry",
            "dead",
            None,
            f"retry window spent (retry_for {policy.retry_for:g}s, {attempts_used} attempts); "
            f"last error: {outcome.error}",
        )
    delay = outcome.delay if outcome.delay is not None else backoff_delay(policy, attempts_used)
    return "retry", "ready", min(delay, left), outcome.error
