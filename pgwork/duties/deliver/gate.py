"""A channel's gate as this daemon last saw it: may a delivery start, may a page claim, must the
gate be read again. Pure: no I/O; times are monotonic instants passed in."""

from __future__ import annotations

import enum

from ... import store


class GateState(enum.Enum):
    #: Not read since the start or since something changed it (a NOTIFY, a throttling answer,
    #: a failed give-back): the claim loop reads it before it claims. Deliveries start as the
    #: hold allows.
    UNKNOWN = "unknown"
    #: Deliveries start, claims and pages take rows.
    OPEN = "open"
    #: No delivery starts before ``until`` (a throttle, the circuit breaker); queued rows wait.
    THROTTLED = "throttled"
    #: Nothing starts and nothing is claimed; the gate is read on every claim step.
    PAUSED = "paused"


class Gate:
    """One state and, for a hold, its end. Written by the claim loop (``read``), the outcome
    writer's task (``hold``: a throttling or pausing answer), the listener (``changed``), and a
    worker that finds a hold passed (``hold_left``)."""

    __slots__ = ("state", "until")

    def __init__(self) -> None:
        self.state = GateState.UNKNOWN
        #: Monotonic instant before which no delivery starts (0: none; inf: a pause is coming).
        self.until = 0.0

    @property
    def paused(self) -> bool:
        return self.state is GateState.PAUSED

    def must_read(self) -> bool:
        return self.state is GateState.UNKNOWN or self.state is GateState.PAUSED

    def allows_page_claim(self, now: float) -> bool:
        """A materialiser page may claim rows for this channel: the gate is known, open or its
        hold has passed."""
        return self.state is GateState.OPEN or (
            self.state is GateState.THROTTLED and now >= self.until
        )

    def hold_left(self, now: float) -> float:
        """Seconds before a delivery may start (0: now); a hold that has passed is lifted."""
        if self.until > now:
            return self.until - now
        self.until = 0.0
        if self.state is GateState.THROTTLED:
            self.state = GateState.OPEN
        return 0.0

    def changed(self) -> None:
        """Read it again (a NOTIFY, a failed give-back). A pause stays in force until the read
        says otherwise; so does a hold."""
        if self.state is not GateState.PAUSED:
            self.state = GateState.UNKNOWN

    def hold(self, until: float) -> None:
        """Start nothing before ``until`` (inf: a pause is coming), and read the gate again."""
        self.until = max(self.until, until)
        self.changed()

    def read(self, seen: store.GateReading, now: float) -> tuple[bool, bool]:
        """Take the database's view. Returns (the pause changed, the rows queued here must be
        given back: the channel is paused or held, so they are claimed again under its limits
        once it opens)."""
        was_paused = self.state is GateState.PAUSED
        self.until = now + seen.hold_s if seen.hold_s else 0.0
        if seen.paused:
            self.state = GateState.PAUSED
        else:
            self.state = GateState.THROTTLED if self.until else GateState.OPEN
        return seen.paused != was_paused, bool(seen.paused or seen.hold_s)
