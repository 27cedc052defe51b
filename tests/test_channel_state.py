"""A channel's state after an outcome flush (throttle, its recovery, the circuit breaker, a
receiver's pause), as one function of the channel's row and the flush's counts:
``pgwork.channel_after_flush``, which ``record_outcomes`` applies. Table-driven, as the delivery
core's Capacity and Gate are (tests/test_delivery_state.py), on a real server: each case is a
channel row, what a flush brought, and the fields that must change (every other stays)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from .helpers import rows

pytestmark = pytest.mark.anyio

AT = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)

#: A channel as registered, nothing held.
PLAIN: dict[str, Any] = {"name": "c", "kind": "webhook", "failures": 0, "paused": False}
#: What a flush brought a channel: deliveries, failed attempts (retries that are not throttling
#: answers), a throttling answer's seconds (None: none), its reason, a pause reason.
NONE: dict[str, Any] = {"ok": 0, "failed": 0, "throttle": None, "reason": None, "pause": None}
#: Live leases of the channel when a throttle or a trip starts.
CLAIMED = 8

CASES: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]] = [
    ("a success on a plain channel changes nothing", {}, {"ok": 5}, {}),
    (
        "a throttling answer holds it and halves what it claimed",
        {},
        {"ok": 1, "throttle": 2.0, "reason": "HTTP 429"},
        {
            "not_before": AT + timedelta(seconds=2),
            "throttle_limit": CLAIMED // 2,
            "throttle_from": CLAIMED,
            "throttled_at": AT,
            "throttle_reason": "HTTP 429",
        },
    ),
    (
        "a second throttle within a second halves nothing more",
        {"throttle_limit": 4, "throttle_from": 8, "throttled_at": AT - timedelta(seconds=0.5)},
        {"throttle": 1.0, "reason": "HTTP 503"},
        {
            "not_before": AT + timedelta(seconds=1),
            "throttled_at": AT,
            "throttle_reason": "HTTP 503",
        },
    ),
    (
        "a throttle a second later halves the limit again",
        {"throttle_limit": 4, "throttle_from": 8, "throttled_at": AT - timedelta(seconds=5)},
        {"throttle": 1.0, "reason": "HTTP 503"},
        {
            "not_before": AT + timedelta(seconds=1),
            "throttle_limit": 2,
            "throttled_at": AT,
            "throttle_reason": "HTTP 503",
        },
    ),
    (
        "a hold already later is kept",
        {
            "not_before": AT + timedelta(seconds=30),
            "throttle_limit": 4,
            "throttle_from": 8,
            "throttled_at": AT - timedelta(seconds=5),
        },
        {"throttle": 1.0, "reason": "HTTP 503"},
        {"throttle_limit": 2, "throttled_at": AT, "throttle_reason": "HTTP 503"},
    ),
    (
        "each success raises the limit by one",
        {"throttle_limit": 4, "throttle_from": 8, "throttle_reason": "HTTP 429"},
        {"ok": 2},
        {"throttle_limit": 6},
    ),
    (
        "back where it was, the limit is lifted",
        {"throttle_limit": 4, "throttle_from": 8, "throttle_reason": "HTTP 429"},
        {"ok": 5},
        {"throttle_limit": None, "throttle_from": None, "throttle_reason": None},
    ),
    (
        "failures in a row below breaker_after are counted",
        {"breaker_after": 5, "breaker_probe": timedelta(seconds=30), "failures": 1},
        {"failed": 2},
        {"failures": 3},
    ),
    (
        "a success resets the count",
        {"breaker_after": 5, "breaker_probe": timedelta(seconds=30), "failures": 4},
        {"ok": 1, "failed": 3},
        {"failures": 0},
    ),
    (
        "reaching breaker_after trips it: held for the probe, then one at a time",
        {"breaker_after": 5, "breaker_probe": timedelta(seconds=30), "failures": 4},
        {"failed": 1},
        {
            "failures": 5,
            "not_before": AT + timedelta(seconds=30),
            "throttle_limit": 1,
            "throttle_from": CLAIMED,
            "throttled_at": AT,
            "throttle_reason": "circuit breaker: 5 failed attempts in a row; probing every 00:00:30",
        },
    ),
    (
        "a failed probe trips it again, the recovery's start kept",
        {
            "breaker_after": 5,
            "breaker_probe": timedelta(seconds=30),
            "failures": 5,
            "throttle_limit": 1,
            "throttle_from": 8,
            "throttled_at": AT - timedelta(seconds=40),
        },
        {"failed": 1},
        {
            "failures": 6,
            "not_before": AT + timedelta(seconds=30),
            "throttled_at": AT,
            "throttle_reason": "circuit breaker: 6 failed attempts in a row; probing every 00:00:30",
        },
    ),
    (
        "without a breaker, failures are not counted",
        {},
        {"failed": 3},
        {},
    ),
    (
        "a receiver's pause pauses it, saying who and why",
        {},
        {"pause": "HTTP 410 Gone"},
        {
            "paused": True,
            "paused_at": AT,
            "paused_by": "pgwork:d-1",
            "paused_reason": "HTTP 410 Gone",
        },
    ),
    (
        "an operator's pause is kept as it was",
        {
            "paused": True,
            "paused_at": AT - timedelta(hours=1),
            "paused_by": "ops",
            "paused_reason": "maintenance",
        },
        {"pause": "HTTP 410 Gone"},
        {},
    ),
]


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v.isoformat()
        if isinstance(v, datetime)
        else f"{v.total_seconds()} seconds"
        if isinstance(v, timedelta)
        else v
        for k, v in d.items()
    }


@pytest.mark.parametrize(("what", "row", "flush", "changed"), CASES, ids=[c[0] for c in CASES])
async def test_channel_after_flush(
    what: str,
    row: dict[str, Any],
    flush: dict[str, Any],
    changed: dict[str, Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    before = {**PLAIN, **row}
    f = {**NONE, **flush}
    (got,) = await rows(
        conn,
        "SELECT a.* FROM pgwork.channel_after_flush("
        " jsonb_populate_record(NULL::pgwork.channel, %s::jsonb),"
        " %s, %s, %s, %s, %s, %s, %s, %s) a",
        (
            json.dumps(_jsonable(before)),
            f["ok"],
            f["failed"],
            f["throttle"],
            f["reason"],
            f["pause"],
            CLAIMED,
            AT,
            "pgwork:d-1",
        ),
    )
    fields = set(got)
    expected = {k: before.get(k) for k in fields} | changed
    if expected.get("failures") is None:
        expected["failures"] = 0
    assert got == expected, what


@pytest.mark.parametrize(
    ("limits", "limited", "cap"),
    [
        ({}, False, None),
        ({"rate_limit": 50.0}, True, None),
        ({"global_concurrency": 4}, True, 4),
        ({"throttle_limit": 2}, True, 2),
        ({"global_concurrency": 4, "throttle_limit": 6}, True, 4),
        ({"global_concurrency": 4, "throttle_limit": 1}, True, 1),
    ],
)
async def test_a_limit_in_force_is_one_definition(
    conn: psycopg.AsyncConnection[Any], limits: dict[str, Any], limited: bool, cap: int | None
) -> None:
    """ "A limit is in force" was written three times in SQL (the claim's two steps, the page)
    and "how many may be claimed at once" twice: ``pgwork.limited`` and ``pgwork.claim_cap``
    are the one definition each, asked of a channel row."""
    row = {**PLAIN, **limits}
    got = await rows(
        conn,
        "SELECT pgwork.limited(c) AS limited, pgwork.claim_cap(c) AS cap "
        "FROM jsonb_populate_record(NULL::pgwork.channel, %s::jsonb) AS c",
        [json.dumps(row)],
    )
    assert got == [{"limited": limited, "cap": cap}]
