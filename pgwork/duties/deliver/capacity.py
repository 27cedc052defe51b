"""How many rows one channel holds and may claim: pure arithmetic, no I/O, no clock. Every change
is a named transition; the task that makes it is named on each."""

from __future__ import annotations

import math


class Capacity:
    """A channel's rows and its room for more.

    ``held``: rows claimed and not settled (queued, in a delivery, or delivered and waiting for
    their outcome to be written). ``writing``: delivered rows whose outcome is not durable yet
    (part of ``held``). ``reserved``: room promised to a materialiser page under way.

    Limits: ``max_held`` undelivered rows (one per worker, plus what the workers start within
    ``prefetch_s`` at their measured pace, at most two batches; until a delivery has been timed,
    one more per worker), so a burst is not taken by the first daemon to wake while others sit
    idle; and ``max_writing`` delivered rows beyond that (``writing_batches`` batches, at least
    ``writing_least``: what the outcome writer gathers for a flush and writes meanwhile), so
    that one batch's outcomes are written while the next batch is delivered, but a writer that
    falls behind stops the claims.
    """

    __slots__ = (
        "claim_batch",
        "claimer_waiting",
        "concurrency",
        "delivery_s",
        "held",
        "max_writing",
        "prefetch_s",
        "reserved",
        "writing",
    )

    def __init__(
        self,
        concurrency: int,
        claim_batch: int,
        *,
        prefetch_s: float = 0.25,
        writing_batches: int = 2,
        writing_least: int = 0,
    ) -> None:
        self.concurrency = concurrency
        self.claim_batch = claim_batch
        self.prefetch_s = prefetch_s
        self.max_writing = max(writing_batches * claim_batch, writing_least)
        #: Seconds a delivery takes, a moving average (None: none timed yet).
        self.delivery_s: float | None = None
        self.held = 0
        self.writing = 0
        self.reserved = 0
        #: The claim loop sleeps until there is room worth a claim (see wait_for_room).
        self.claimer_waiting = False

    # -- questions (pure; asked per claim, and per delivery only while the claim loop waits) ---

    @property
    def max_held(self) -> int:
        """Most undelivered rows, by the pace measured so far."""
        if self.delivery_s is None:
            return 2 * self.concurrency
        ahead = self.concurrency * self.prefetch_s / max(self.delivery_s, 1e-6)
        return self.concurrency + max(1, min(math.ceil(ahead), 2 * self.claim_batch))

    def free(self) -> int:
        """Rows a claim could take now: room among the undelivered rows (max_held), and among
        all held rows (max_held plus max_writing), less what a page has reserved."""
        max_held = self.max_held
        undelivered = self.held - self.writing
        return min(max_held - undelivered, max_held + self.max_writing - self.held) - self.reserved

    def worth_a_claim(self) -> int:
        """The fewest rows worth a claim statement: half of max_held, at most a batch. A channel
        that may hold two batches ahead then claims a full batch each time (one statement per
        batch: the webhook path claimed 62 rows at a time instead of 100, bench/README.md), and
        at least half of max_held is still undelivered when the claim starts."""
        return max(1, min(self.claim_batch, self.max_held // 2))

    def room(self) -> int:
        """How many rows a claim may take now (at most one batch); 0: too few to be worth one."""
        free = self.free()
        return min(free, self.claim_batch) if free >= self.worth_a_claim() else 0

    # -- transitions --------------------------------------------------------------------------

    def taken(self, n: int) -> None:
        """``n`` rows claimed and queued (the claim loop, or the materialiser's page)."""
        self.held += n

    def given_back(self, n: int) -> bool:
        """``n`` queued rows were released or dropped undelivered (a pause, a hold, the stop).
        True: the sleeping claim loop should be woken."""
        self.held -= n
        return self._claimer_woken()

    def reserve(self, n: int) -> None:
        """A materialiser page may claim ``n`` rows for this channel (the page's task)."""
        self.reserved += n

    def unreserve(self, n: int) -> bool:
        """The page ended (its rows, if any, were ``taken``). True: wake the claim loop (the
        reservation may be what left it no room, and no row of its own may settle to wake it)."""
        self.reserved -= n
        return self._claimer_woken()

    def delivered(self, elapsed: float) -> bool:
        """A delivery ended after ``elapsed`` seconds; its outcome goes to the writer (a
        worker). The pace (a moving average) sizes max_held. True: wake the claim loop."""
        self.writing += 1
        avg = self.delivery_s
        self.delivery_s = elapsed if avg is None else avg + 0.1 * (elapsed - avg)
        return self.claimer_waiting and self._claimer_woken()

    def settled(self, n: int) -> bool:
        """``n`` delivered rows' outcomes are durable (the outcome writer's task). True: wake
        the claim loop."""
        self.held -= n
        self.writing -= n
        return self.claimer_waiting and self._claimer_woken()

    def wait_for_room(self) -> None:
        """The claim loop found no room and sleeps until a transition frees enough."""
        self.claimer_waiting = True

    def _claimer_woken(self) -> bool:
        if self.claimer_waiting and self.free() >= self.worth_a_claim():
            self.claimer_waiting = False
            return True
        return False
