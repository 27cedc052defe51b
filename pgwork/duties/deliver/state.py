"""One channel's state on the delivery side, shared by its three roles: the claimer (claims
rows and queues them, reads the channel's gate), the workers (deliver queued rows and hand
each outcome to the outcome writer) and the settling (once an outcome is durable: drop the
lease, free the room, count and log it). Each field says which role writes it. What the daemon
builds every channel with (``Wiring``) is here too: each role takes what it needs from it."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import anyio
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from ... import store
from ...channels import Channel
from ...clock import Clock
from ...config import Config
from ...supervise import Supervisor
from ...tracing import Tracer
from ...waker import Waker, WakerGroup
from ..leases import Leases
from ..outcomes import OutcomeWriter
from .capacity import Capacity
from .gate import Gate


class Lifecycle(enum.Enum):
    #: Claims run, workers deliver.
    CLAIMING = "claiming"
    #: No claim starts (one under way finishes; its rows are held); workers deliver the queue.
    DRAINING = "draining"
    #: Queued rows are not started (held, and released without counting an attempt); idle
    #: workers end.
    CLOSED = "closed"


@dataclass(frozen=True)
class Wiring:
    """What every channel's runner is built with, made once by the daemon: the pool, the outcome
    writer, the lease registry, the supervisor, the config, this daemon's identity and the
    database's clock as seen from here, the waker rows made and NOTIFYs ring, the tracer."""

    pool: AsyncConnectionPool[AsyncConnection[Any]]
    writer: OutcomeWriter
    leases: Leases
    sup: Supervisor
    cfg: Config
    identity: store.Identity
    clock: Clock = field(default_factory=Clock)
    woken_by: WakerGroup | None = None
    #: OpenTelemetry spans (tracing.enabled); None: off, and nothing on the path below pays.
    tracer: Tracer | None = None


class ChannelState:
    """What the claimer, the workers and the settling of one channel share."""

    #: Beyond one row per worker, a channel holds only the rows its workers start within this
    #: long at their measured pace (see Capacity), seconds.
    PREFETCH_S = 0.25
    #: Batches of delivered rows whose outcomes may wait to be written (see Capacity), and at
    #: least what the outcome writer gathers for one flush while another is under way.
    WRITING_BATCHES = 2
    WRITING_LEAST = 2 * OutcomeWriter.GATHER

    def __init__(self, channel: Channel, wiring: Wiring) -> None:
        c = channel.config
        self.channel = channel
        self.name = c.name
        self.concurrency = c.concurrency
        self.metrics = wiring.sup.metrics
        self.tracer = wiring.tracer
        #: Wakes the claim loop: rows made (materialiser), a NOTIFY (listener), room freed, a
        #: retry due soon (the settling), a gate to read.
        self.waker = Waker()
        if wiring.woken_by is not None:
            wiring.woken_by.add(self.waker)
        #: Rows held and the room for more: the claimer and the page (taken, reserve), the
        #: workers (delivered), the settling (settled), the claimer and the stop (given_back).
        self.capacity = Capacity(
            c.concurrency,
            wiring.cfg.claim_batch,
            prefetch_s=self.PREFETCH_S,
            writing_batches=self.WRITING_BATCHES,
            writing_least=self.WRITING_LEAST,
        )
        #: The channel's gate: the claimer (read), the settling (hold), the listener and a
        #: failed give-back (changed), a worker lifting a passed hold.
        self.gate = Gate()
        #: Claiming, draining or closed: the stop (stop_claiming, stop_taking).
        self.lifecycle = Lifecycle.CLAIMING
        #: Rows claimed and queued, not started: appended by the claimer (and the page), popped
        #: by the workers, emptied by a give-back and the stop.
        self.queue: deque[store.Claimed] = deque()
        #: Idle workers' events: appended by a worker, set by whoever queues rows or stops.
        self.idle: list[anyio.Event] = []
        #: Deliveries inside the channel right now: the workers.
        self.active = 0
        #: Claim statements under way (the claimer's, or a page's for this channel): a stop
        #: waits for them, then gives back their rows.
        self.claiming = 0
        #: Delivered rows whose outcome is not durable yet, and how long each delivery took: a
        #: worker adds, the settling takes (for the metrics and the log line).
        self.awaiting_outcome: dict[store.ClaimKey, tuple[store.Claimed, float]] = {}

    def wake_for_room(self, woken: bool) -> None:
        """A capacity transition freed room worth a claim while the claim loop slept for it."""
        if woken:
            self.waker.wake("slot")

    def wake_idle(self, n: int) -> None:
        """Wake up to ``n`` idle workers (rows were queued, or the gate opened)."""
        for _ in range(min(n, len(self.idle))):
            self.idle.pop().set()

    def stop_claiming(self) -> None:
        """Claim nothing more (a claim under way finishes; its rows are held, not started)."""
        if self.lifecycle is Lifecycle.CLAIMING:
            self.lifecycle = Lifecycle.DRAINING
        self.waker.wake("stop")

    def stop_taking(self) -> None:
        """On shutdown: queued rows are not started (they stay held and are released without
        counting an attempt); idle workers end; nothing is claimed."""
        self.lifecycle = Lifecycle.CLOSED
        left = len(self.queue)
        if self.tracer is not None:
            self.tracer.released((r.id, r.lease) for r in self.queue)
        self.queue.clear()
        self.capacity.given_back(left)
        for ev in self.idle:
            ev.set()
        self.idle.clear()
