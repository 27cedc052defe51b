"""One channel's settling: once the outcome writer has made a batch of its outcomes durable,
each row is settled: its lease dropped from the registry, its room freed, its attempt counted
and logged, and what the receiver said about the channel (a throttle, a pause) held at once."""

from __future__ import annotations

import logging
import math

from ... import store
from ...store import Status
from ..outcomes import Record
from .state import ChannelState, Wiring

log = logging.getLogger("pgwork.worker")


class Settling:
    def __init__(self, state: ChannelState, wiring: Wiring) -> None:
        self.state = state
        self.name = state.name
        self.leases = wiring.leases
        self.clock = wiring.clock
        self.tracer = wiring.tracer
        self._awaiting_outcome = state.awaiting_outcome
        metrics = state.metrics
        # Labelled metric children, looked up once.
        self._m_attempts = {
            o: metrics.attempts.labels(self.name, o)
            for o in ("delivered", "duplicate", "retry", "failed", "fenced")
        }
        self._m_lateness = metrics.lateness.labels(self.name)
        self._m_duplicates = metrics.duplicates.labels(self.name)
        wiring.writer.subscribe(self.name, self.settle)

    def settle(self, records: list[Record], fenced: set[store.ClaimKey]) -> None:
        """Called by the outcome writer once ``records`` of this channel are durable; ``fenced``
        holds the (work id, lease) of those refused because the lease had passed on."""
        s = self.state
        logged = log.getEffectiveLevel()
        counted: dict[str, int] = {}
        for r in records:
            key = r.key
            self.leases.drop(key)
            row, elapsed = self._awaiting_outcome.pop(key)
            accepted = key not in fenced
            outcome = r.outcome if accepted else "fenced"
            counted[outcome] = counted.get(outcome, 0) + 1
            if self.tracer is not None:
                self.tracer.settled(key, r.outcome, accepted)
            if accepted and r.status == Status.DELIVERED:
                # Both instants by the database's clock (see Clock).
                late = self.clock.seconds_since(row.due_at, r.finished)
                self._m_lateness.observe(late if late > 0.0 else 0.0)
                if r.outcome == "duplicate":
                    self._m_duplicates.inc()
            if r.status == Status.READY:
                s.waker.wake("local")  # the retry may be due before the next tick
            if accepted and r.throttle is not None:
                # Hold here at once (the other daemons learn it by NOTIFY); the gate read then
                # gives the queue back.
                s.gate.hold(r.finished + r.throttle)
                s.waker.wake("gate")
            if accepted and r.pause is not None:
                # Start nothing more at once; the gate read then gives the queue back.
                s.gate.hold(math.inf)
                s.waker.wake("gate")
            # A delivered attempt at debug: the ledger and the metrics have it, and a line each
            # cost a third of a webhook delivery's CPU in the daemon (bench/README.md); what
            # went wrong at info, a dead letter at warning.
            if r.status == Status.DEAD:
                level = logging.WARNING
            elif accepted and r.status == Status.DELIVERED:
                level = logging.DEBUG
            else:
                level = logging.INFO
            if level >= logged:
                log.log(
                    level,
                    "dead letter after attempt %s" if r.status == Status.DEAD else "attempt %s",
                    outcome,
                    extra=r.log_fields(row, outcome, elapsed),
                )
        for label, n in counted.items():
            self._m_attempts[label].inc(n)
        s.wake_for_room(s.capacity.settled(len(records)))
