"""One channel on the delivery side: its state and its three roles, each in a module of its
own. The claimer (``claimer.py``) claims due rows with SKIP LOCKED in short transactions and
queues them; the workers (``workers.py``) deliver outside any transaction and hand each outcome
to the outcome writer; the settling (``settling.py``) settles a row once its outcome is durable.
What they share, and who writes what, is ``state.py``; the arithmetic lives in ``Capacity`` and
``Gate``."""

from __future__ import annotations

import anyio
from anyio.abc import TaskGroup, TaskStatus

from ...channels import Channel
from .claimer import Claimer
from .settling import Settling
from .state import ChannelState, Lifecycle, Wiring
from .workers import Workers

__all__ = ["ChannelRunner", "Lifecycle", "Wiring"]


class ChannelRunner:
    """One channel: a claim loop that keeps a queue topped up, and ``concurrency`` long-lived
    delivery workers that take rows from it; a row is settled (its lease dropped, its room
    freed, the attempt logged and counted) only once its outcome is durable."""

    def __init__(self, channel: Channel, wiring: Wiring) -> None:
        self.channel = channel
        self.name = channel.config.name
        self.state = state = ChannelState(channel, wiring)
        self.claimer = Claimer(state, wiring)
        self.workers = Workers(state, wiring)
        self.settling = Settling(state, wiring)
        # Read when scraped: a set() per delivery cost more than the delivery of a no-op.
        metrics = state.metrics
        metrics.rows_held.labels(self.name).set_function(lambda: state.capacity.held)
        metrics.deliveries_active.labels(self.name).set_function(lambda: state.active)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The claim loop; the delivery workers run in the daemon's work group."""
        await self.claimer.run(task_status=task_status)

    def start_workers(self, tg: TaskGroup) -> None:
        self.workers.start(tg)

    @property
    def held(self) -> int:
        """Rows claimed by this channel and not yet settled."""
        return self.state.capacity.held

    @property
    def claiming(self) -> int:
        """Claim statements under way for this channel (its own, or a page's)."""
        return self.state.claiming

    def gate_changed(self) -> None:
        self.claimer.gate_changed()

    def stop_claiming(self) -> None:
        self.state.stop_claiming()

    def stop_taking(self) -> None:
        self.state.stop_taking()
