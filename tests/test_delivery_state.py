"""The delivery core's arithmetic, without a database or a daemon: a channel's Capacity (rows
held, the room for a claim, when the sleeping claim loop is woken) and its Gate (what may start,
what a page may claim, when the gate must be read). Table-driven; each case is a sequence of
transitions and what must hold after it."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pgwork import store
from pgwork.duties.deliver import Capacity, Gate, GateState


def _capacity(concurrency: int = 4, claim_batch: int = 10) -> Capacity:
    return Capacity(concurrency, claim_batch, prefetch_s=0.25, writing_batches=2)


# (what, steps, room after, woken by the last step)
CAPACITY_CASES: list[tuple[str, list[tuple[str, Any]], int, bool | None]] = [
    # max_held starts at 2 x concurrency = 8: a claim takes at most 8 before a delivery is timed.
    ("empty: room up to max_held", [], 8, None),
    ("held rows leave less room", [("taken", 2)], 6, None),
    # Worth a claim: half of max_held (8), at most a batch = 4; 3 free is not worth one.
    ("too little room is no room", [("taken", 5)], 0, None),
    ("a page's reservation counts", [("reserve", 5)], 0, None),
    ("the reservation returned", [("reserve", 5), ("unreserve", 5)], 8, False),
    # Delivered rows waiting for the writer stop counting against max_held but against
    # max_held + max_writing (8 + 20).
    (
        "delivered rows free prefetch room",
        [
            ("taken", 8),
            ("delivered", 1.0),
            ("delivered", 1.0),
            ("delivered", 1.0),
            ("delivered", 1.0),
        ],
        # The pace (1 s a delivery, 4 workers, 0.25 s ahead) retunes max_held to 4 + 1 = 5;
        # undelivered 4: 1 free, not worth a claim (half of 5 = 2).
        0,
        False,
    ),
    (
        "a fast channel may hold two batches ahead",
        [("delivered_fast", 1e-6)],
        # max_held = 4 + min(ceil(4 x 0.25 / 1e-6), 2 x 10) = 24; one delivered (writing) row
        # counts as held but not undelivered: min(24 - 0, 24 + 20 - 0) = 24, cut to a batch.
        10,
        False,
    ),
    (
        "a channel that may hold two batches ahead claims only a full batch",
        [("delivered_fast", 1e-6), ("taken", 17)],
        # max_held 24 as above; 17 undelivered: 7 free. Worth a claim is a full batch (10) once
        # max_held is two batches: one statement per batch (the webhook path claimed 62 rows at
        # a time against 100, bench/README.md); half a batch here would claim 7.
        0,
        None,
    ),
    # Eight deliveries of 10 ms retune max_held to 4 + min(100, 2 x 10) = 24: a batch of room.
    ("settled rows free everything", [("taken", 8), ("settled_after_delivery", 8)], 10, False),
    ("given back rows free room", [("taken", 8), ("given_back", 8)], 8, False),
]


def _apply(c: Capacity, step: str, n: Any) -> bool | None:
    if step == "taken":
        c.taken(n)
        return None
    if step == "reserve":
        c.reserve(n)
        return None
    if step == "unreserve":
        return c.unreserve(n)
    if step in ("delivered", "delivered_fast"):
        if step == "delivered_fast":
            c.taken(1)
        return c.delivered(n)
    if step == "settled_after_delivery":
        for _ in range(n):
            c.delivered(0.01)
        return c.settled(n)
    if step == "given_back":
        return c.given_back(n)
    raise AssertionError(step)


@pytest.mark.parametrize(
    ("steps", "room", "woken"),
    [c[1:] for c in CAPACITY_CASES],
    ids=[c[0] for c in CAPACITY_CASES],
)
def test_capacity(steps: list[tuple[str, Any]], room: int, woken: bool | None) -> None:
    c = _capacity()
    last = None
    for step, n in steps:
        last = _apply(c, step, n)
    assert c.room() == room
    assert c.room() == room, "room() changes nothing"
    if woken is not None:
        assert last is woken


def test_the_claim_loop_is_woken_once_when_room_worth_a_claim_frees() -> None:
    c = _capacity()
    c.taken(8)
    assert c.room() == 0
    c.wait_for_room()
    # One second a delivery: max_held = 4 + 1 = 5 undelivered rows; worth a claim: 2.
    assert c.delivered(1.0) is False  # 7 undelivered
    assert c.delivered(1.0) is False  # 6
    assert c.delivered(1.0) is False  # 5: none free
    assert c.delivered(1.0) is False  # 4: one free, not worth a claim
    assert c.delivered(1.0) is True  # 3: two free
    assert c.delivered(1.0) is False  # woken once: the loop is awake
    assert c.settled(6) is False
    assert (c.held, c.writing, c.reserved) == (2, 0, 0)


def test_the_writer_may_hold_what_it_gathers_at_a_small_batch() -> None:
    """Issue 54: the outcome writer gathers up to OutcomeWriter.GATHER records a flush; at claim
    batch 10, two batches of writing rows (20) would stop the claims before it had gathered
    them. ``writing_least`` is the floor of max_writing."""
    for least, room in ((0, 0), (64, 10)):
        c = Capacity(4, 10, prefetch_s=0.25, writing_batches=2, writing_least=least)
        c.taken(40)
        for _ in range(40):
            c.delivered(1e-6)
        # max_held 24 (4 + two batches), none undelivered; writing 40 against 20 or 64.
        assert c.room() == room, least


def test_a_page_reservation_returned_wakes_the_claim_loop_it_starved() -> None:
    c = _capacity()
    c.reserve(c.room())
    c.wait_for_room()
    assert c.room() == 0
    assert c.unreserve(8) is True


def _gate(seen: dict[str, Any]) -> store.GateReading:
    return store.GateReading(
        wait_s=seen.get("wait_s"),
        paused=seen.get("paused", False),
        retired=seen.get("retired", False),
        hold_s=seen.get("hold_s", 0.0),
        tokens_s=None,
        full=False,
    )


# (what, steps, state after, must read, page may claim at t=100, hold left at t=100)
GATE_CASES: list[tuple[str, list[tuple[str, Any]], GateState, bool, bool, float]] = [
    ("unread: read first, no page claim", [], GateState.UNKNOWN, True, False, 0.0),
    ("read open", [("read", {})], GateState.OPEN, False, True, 0.0),
    ("read paused", [("read", {"paused": True})], GateState.PAUSED, True, False, 0.0),
    (
        "read held for 5 s at t=98",
        [("read@98", {"hold_s": 5.0})],
        GateState.THROTTLED,
        False,
        False,
        3.0,
    ),
    (
        "a hold that passed lets a page claim",
        [("read@90", {"hold_s": 5.0})],
        GateState.THROTTLED,
        False,
        True,
        0.0,
    ),
    (
        "a NOTIFY: read again",
        [("read", {}), ("changed", None)],
        GateState.UNKNOWN,
        True,
        False,
        0.0,
    ),
    (
        "a NOTIFY keeps a pause",
        [("read", {"paused": True}), ("changed", None)],
        GateState.PAUSED,
        True,
        False,
        0.0,
    ),
    (
        "a NOTIFY keeps a hold",
        [("read@98", {"hold_s": 5.0}), ("changed", None)],
        GateState.UNKNOWN,
        True,
        False,
        3.0,
    ),
    (
        "a throttling answer holds and asks for a read",
        [("read", {}), ("hold", 104.0)],
        GateState.UNKNOWN,
        True,
        False,
        4.0,
    ),
    (
        "a longer hold wins",
        [("read", {}), ("hold", 104.0), ("hold", 102.0)],
        GateState.UNKNOWN,
        True,
        False,
        4.0,
    ),
    (
        "a pause is coming: nothing starts",
        [("read", {}), ("hold", math.inf)],
        GateState.UNKNOWN,
        True,
        False,
        math.inf,
    ),
    ("resumed", [("read", {"paused": True}), ("read", {})], GateState.OPEN, False, True, 0.0),
]


@pytest.mark.parametrize(
    ("steps", "state", "must_read", "page", "hold"),
    [c[1:] for c in GATE_CASES],
    ids=[c[0] for c in GATE_CASES],
)
def test_gate(
    steps: list[tuple[str, Any]], state: GateState, must_read: bool, page: bool, hold: float
) -> None:
    g = Gate()
    for step, arg in steps:
        if step.startswith("read"):
            at = float(step.partition("@")[2] or 100.0)
            g.read(_gate(arg), at)
        elif step == "changed":
            g.changed()
        elif step == "hold":
            g.hold(arg)
    assert g.state is state
    assert g.must_read() is must_read
    assert g.allows_page_claim(100.0) is page
    assert g.hold_left(100.0) == hold


@pytest.mark.parametrize(
    ("before", "seen", "changed", "give_back"),
    [
        ({}, {}, False, False),
        ({}, {"paused": True}, True, True),
        ({"paused": True}, {"paused": True}, False, True),
        ({"paused": True}, {}, True, False),
        ({}, {"hold_s": 2.0}, False, True),
        # A pause coming (a 410) is not yet a pause: the read that sees it says it changed.
        ("pause-coming", {"paused": True}, True, True),
    ],
)
def test_gate_read_says_what_changed_and_what_to_give_back(
    before: Any, seen: dict[str, Any], changed: bool, give_back: bool
) -> None:
    g = Gate()
    if before == "pause-coming":
        g.read(_gate({}), 0.0)
        g.hold(math.inf)
    else:
        g.read(_gate(before), 0.0)
    assert g.read(_gate(seen), 1.0) == (changed, give_back)


def test_a_passed_hold_is_lifted_by_the_worker_that_finds_it() -> None:
    g = Gate()
    g.read(_gate({"hold_s": 1.0}), 10.0)
    assert g.hold_left(10.5) == pytest.approx(0.5)
    assert g.hold_left(11.0) == 0.0
    assert (g.state, g.until) == (GateState.OPEN, 0.0)
