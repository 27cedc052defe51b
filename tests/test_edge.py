"""The delivery edge under control held in Postgres: channel-wide throttling, rate limits and
global concurrency across daemon processes, pause and resume (by operators and by a 410),
expiry, catch-up policies and the retry window. Real receivers, real daemons, a real server."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import anyio
import psycopg
import pytest

from pgwork.config import RetryPolicy

from .helpers import (
    add,
    claim,
    config,
    count,
    materialise,
    rows,
    running,
    settled,
    statement,
    sync_queue,
    until,
    webhook_channel,
)
from .processes import hook, toml
from .receiver import Answer, Receiver, Request
from .test_cli import pgwork

pytestmark = pytest.mark.anyio


async def _delivered(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    return await count(conn, "status = 'delivered'") == n


async def _insert_due(conn: psycopg.AsyncConnection[Any], n: int, channel: str = "hook") -> None:
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT 's', 'k' || g, now(), %s, 'r' FROM generate_series(1, %s) g",
        (channel, n),
    )


def _first_answer(first: Answer, rest: Answer) -> Callable[[Request], Answer]:
    """The very first request gets ``first``, every other one ``rest``."""
    lock = threading.Lock()
    seen = [0]

    def script(r: Request) -> Answer:
        with lock:
            seen[0] += 1
            n = seen[0]
        return first if n == 1 else rest

    return script


# -- throttle, rate limit, global concurrency: across three daemon processes ----------------


@pytest.mark.slow
async def test_one_429_holds_the_channel_in_every_daemon(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    """One 429 with Retry-After: 2 stops all three daemons' sends to the channel for ~2 s."""
    script = _first_answer(Answer(status=429, headers={"Retry-After": "2"}), Answer(delay=0.02))
    with Receiver(script) as receiver:
        for _ in range(3):
            procs(dsn, toml(channel=hook(receiver.url, concurrency=4)))
        await _insert_due(conn, 300)
        await until(lambda: _delivered(conn, 300), timeout=60, what="300 delivered")
        reqs = sorted(receiver.requests, key=lambda r: r.at)
        keys = receiver.keys()
    throttled = next(r for r in receiver.requests if r.n == 1 and r is reqs[0])
    t = throttled.at
    # Requests already on the wire when the 429 came back may land just after it; then silence
    # until Retry-After has passed, in every daemon.
    during = [r.at - t for r in reqs if t + 0.3 < r.at < t + 1.9]
    assert during == [], f"requests while the channel was held: {during[:5]}"
    assert any(r.at >= t + 1.9 for r in reqs)
    assert len(keys) == 300 and sum(keys.values()) == 301  # only the 429'd key twice
    daemons = await rows(conn, "SELECT count(DISTINCT daemon_id) AS n FROM pgwork.attempt")
    assert daemons[0]["n"] == 3


@pytest.mark.slow
async def test_rate_limit_holds_across_three_daemons(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    """rate_limit = 20/s shared by three daemons: over 30 s, within ±10% of 600 sends."""
    with Receiver() as receiver:
        for _ in range(3):
            procs(dsn, toml(channel=hook(receiver.url, rate_limit="20/s", rate_burst=5)))
        await _insert_due(conn, 1200)
        await until(lambda: _arrived(receiver, 1), timeout=20, what="first send")
        first = receiver.requests[0].at
        await anyio.sleep(32.5)
        reqs = list(receiver.requests)
        keys = receiver.keys()
    window = [r for r in reqs if first + 2 <= r.at < first + 32]
    assert 540 <= len(window) <= 660, f"{len(window)} sends in 30 s at 20/s"
    assert set(keys.values()) == {1}  # nothing claimed and rescheduled, nothing sent twice
    ledger = await rows(conn, "SELECT count(DISTINCT daemon_id) AS n FROM pgwork.attempt")
    assert ledger[0]["n"] >= 2


@pytest.mark.slow
async def test_global_concurrency_caps_deliveries_in_flight_across_daemons(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    lock = threading.Lock()
    in_flight = [0, 0]  # now, most

    def script(r: Request) -> Answer:
        with lock:
            in_flight[0] += 1
            in_flight[1] = max(in_flight[1], in_flight[0])
        time.sleep(0.1)
        with lock:
            in_flight[0] -= 1
        return Answer()

    with Receiver(script) as receiver:
        for _ in range(3):
            procs(dsn, toml(channel=hook(receiver.url, concurrency=8, global_concurrency=3)))
        await _insert_due(conn, 60)
        await until(lambda: _delivered(conn, 60), timeout=60, what="60 delivered")
        keys = receiver.keys()
    assert len(keys) == 60 and set(keys.values()) == {1}
    assert in_flight[1] == 3, f"at most {in_flight[1]} requests at once; the cap is 3"


async def test_throttle_state_halves_then_recovers_with_successes(dsn: str) -> None:
    """The statements alone: a throttling outcome holds the channel and halves what may be
    claimed; each success grows it back; back where it started, the throttle is lifted."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        await _insert_due(c, 12, channel="test")
        await materialise(dsn)
        held = await claim(dsn, limit=10)
        assert len(held) == 10

        def outcome(row: dict[str, Any], **kw: Any) -> dict[str, Any]:
            rec = {
                "work_id": row["id"],
                "lease": row["lease"],
                "attempt": 1,
                "channel": "test",
                "outcome": "retry",
                "status": "ready",
                "retry_after": 2.0,
                **kw,
            }
            return {"outcomes": json.dumps([rec]), "daemon_id": "d", "host": "h", "pid": 1}

        await statement(c, "record_outcomes", outcome(held[0], throttle=2.0, error="HTTP 429"))
        (ch,) = await rows(
            c,
            "SELECT throttle_limit, throttle_from, throttle_reason, "
            "extract(epoch FROM not_before - now()) AS hold FROM pgwork.channel WHERE name = 'test'",
        )
        assert (ch["throttle_limit"], ch["throttle_from"]) == (5, 10)
        assert 1.5 < ch["hold"] <= 2.0 and ch["throttle_reason"] == "HTTP 429"
        assert await claim(dsn) == []  # held: not even the two rows never claimed
        gate = (await statement(c, "next_available", {"channel": "test"}))[0]
        assert gate["hold_s"] > 1.5 and not gate["paused"]
        await c.execute("UPDATE pgwork.channel SET not_before = now() WHERE name = 'test'")
        # Nine rows are still claimed; the limit is five: nothing more may be claimed.
        assert await claim(dsn) == []
        for row in held[1:5]:
            await statement(
                c, "record_outcomes", outcome(row, outcome="delivered", status="delivered")
            )
        (ch,) = await rows(c, "SELECT throttle_limit FROM pgwork.channel WHERE name = 'test'")
        assert ch["throttle_limit"] == 9  # 5 + 4 successes
        for row in held[5:]:
            await statement(
                c, "record_outcomes", outcome(row, outcome="delivered", status="delivered")
            )
        (ch,) = await rows(
            c,
            "SELECT throttle_limit, throttle_from, throttle_reason FROM pgwork.channel WHERE name = 'test'",
        )
        assert ch == {"throttle_limit": None, "throttle_from": None, "throttle_reason": None}


async def test_circuit_breaker_holds_the_channel_and_probes_one_at_a_time(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Five failures in a row trip the breaker: the channel is held for the probe interval, then
    one delivery at a time probes it; once the receiver recovers, everything goes out."""
    healthy = [False]
    with Receiver(lambda r: Answer() if healthy[0] else Answer(status=500)) as receiver:
        await _insert_due(conn, 40)
        ch = webhook_channel(
            receiver.url,
            concurrency=4,
            retry=RetryPolicy(max_attempts=1000, base=0.01, cap=0.05),
            breaker_after=5,
            breaker_probe=1.0,
        )
        async with running(config(ch), dsn):
            await until(lambda: _breaker_tripped(conn), what="breaker tripped")
            tripped = time.time()
            await anyio.sleep(3.2)
            sent = [r.at for r in receiver.requests if r.at > tripped + 0.2]
            # Without the breaker: hundreds of requests in 3 s (backoff of at most 50 ms, 4 at
            # a time). With it: about one probe per second, one at a time.
            assert 1 <= len(sent) <= 6, f"{len(sent)} requests while the breaker held"
            (st,) = [c for c in await _channel_states(conn) if c["name"] == "hook"]
            assert st["throttled"] and "circuit breaker" in st["throttle_reason"]
            healthy[0] = True
            await until(lambda: _delivered(conn, 40), timeout=30, what="all after recovery")
        assert await count(conn, "status = 'dead'") == 0


async def _breaker_tripped(conn: psycopg.AsyncConnection[Any]) -> bool:
    got = await rows(conn, "SELECT throttle_reason FROM pgwork.channel WHERE name = 'hook'")
    return "circuit breaker" in (got[0]["throttle_reason"] or "")


async def _channel_states(conn: psycopg.AsyncConnection[Any]) -> list[dict[str, Any]]:
    return await statement(conn, "channel_states")


# -- pause and resume ------------------------------------------------------------------------


@pytest.mark.slow
async def test_pause_holds_work_across_a_restart_until_resumed(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    with Receiver() as receiver:
        cfg = toml(channel=hook(receiver.url))
        first = procs(dsn, cfg)
        r = pgwork("channel", "pause", "hook", "--reason", "receiver maintenance", dsn=dsn)
        assert r.returncode == 0 and "paused channel hook" in r.stdout, r.stderr
        await _insert_due(conn, 5)
        await anyio.sleep(2)
        assert receiver.requests == []
        listed = pgwork("channel", "list", "--json", dsn=dsn)
        (hook_state,) = [c for c in json.loads(listed.stdout) if c["name"] == "hook"]
        assert hook_state["state"] == "PAUSED"
        assert "receiver maintenance" in hook_state["why"]
        status = pgwork("status", dsn=dsn)
        assert "PAUSED" in status.stdout and "receiver maintenance" in status.stdout
        first.signal(15)
        assert first.wait() == 0
        procs(dsn, cfg)  # a new daemon: the pause is in the database, not in a process
        await anyio.sleep(2)
        assert receiver.requests == []
        # Nothing was attempted: the work waited.
        assert await count(conn, "status = 'ready' AND attempts = 0") == 5
        assert (await rows(conn, "SELECT count(*) AS n FROM pgwork.attempt"))[0]["n"] == 0
        r = pgwork("channel", "resume", "hook", dsn=dsn)
        assert r.returncode == 0 and "resumed channel hook" in r.stdout
        await until(lambda: _delivered(conn, 5), timeout=10, what="5 delivered after resume")
        assert set(receiver.keys().values()) == {1}
    r = pgwork("channel", "pause", "nosuch", dsn=dsn)
    assert r.returncode == 1 and "no channel named 'nosuch'" in r.stderr


async def test_a_paused_channel_gives_back_rows_it_had_queued(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Rows claimed but not started when the pause arrives go back (not counted); the ones in
    flight finish."""
    gate = threading.Event()
    with Receiver(lambda r: Answer(hold=gate)) as receiver:
        await _insert_due(conn, 30)
        async with running(config(webhook_channel(receiver.url, concurrency=2)), dsn):
            await until(lambda: _arrived(receiver, 2), what="two requests")
            await conn.execute("SELECT pgwork.pause_channel('hook', 'test')")
            await until(lambda: _claimed_at_most(conn, 2), what="queued rows given back on pause")
            gate.set()
            await until(lambda: _delivered(conn, 2), what="in-flight deliveries finish")
            await anyio.sleep(0.5)
            assert len(receiver.requests) == 2
            await conn.execute("SELECT pgwork.resume_channel('hook')")
            await until(lambda: _delivered(conn, 30), what="the rest after resume")
    released = await rows(
        conn, "SELECT count(*) AS n FROM pgwork.attempt WHERE outcome = 'released'"
    )
    assert released[0]["n"] >= 1
    assert await count(conn, "attempts - attempts_base > 1") == 0  # a give-back is no attempt


async def _arrived(receiver: Receiver, n: int) -> bool:
    return len(receiver.requests) >= n


async def _claimed_at_most(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    return await count(conn, "status = 'claimed'") <= n


async def test_410_pauses_the_channel_instead_of_dead_lettering(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    gone = [True]
    with Receiver(lambda r: Answer(status=410, body=b"gone") if gone[0] else Answer()) as receiver:
        await _insert_due(conn, 20)
        async with running(config(webhook_channel(receiver.url, concurrency=2)), dsn) as d:
            await until(lambda: _paused(conn), what="channel paused by 410")
            await until(
                lambda: _claimed_at_most(conn, 0), what="rows given back to the paused channel"
            )
            sent = len(receiver.requests)
            assert 1 <= sent <= 4  # what was in flight when the 410 came back, no more
            assert await count(conn, "status = 'dead'") == 0
            assert await count(conn, "status = 'ready'") == 20
            (ch,) = await rows(
                conn, "SELECT paused_reason, paused_by FROM pgwork.channel WHERE name = 'hook'"
            )
            assert "410 Gone" in ch["paused_reason"] and ch["paused_by"].startswith("pgwork:")
            await until(
                lambda: _metric(d, "pgwork_channel_paused", {"channel": "hook"}, 1),
                what="paused metric",
            )
            await anyio.sleep(0.5)
            assert len(receiver.requests) == sent
            gone[0] = False
            await conn.execute("SELECT pgwork.resume_channel('hook', 'ops')")
            await until(lambda: _delivered(conn, 20), what="delivered after resume")
            await until(
                lambda: _metric(d, "pgwork_channel_paused", {"channel": "hook"}, 0),
                what="paused metric cleared",
            )
    # Issue 68: the 410 was uncounted by taking its attempt back, so its retry carried the same
    # number: a receiver saw "attempt": 2 twice. It is an attempt (its number is not used
    # again) that does not count against the budget.
    seen: dict[str, list[int]] = {}
    for r in receiver.requests:
        seen.setdefault(r.key, []).append(r.body["attempt"])
    assert all(len(v) == len(set(v)) for v in seen.values()), seen
    assert any(v == [1, 2] for v in seen.values()), seen
    refused = await rows(conn, "SELECT attempts, attempts_base FROM pgwork.renewal_work "
                               "WHERE attempts = 2")  # fmt: skip
    assert refused and all(r["attempts_base"] == 1 for r in refused), refused


async def _paused(conn: psycopg.AsyncConnection[Any]) -> bool:
    got = await rows(conn, "SELECT paused FROM pgwork.channel WHERE name = 'hook'")
    return bool(got[0]["paused"])


async def _metric(d: Any, name: str, labels: dict[str, str], want: float) -> bool:
    return bool(d.metrics.registry.get_sample_value(name, labels) == want)


# -- expiry, catch-up, the retry window --------------------------------------------------------


async def test_expire_after_closes_a_stale_occurrence_unsent(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    with Receiver() as receiver:
        await add(conn, "stale", "now() - interval '2 hours'", channel="hook")
        await add(conn, "fresh", "now() - interval '10 minutes'", channel="hook")
        ch = webhook_channel(receiver.url, expire_after=3600.0)
        async with running(config(ch), dsn) as d:
            await until(lambda: _delivered(conn, 1), what="fresh delivered")
            await until(lambda: _settled_expired(conn), what="stale expired")
            assert (
                d.metrics.registry.get_sample_value(
                    "pgwork_closed_at_claim_total", {"channel": "hook", "reason": "expired"}
                )
                == 1
            )
        assert [r.body["business_key"] for r in receiver.requests] == ["fresh"]
    (w,) = await rows(
        conn,
        "SELECT status, last_error, finished_at FROM pgwork.renewal_work WHERE business_key = 'stale'",
    )
    assert w["status"] == "expired" and w["finished_at"] is not None
    assert "expire_after 01:00:00" in w["last_error"]
    status = await rows(
        conn, "SELECT status FROM pgwork.reminder_status WHERE business_key = 'stale'"
    )
    assert status == [{"status": "expired"}]


async def _settled_expired(conn: psycopg.AsyncConnection[Any]) -> bool:
    return await count(conn, "status = 'expired'") == 1


@pytest.mark.parametrize(
    ("policy", "sent"),
    [("all", ["30 days", "7 days"]), ("latest", ["7 days"]), ("none", [])],
)
async def test_catch_up_policy_for_occurrences_already_past(
    dsn: str, conn: psycopg.AsyncConnection[Any], policy: str, sent: list[str]
) -> None:
    """A reminder written two days before its deadline with {30 days, 7 days, 1 day}: the two
    occurrences already past are sent, or only the latest, or none; the future one is kept."""
    await conn.execute("UPDATE pgwork.channel SET catch_up = %s WHERE name = 'test'", (policy,))
    await add(conn, "late", "now() + interval '2 days'", before="{30 days, 7 days, 1 day}")
    # A reminder due at the moment it is written is not "already past" under any policy.
    await add(conn, "now", "now()")
    await materialise(dsn)
    got = await rows(
        conn,
        "SELECT business_key, occurrence::text AS occ, status, last_error FROM pgwork.renewal_work "
        "ORDER BY business_key, occurrence DESC",
    )
    ready = [r["occ"] for r in got if r["business_key"] == "late" and r["status"] == "ready"]
    assert ready == [{"30 days": "30 days", "7 days": "7 days"}[s] for s in sent]
    skipped = [r for r in got if r["status"] == "expired"]
    assert len(skipped) == 2 - len(sent)
    assert all(f"catch_up = {policy}" in r["last_error"] for r in skipped)
    assert [r["status"] for r in got if r["business_key"] == "now"] == ["ready"]
    # The future occurrence is untouched: it fires in a day.
    assert not [r for r in got if r["occ"] == "1 day"]
    # Moving the deadline re-plans: judged against the move, not the first write.
    await conn.execute(
        "UPDATE pgwork.reminder SET due_at = now() + interval '3 days' WHERE business_key = 'late'"
    )
    await materialise(dsn)
    moved = await rows(
        conn,
        "SELECT status FROM pgwork.renewal_work WHERE business_key = 'late' "
        "AND deadline > now() + interval '2 days 12 hours' ORDER BY occurrence DESC",
    )
    assert len(moved) == 2 and sum(r["status"] == "ready" for r in moved) == len(sent)


async def test_retry_window_ends_retries_and_the_next_try_is_shown(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    with Receiver(lambda r: Answer(status=500)) as receiver:
        await add(conn, "k", channel="hook")
        window = RetryPolicy(max_attempts=1000, base=0.2, cap=0.4, retry_for=2.0)
        ch = webhook_channel(receiver.url, retry=window)
        async with running(config(ch), dsn):
            await until(lambda: _dead(conn), what="dead once the window is spent")
        n = len(receiver.requests)
    (w,) = await rows(conn, "SELECT dead_reason, attempts FROM pgwork.renewal_work")
    assert "retry window spent" in w["dead_reason"] and w["attempts"] == n
    assert 3 <= n < 100  # far below max_attempts: the window, not the count, ended it
    ledger = await rows(
        conn, "SELECT outcome, retry_at, finished_at FROM pgwork.attempt ORDER BY lease"
    )
    assert all(x["retry_at"] is not None for x in ledger[:-1])
    assert ledger[-1]["retry_at"] is None  # the last one went dead
    assert all(x["retry_at"] - x["finished_at"] <= timedelta(seconds=0.5) for x in ledger[:-1])


async def _dead(conn: psycopg.AsyncConnection[Any]) -> bool:
    return await count(conn, "status = 'dead'") == 1


async def test_status_shows_when_the_next_retry_is(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    with Receiver(lambda r: Answer(status=500)) as receiver:
        await add(conn, "k", channel="hook")
        ch = webhook_channel(receiver.url, retry=RetryPolicy(base=600.0, cap=600.0))
        async with running(config(ch), dsn):
            await until(lambda: _retrying(conn), what="retry recorded")
    r = pgwork("status", "--json", dsn=dsn)
    (hook_state,) = [c for c in json.loads(r.stdout)["channels"] if c["name"] == "hook"]
    (w,) = await rows(conn, "SELECT available_at FROM pgwork.renewal_work")
    shown = datetime.fromisoformat(hook_state["next_retry_at"])
    assert abs(shown - w["available_at"]) < timedelta(seconds=1)
    assert "next_retry_at" in pgwork("status", dsn=dsn).stdout


async def _retrying(conn: psycopg.AsyncConnection[Any]) -> bool:
    return await count(conn, "status = 'ready' AND attempts = 1") == 1


# -- redrive by time window and reason ---------------------------------------------------------


async def test_redrive_selects_by_time_window_and_reason(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    for k in ("recent-500", "recent-404", "old-500"):
        await add(conn, k)
    await materialise(dsn)
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'dead', attempts = 1, lease = 1, "
        "dead_reason = CASE WHEN business_key LIKE '%%500' "
        "  THEN 'attempt budget spent (10 attempts); last error: HTTP 500: oops' "
        "  ELSE 'permanent failure: HTTP 404: no' END, "
        "finished_at = CASE WHEN business_key LIKE 'old%%' THEN now() - interval '5 hours' "
        "  ELSE now() - interval '10 minutes' END"
    )
    await sync_queue(conn)
    r = pgwork("dlq", "redrive", "1", "--since", "2h", dsn=dsn)
    assert r.returncode == 2 and "select among --all" in r.stderr
    r = pgwork("dlq", "redrive", "--all", "--since", "2h", "--reason-like", "%HTTP 5%", dsn=dsn)
    assert r.returncode == 0 and "redrove 1 dead letter:" in r.stdout, r.stderr
    got = await rows(
        conn, "SELECT business_key, status FROM pgwork.renewal_work ORDER BY business_key"
    )
    assert got == [
        {"business_key": "old-500", "status": "dead"},
        {"business_key": "recent-404", "status": "dead"},
        {"business_key": "recent-500", "status": "ready"},
    ]


async def test_redrive_has_the_pages_source_filter_and_a_dry_run(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 68: `dlq redrive` had no --dry-run and no --source (the web page has both)."""
    for k, source in (("a", "crm"), ("b", "crm"), ("c", "billing")):
        await add(conn, k, source=source)
    await materialise(dsn)
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'dead', attempts = 1, lease = 1, "
        "dead_reason = 'permanent failure: HTTP 400', finished_at = now()"
    )
    await sync_queue(conn)

    async def dead() -> list[str]:
        got = await rows(
            conn, "SELECT business_key FROM pgwork.renewal_work WHERE status = 'dead' ORDER BY 1"
        )
        return [g["business_key"] for g in got]

    r = pgwork("dlq", "redrive", "1", "--source", "crm", dsn=dsn)
    assert r.returncode == 2 and "select among --all" in r.stderr, r.stderr
    r = pgwork("dlq", "redrive", "--all", "--source", "crm", "--dry-run", dsn=dsn)
    assert r.returncode == 0, r.stderr
    assert "would redrive 2 dead letters" in r.stdout and "nothing was redriven" in r.stdout
    assert await dead() == ["a", "b", "c"]
    r = pgwork("dlq", "redrive", "--all", "--source", "crm", dsn=dsn)
    assert r.returncode == 0 and r.stdout.startswith("redrove 2 dead letters"), r.stdout
    assert await dead() == ["c"]


async def test_an_expired_occurrence_stays_unsent_after_retention_and_a_move_back(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Retention leaves a tombstone for an expired occurrence, as for a delivered one: moving the
    deadline away and back does not make it sendable again."""
    from pgwork.config import RetentionPolicy
    from pgwork.duties.retention import Retention

    await add(conn, "k", "now() - interval '2 hours'")
    await materialise(dsn)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        closed = await claim(dsn, limit=10, lease=30, expire_after=3600, on=c)
        assert [r["status"] for r in closed] == ["expired"]
        r = Retention(RetentionPolicy(keep=0.0, pause=0.0))
        assert (await r.run_once(c)).deleted == 1
    assert await rows(conn, "SELECT status FROM pgwork.retired") == [{"status": "expired"}]
    await conn.execute("UPDATE pgwork.reminder SET due_at = due_at + interval '1 day'")
    await conn.execute("UPDATE pgwork.reminder SET due_at = due_at - interval '1 day'")
    await materialise(dsn)
    assert await count(conn, "deadline < now()") == 0  # not made again
    (st,) = await rows(conn, "SELECT status, retired FROM pgwork.reminder_status")
    assert (st["status"], st["retired"]) == ("expired", True)


async def test_an_attempt_that_paused_the_channel_does_not_spend_the_budget(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 25, item 8: max_attempts 2; a 503, then a 410 that pauses the channel. After the
    operator's resume the row is sent once more (and delivered), not dead-lettered by the first
    claim with "attempt budget spent" without a request."""
    answers = iter([Answer(status=503), Answer(status=410, body=b"gone")])

    def script(r: Request) -> Answer:
        return next(answers, Answer())

    with Receiver(script) as receiver:
        await _insert_due(conn, 1)
        async with running(config(webhook_channel(receiver.url, max_attempts=2)), dsn):
            await until(lambda: _paused(conn), what="channel paused by 410")
            await until(lambda: _claimed_at_most(conn, 0), what="the row given back")
            (w,) = await rows(
                conn, "SELECT status, attempts, attempts_base FROM pgwork.renewal_work"
            )
            # The 410 is an attempt (issue 68: its number is not given to the next request),
            # not counted against the budget.
            assert w == {"status": "ready", "attempts": 2, "attempts_base": 1}
            await conn.execute("SELECT pgwork.resume_channel('hook', 'ops')")
            await until(lambda: settled(conn, 1), what="settled after resume")
        assert len(receiver.requests) == 3
        assert [r.body["attempt"] for r in receiver.requests] == [1, 2, 3]
    (w,) = await rows(conn, "SELECT status FROM pgwork.renewal_work")
    assert w["status"] == "delivered"


async def test_a_failed_give_back_keeps_the_rows_owned_and_tries_again(
    dsn: str, conn: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch, clean_sink: None
) -> None:
    """Issue 25, item 6: a pause makes the daemon give back the rows it queued; when that one
    release statement fails (a dropped connection, a failover: injected here as the error the
    driver raises), the rows must stay this daemon's to give back again, not be forgotten in the
    lease registry with live leases that nobody sends. After the resume all are delivered."""
    from pgwork import store

    from . import sink
    from .helpers import python_channel

    release = store.release_leases
    failed: list[int] = []

    async def flaky_release(*a: Any, **kw: Any) -> Any:
        if not failed:
            failed.append(len(kw["work_id"]))
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return await release(*a, **kw)

    monkeypatch.setattr(store, "release_leases", flaky_release)
    first = anyio.Event()
    go_on = anyio.Event()

    async def slow(d: Any) -> None:
        first.set()
        await go_on.wait()

    sink.BEHAVIOUR["k1"] = slow
    await _insert_due(conn, 8, channel="test")
    async with running(config(python_channel(concurrency=1)), dsn):
        with anyio.fail_after(10):
            await first.wait()
        await until(lambda: _claimed_at_least(conn, 2), what="rows queued behind the busy one")
        await anyio.sleep(0.2)
        queued = await count(conn, "status = 'claimed'") - 1
        await conn.execute("SELECT pgwork.pause_channel('test')")
        await until(lambda: _claimed_at_most(conn, 1), what="the queued rows given back")
        assert failed == [queued]
        go_on.set()
        await conn.execute("SELECT pgwork.resume_channel('test')")
        await until(lambda: _delivered(conn, 8), what="all 8 delivered after the resume")
    assert len(sink.DELIVERED) == 8


async def _claimed_at_least(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    return await count(conn, "status = 'claimed'") >= n


@pytest.mark.parametrize("limit_kind", ["throttle", "breaker_probe"])
async def test_a_throttle_limit_holds_across_overlapping_claims(
    limit_kind: str, dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 25, item 4: a throttle limit of 1 (or the breaker's one probe at a time, the same
    limit) set by a receiver's answers, with no rate limit or global concurrency configured.
    Two daemons' claims overlap: the first has claimed its row and not yet committed when the
    second runs. Together they must hold one row, not one each."""
    from pgwork import db, store

    await conn.execute(
        "UPDATE pgwork.channel SET throttle_limit = 1, throttle_from = 4, throttled_at = now(),"
        " failures = CASE WHEN %s THEN 5 ELSE 0 END, breaker_after = CASE WHEN %s THEN 5 END"
        " WHERE name = 'test'",
        (limit_kind == "breaker_probe", limit_kind == "breaker_probe"),
    )
    await _insert_due(conn, 5, channel="test")
    await materialise(dsn)

    def request(daemon: str) -> store.ClaimRequest:
        return store.ClaimRequest(
            channel="test", limit=10, max_attempts=5, lease=timedelta(seconds=30), daemon_id=daemon
        )

    got: dict[str, int] = {}
    async with await db.connect(dsn) as a, await db.connect(dsn) as b:
        await a.set_autocommit(False)

        async def second() -> None:
            got["b"] = len(await store.claim_work(b, request("b")))

        async with anyio.create_task_group() as tg:
            got["a"] = len(await store.claim_work(a, request("a")))  # in a's open transaction
            tg.start_soon(second)
            await anyio.sleep(0.5)  # b runs now, while a's claim is uncommitted
            await a.commit()
    assert got == {"a": 1, "b": 0}
    assert await count(conn, "status = 'claimed'") == 1


async def test_the_breaker_counts_every_failure_of_overlapping_flushes(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 25 (also): the circuit breaker's count of failures in a row was computed from each
    outcome statement's snapshot, so two daemons' flushes overlapping lost an increment. Two
    flushes of one failed attempt each, the second running while the first is uncommitted: the
    count is 2, and a breaker_after of 2 trips."""
    from pgwork import db

    await conn.execute(
        "UPDATE pgwork.channel SET breaker_after = 2, breaker_probe = '30 s' WHERE name = 'test'"
    )
    await _insert_due(conn, 2, channel="test")
    await materialise(dsn)
    claimed = await claim(dsn)
    assert len(claimed) == 2

    def failed(r: dict[str, Any]) -> str:
        return json.dumps(
            [
                {
                    "work_id": r["id"],
                    "lease": r["lease"],
                    "attempt": r["attempts"],
                    "channel": "test",
                    "outcome": "retry",
                    "status": "ready",
                    "retry_after": 5.0,
                    "started_ago": 0.2,
                    "finished_ago": 0.1,
                    "error": "HTTP 500",
                }
            ]
        )

    async def flush(c: psycopg.AsyncConnection[Any], r: dict[str, Any]) -> None:
        await statement(
            c, "record_outcomes", {"outcomes": failed(r), "daemon_id": "d", "host": "h", "pid": 1}
        )

    async with await db.connect(dsn) as a, await db.connect(dsn) as b:
        await a.set_autocommit(False)
        async with anyio.create_task_group() as tg:
            await flush(a, claimed[0])  # uncommitted
            tg.start_soon(flush, b, claimed[1])
            await anyio.sleep(0.5)  # b's flush waits for a's row lock on the channel
            await a.commit()
    (ch,) = await rows(
        conn, "SELECT failures, throttle_limit FROM pgwork.channel WHERE name = 'test'"
    )
    assert ch == {"failures": 2, "throttle_limit": 1}  # counted both, and tripped


async def test_a_redriven_row_older_than_expire_after_is_sent_not_expired(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 25 (also): a redrive is the operator saying "send it". A dead row due two hours ago
    on a channel with expire_after = 1 hour was reported redriven, then closed as expired at its
    next claim without a send. expire_after counts from the later of its due time and its last
    redrive."""
    await _insert_due(conn, 1, channel="test")
    await materialise(dsn)
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'dead', dead_reason = 'permanent failure',"
        " finished_at = now(), due_at = now() - interval '2 hours'"
    )
    await sync_queue(conn)
    (redriven,) = await statement(
        conn,
        "dlq_redrive",
        {
            "all": True,
            "ids": [],
            "channel": None,
            "source": None,
            "since": None,
            "reason_like": None,
            "operator": "ops",
        },
    )
    assert redriven["verdict"] == "ok"
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        got = await claim(dsn, limit=10, lease=30, expire_after=3600, on=c)
    assert [r["status"] for r in got] == ["claimed"]
