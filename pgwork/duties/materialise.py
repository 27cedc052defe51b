"""Materialiser duty: reminders whose occurrences fire within the look-ahead become work rows."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import psycopg
from anyio.abc import TaskStatus
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from .. import store
from ..db import one_rows_doing
from ..supervise import Next, Supervisor
from ..waker import Waker, WakerGroup

log = logging.getLogger("pgwork.materialiser")

#: How soon to try again when another daemon holds the materialiser lock, seconds.
BUSY_RETRY = 0.05
#: A pass that made nothing is recorded (pgwork.materialiser_state: the cutoff and last pass
#: `pgwork status` shows) only when the last record is older than this, so that an idle daemon
#: does not write on every pass. The exported cutoff is every pass's own evidence.
IDLE_RECORD_EVERY = timedelta(minutes=1)
#: How soon to look again when a due reminder was skipped because an app holds its row lock.
LOCKED_RETRY = 0.5
#: A reminder locked (or a coordination lock held) longer than this is named in a warning.
LOCKED_WARNING = 10.0
#: After a page with claims failed, pages run without claims for this long, seconds: a claim
#: that keeps failing must not hold up materialisation (the claim loops still claim).
CLAIMS_OFF_AFTER_FAILURE = 60.0
#: A pass of the duty ends after this long, seconds, when more is due (a flood), and the next
#: starts at once: with a new cutoff (a reminder falling due while the flood is made waits for
#: one pass, not for the whole flood) and from the start of the due set (one written overdue
#: meanwhile is found too). Never within a bisection (see ``run_once``).
PASS_BUDGET = 0.5


async def warm_pages(pool: AsyncConnectionPool[AsyncConnection[Any]], size: int) -> int:
    """Run a page of no reminders on each of a new pool's ``size`` connections, one after the
    other; returns how many ran it. PL/pgSQL compiles the page function and plans its statements
    once per session (~10 ms on this project's VM): unwarmed, the first reminder paged on each
    connection paid for that, a latency outlier per connection after every start. The page
    takes the coordination lock (skipped, best effort, while another materialiser holds it),
    reads no reminder (a limit of 0), and makes and changes nothing. Failures are logged, not
    raised: warming is an optimisation."""
    conns: list[AsyncConnection[Any]] = []
    warmed = 0
    try:
        for _ in range(size):
            conns.append(await pool.getconn(timeout=5))
        for conn in conns:
            warmed += await _page_of_none(conn) is not None
    except psycopg.Error as e:  # PoolTimeout, a lost connection, a failed page
        log.warning(
            "could not warm the pool's connections (%d of %d): %s",
            warmed,
            size,
            e,
            extra={"error_class": type(e).__name__},
        )
    finally:
        for conn in conns:
            await pool.putconn(conn)
    return warmed


class SetAside:
    """Reminders a page failed on, left out of pages for a while, like a poison row, so that one
    reminder the page cannot make (a zone the server no longer knows, a row written around the
    triggers) cannot stop every other reminder: retried after ``FIRST`` seconds, then twice as
    long each time it fails again, up to ``LONGEST``."""

    FIRST = 60.0
    LONGEST = 3600.0

    def __init__(self) -> None:
        self._until: dict[int, float] = {}
        self._wait: dict[int, float] = {}
        #: Whether pgwork.set_aside may hold rows a pass should forget (true at first: a daemon
        #: gone before forgetting what it reported).
        self.reported = True

    def ids(self, now: float) -> list[int]:
        """The reminders left out now (those whose time is up are tried again)."""
        for rid in [r for r, t in self._until.items() if t <= now]:
            del self._until[rid]
        return list(self._until)

    def tried(self, reminder_id: int) -> bool:
        """Whether ``reminder_id`` was set aside before (by this daemon)."""
        return reminder_id in self._wait

    def add(self, reminder_id: int, now: float) -> float:
        """Leave ``reminder_id`` out; returns for how long, seconds."""
        wait = min(self.LONGEST, self._wait.get(reminder_id, self.FIRST / 2) * 2)
        self._wait[reminder_id] = wait
        self._until[reminder_id] = now + wait
        return wait


@dataclass
class Turn:
    """Where a full page's turn of sources starts: after ``source`` (None: the first). Carried
    by the duty from page to page and pass to pass, so that every source with due reminders
    gets its turn however many there are (``pgwork.materialise_page``)."""

    source: str | None = None


class PageClaimer(Protocol):
    """A delivery channel that takes rows in the page's transaction (see ``run_once``)."""

    def page_claim(self) -> store.ClaimRequest | None: ...

    def page_claimed(
        self, request: store.ClaimRequest, rows: list[store.Claimed] | None, t_claim: float
    ) -> None: ...


class Stalls:
    """What keeps materialisation waiting, and since when: a due reminder an app holds locked,
    or the coordination lock held by another materialiser. Either is named in a warning once it
    lasts longer than ``LOCKED_WARNING`` and exported as seconds."""

    def __init__(self) -> None:
        self.locked_id: int | None = None
        self.locked_since = 0.0
        self.busy_since: float | None = None
        self._warned: set[object] = set()

    def result(self, res: PassResult | None, now: float) -> tuple[float, float]:
        """Record a pass; returns (seconds the earliest due reminder has been locked, seconds
        the coordination lock has been held elsewhere)."""
        if res is None:
            self.busy_since = self.busy_since if self.busy_since is not None else now
        else:
            self.busy_since = None
            if res.left_locked:
                if res.next_id != self.locked_id:
                    self.locked_id, self.locked_since = res.next_id, now
            else:
                self.locked_id = None
        locked = now - self.locked_since if self.locked_id is not None else 0.0
        busy = now - self.busy_since if self.busy_since is not None else 0.0
        if locked > LOCKED_WARNING and ("locked", self.locked_id) not in self._warned:
            self._warned.add(("locked", self.locked_id))
            log.warning(
                "reminder %s is due but another transaction has held its row lock for %.0fs; "
                "it is materialised as soon as the lock goes",
                self.locked_id,
                locked,
                extra={"reminder_id": self.locked_id, "locked_s": round(locked, 1)},
            )
        if busy > LOCKED_WARNING and "busy" not in self._warned:
            self._warned.add("busy")
            log.warning(
                "another materialiser has held the coordination lock for %.0fs",
                busy,
                extra={"locked_s": round(busy, 1)},
            )
        if busy == 0:
            self._warned.discard("busy")
        return locked, busy


@dataclass(frozen=True)
class PassResult:
    cutoff: datetime
    scanned: int
    made: int
    made_due: int
    pages: int
    duration: float
    #: The longest page transaction, seconds.
    longest_page: float
    next_fire_at: datetime | None
    #: Seconds (database clock) from the cutoff to ``next_fire_at``; None when nothing is left.
    #: At or below zero when reminders locked by apps were skipped this pass.
    next_after_cutoff: float | None = None
    #: The reminder ``next_fire_at`` belongs to (when left_locked: the one an app holds locked).
    next_id: int | None = None
    #: Occurrences closed as expired by their channel's catch_up policy (counted in ``made``).
    caught_up: int = 0
    #: Series that made their share of a page and have more to make before the cutoff.
    unfinished: int = 0
    #: Reminders a page failed on, set aside by this pass (see ``SetAside``).
    set_aside: int = 0
    #: The pass spent its time budget with more due: the next goes on at once.
    cut_short: bool = False
    #: The cutoff recorded as the materialiser's evidence (every occurrence firing at or before
    #: it has its work row): short of ``cutoff`` while a reminder is skipped or set aside.
    recorded: datetime | None = None
    #: A page with claims failed and ran without them: the claims' error (the caller turns
    #: claims in pages off for a while).
    claims_failed: str | None = None

    @property
    def left_locked(self) -> bool:
        """Some reminder due in this pass was locked by an app and left for the next pass (not
        ``Page.skipped``: occurrences a catch_up policy closed, counted in ``caught_up``; nor a
        series left unfinished, or a pass cut short, whose progress is short of the cutoff too)."""
        return (
            not self.unfinished
            and not self.cut_short
            and self.next_after_cutoff is not None
            and self.next_after_cutoff <= 0
        )


async def run_once(
    conn: AsyncConnection[Any],
    *,
    lookahead: float,
    page_size: int,
    cutoff: datetime | None = None,
    coordinate: bool = True,
    on_made: Callable[[], None] | None = None,
    progress: Callable[[], None] | None = None,
    claimers: Sequence[PageClaimer] = (),
    origin: str = "",
    aside: SetAside | None = None,
    turn: Turn | None = None,
    budget: float | None = None,
) -> PassResult | None:
    """One complete pass: every occurrence firing at or before the cutoff gets its work row,
    except for reminders an app holds locked right now (the result says so; the next pass takes
    them).

    Pages on ``(next_fire_at, id)``, one short transaction per page. Returns None when another
    materialiser holds the lock (it is doing this work right now). ``coordinate=False`` shares the
    lock instead: correctness never depends on it (tests use that to race two passes). ``on_made``
    is called as soon as a page that made rows it did not hand over has committed: local workers
    claim the ones due now at once and set their timers for the others. ``progress`` is called
    after every page (health).

    One hop for work due now: the first page inserts the occurrences due now of each of
    ``claimers`` that has room already claimed (up to its room), so a reminder written due now is
    claimed by the statement that makes its work row and handed to a worker before the pass goes
    on. ``origin`` names this daemon in the page's NOTIFY.

    With ``aside``, a page that fails with an error that may be one reminder's doing
    (``one_rows_doing``) is retried in halves from the same cursor down to one reminder, which is
    set aside for a while (logged, counted in ``PassResult.set_aside``) unless a page of no
    reminder fails too; the pass goes on without it. A reminder set aside sets no timer and
    holds the pass's evidence (``materialise_record_pass``) short of its occurrence.

    ``turn``: where full pages' turns of sources start, updated as pages serve them. ``budget``:
    seconds after which the pass ends with more due (``PassResult.cut_short``; its evidence stops
    short of the first reminder it did not make), unless it is bisecting a failed page.
    """
    t0 = time.monotonic()
    after_at: datetime | None = None
    after_id = 0
    scanned = made = made_due = caught_up = pages = unfinished = set_aside = 0
    longest = 0.0
    limit = page_size
    failed = cut_short = False
    #: A page with claims failed with an error a row can cause, and is tried again without.
    suspect: BaseException | None = None
    claims_failed: str | None = None
    while True:
        p0 = time.monotonic()
        first = pages == 0 and not failed
        asked = [(c, req) for c in (claimers if first else ()) if (req := c.page_claim())]
        left_out = aside.ids(p0) if aside is not None else []
        try:
            page, claimed = await store.materialise_page(
                conn,
                coordinate=coordinate,
                cutoff=cutoff,
                lookahead=timedelta(seconds=lookahead),
                after_at=after_at,
                after_id=after_id,
                limit=limit,
                origin=origin,
                take=[req for _, req in asked],
                aside=left_out,
                turn_after=turn.source if turn is not None else None,
            )
        except BaseException as e:
            for c, req in asked:
                c.page_claimed(req, None, p0)
            if asked and aside is not None and one_rows_doing(e):
                # A page that claimed failed with an error a row can cause: the same page again
                # without claims says whose it is. If that one fails too, the row's (bisected
                # below, as ever); if it runs, the claims' (the caller turns them off a while).
                # Either way the pass goes on: a reminder tried again after being set aside
                # cost a failed pass and three lines each time.
                failed, suspect = True, e
                continue
            suspect = None
            # A page that claimed may have failed for its claims in another way: that is the
            # caller's to handle (claims in pages go off for a while).
            if aside is None or asked or not one_rows_doing(e):
                raise
            failed = True
            if limit > 1:
                limit //= 2  # the same cursor, half the page: which reminder is it?
                continue
            culprit = await store.next_due_reminder(
                conn,
                cutoff=cutoff,
                lookahead=timedelta(seconds=lookahead),
                after_at=after_at,
                after_id=after_id,
                aside=left_out,
            )
            if culprit is None or not await _page_of_none_runs(conn, coordinate, cutoff, origin):
                # No reminder to blame, or a page of none fails too: the page, not a row.
                raise
            again = aside.tried(culprit.id)
            wait = aside.add(culprit.id, time.monotonic())
            set_aside += 1
            # An error the first time (someone must fix or delete the row), a warning each time
            # it is tried again and fails again: one line a try.
            log.log(
                logging.WARNING if again else logging.ERROR,
                "a page failed on reminder %s (%s/%s)%s; it is left out of pages for %.0fs, "
                "the others go on: %s",
                culprit.id,
                culprit.source,
                culprit.business_key,
                " again" if again else "",
                wait,
                e,
                extra={
                    "reminder_id": culprit.id,
                    "source": culprit.source,
                    "business_key": culprit.business_key,
                    "error_class": type(e).__name__,
                },
            )
            await _report_set_aside(conn, culprit, origin, wait, e)
            aside.reported = True
            limit = page_size
            continue
        if asked:
            for c, req in asked:
                c.page_claimed(req, [r for r in claimed if r.channel == req.channel], p0)
            # Let the woken workers start their rows before this pass goes on.
            await anyio.lowlevel.checkpoint()
        if page is None:
            return None
        if suspect is not None:
            claims_failed, suspect = f"{type(suspect).__name__}: {suspect}".strip(), None
        cutoff = page.cutoff
        if turn is not None:
            turn.source = page.turn_source
        longest = max(longest, time.monotonic() - p0)
        if progress is not None:
            progress()
        if page.made > len(claimed) and on_made is not None:
            # Rows the page made and did not hand over (due later, or for a channel that
            # claims on its own): the claim loops look for them and set their timers.
            on_made()
        pages += 1
        scanned += page.scanned
        made += page.made
        made_due += page.made_due
        caught_up += page.skipped
        unfinished += page.unfinished
        if page.scanned < limit:
            break
        after_at, after_id = page.last_at, page.last_id or 0
        if budget is not None and limit == page_size and time.monotonic() - t0 >= budget:
            cut_short = True
            break
    duration = time.monotonic() - t0
    assert cutoff is not None
    left_out = aside.ids(time.monotonic()) if aside is not None else []
    nxt = await store.next_fire_at(conn, cutoff=cutoff, aside=left_out)
    complete_to = cutoff
    if nxt.aside_at is not None and nxt.aside_at <= complete_to:
        # A reminder set aside is not made: the evidence stops short of it, and it sets no
        # timer (its time to be tried again does).
        complete_to = nxt.aside_at - timedelta(microseconds=1)
    if nxt.at is not None and nxt.after_cutoff_s is not None and nxt.after_cutoff_s <= 0:
        # A reminder was skipped (an app holds its row lock), or a series made its share and
        # has more: the evidence stops short of it.
        complete_to = min(complete_to, nxt.at - timedelta(microseconds=1))
        if not unfinished and not cut_short:
            log.info(
                "skipped reminders locked by another transaction; the next pass takes them",
                extra={"reminder_id": nxt.id, "fires_at": nxt.at.isoformat()},
            )
    recorded = await store.materialise_record_pass(
        conn,
        cutoff=complete_to,
        made=made,
        duration_ms=duration * 1000,
        record_every=IDLE_RECORD_EVERY,
    )
    if aside is not None and aside.reported:
        aside.reported = await store.set_aside_forget(conn) > 0
    if made:
        # At debug: a busy daemon makes rows on every pass (pgwork_materialised_rows_total
        # counts them); an operator's log keeps what needs a look.
        log.debug(
            "materialised %d work row%s",
            made,
            "" if made == 1 else "s",
            extra={
                "rows": made,
                "scanned": scanned,
                "pages": pages,
                "cutoff": cutoff.isoformat(),
                "duration_ms": round(duration * 1000, 1),
            },
        )
    return PassResult(
        cutoff,
        scanned,
        made,
        made_due,
        pages,
        duration,
        longest,
        nxt.at,
        nxt.after_cutoff_s,
        nxt.id,
        caught_up,
        unfinished,
        set_aside,
        cut_short,
        recorded,
        claims_failed,
    )


async def _report_set_aside(
    conn: AsyncConnection[Any],
    reminder: store.DueReminder,
    daemon_id: str,
    wait: float,
    error: BaseException,
) -> None:
    """Records a reminder set aside for status, the web page and `pgwork reminder`. A report
    only: failing to write it (a role without the grant) is logged, and the pass goes on."""
    try:
        await store.set_aside_record(
            conn,
            reminder,
            daemon_id=daemon_id,
            wait=wait,
            error=(str(error).strip().splitlines() or [type(error).__name__])[0],
        )
    except psycopg.DatabaseError as e:
        log.warning(
            "could not record reminder %s as set aside in pgwork.set_aside: %s",
            reminder.id,
            e,
            extra={"reminder_id": reminder.id, "error_class": type(e).__name__},
        )


async def _page_of_none(
    conn: AsyncConnection[Any],
    *,
    coordinate: bool = True,
    cutoff: datetime | None = None,
    origin: str = "",
) -> store.Page | None:
    """A page that reads no reminder (a limit of 0): it takes the coordination lock, plans the
    page's statements, and makes and changes nothing."""
    page, _ = await store.materialise_page(
        conn,
        coordinate=coordinate,
        cutoff=cutoff,
        lookahead=timedelta(0),
        after_at=None,
        after_id=0,
        limit=0,
        origin=origin,
    )
    return page


async def _page_of_none_runs(
    conn: AsyncConnection[Any], coordinate: bool, cutoff: datetime | None, origin: str
) -> bool:
    """Whether a page of no reminder runs: one that fails too failed for no reminder's sake (a
    function or privilege missing, the server refusing), so nothing is set aside for it."""
    try:
        await _page_of_none(conn, coordinate=coordinate, cutoff=cutoff, origin=origin)
    except psycopg.DatabaseError:
        return False
    return True


@dataclass(eq=False)
class Materialiser:
    """The materialiser duty: a pass on NOTIFY (the listener wakes ``waker``), on the timed tick
    (the correctness floor) and on a timer set to the next known occurrence; the delivery loops
    are woken as soon as a page made rows."""

    pool: AsyncConnectionPool[AsyncConnection[Any]]
    sup: Supervisor
    work_made: WakerGroup
    _: KW_ONLY
    tick: float
    lookahead: float
    page_size: int
    #: The delivery channels that claim in the first page's transaction (see run_once).
    claimers: Sequence[PageClaimer] = ()
    #: This daemon's id, the payload of the pages' NOTIFY.
    origin: str = ""
    waker: Waker = field(default_factory=Waker)
    stalls: Stalls = field(default_factory=Stalls)
    aside: SetAside = field(default_factory=SetAside)
    turn: Turn = field(default_factory=Turn)
    _claims_off_until: float = field(default=0.0, init=False)

    async def step(self) -> Next:
        m = self.sup.metrics
        claimers = self.claimers if time.monotonic() >= self._claims_off_until else ()
        try:
            async with self.pool.connection() as conn:
                res = await run_once(
                    conn,
                    lookahead=self.lookahead,
                    page_size=self.page_size,
                    on_made=lambda: self.work_made.wake("local"),
                    progress=lambda: self.sup.health.progress("materialiser"),
                    claimers=claimers,
                    origin=self.origin,
                    aside=self.aside,
                    turn=self.turn,
                    budget=PASS_BUDGET,
                )
        except psycopg.DatabaseError as e:
            # Not for a lost connection: the pass fails either way. A statement timeout, a row's
            # doing, turns them off like any other error a row can cause: its pass without
            # claims finds the reminder and sets it aside.
            if claimers and (one_rows_doing(e) or not isinstance(e, psycopg.OperationalError)):
                self._claims_off_until = time.monotonic() + CLAIMS_OFF_AFTER_FAILURE
                log.warning(
                    "a page with claims failed; claiming in pages is off for %.0fs: %s",
                    CLAIMS_OFF_AFTER_FAILURE,
                    e,
                    extra={"error_class": type(e).__name__},
                )
            raise
        if res is not None and res.claims_failed is not None:
            self._claims_off_until = time.monotonic() + CLAIMS_OFF_AFTER_FAILURE
            log.warning(
                "a page with claims failed, and ran without them; claiming in pages is off for "
                "%.0fs: %s",
                CLAIMS_OFF_AFTER_FAILURE,
                res.claims_failed,
            )
        locked, busy = self.stalls.result(res, time.monotonic())
        m.materialiser_locked.set(locked)
        m.materialiser_busy.set(busy)
        if res is None:
            return Next(BUSY_RETRY, "busy")
        m.set_aside.labels("materialiser").inc(res.set_aside)
        m.materialiser_set_aside.set(len(self.aside.ids(time.monotonic())))
        m.materialised.inc(res.made)
        m.catch_up_skipped.inc(res.caught_up)
        # The evidence, as recorded (and as `pgwork status` shows it), not this pass's own
        # cutoff: a reminder set aside holds it back, and PgworkMaterialiserStale fires.
        m.materialiser_cutoff.set((res.recorded or res.cutoff).timestamp())
        m.materialiser_pass.observe(res.duration)
        if res.unfinished:
            # A series made its share of a page and has more before the cutoff: go on at once
            # (each pass serves every other due reminder too).
            return Next(0, "unfinished")
        if res.cut_short:
            # More is due than a pass makes in its budget (a flood): go on at once, from the
            # start, with a new cutoff.
            return Next(0, "cut short")
        if res.next_after_cutoff is None:
            return Next(self.tick, "tick")
        if res.left_locked:
            # An app holds a due reminder's row lock: look again soon, without spinning.
            return Next(min(self.tick, LOCKED_RETRY), "locked")
        # Sleep until the next known occurrence enters the look-ahead window (database clock).
        wait = res.next_after_cutoff
        return Next(min(self.tick, wait), "timer" if wait < self.tick else "tick")

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await self.sup.loop("materialiser", self.step, self.waker, task_status=task_status)
