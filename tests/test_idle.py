"""What an idle daemon writes (issue 70): nothing on a pass that finds nothing to do, however
often it passes, and the record status and the alerts read is still kept.

The idle cost itself, in bytes of WAL beside the peers', is measured by ``python -m bench.idle``
(bench/README.md); here, the mechanisms: a pass's coordination lock writes no row, and the
passes' records are written when something happened or when the last one is a bound old."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import anyio
import psycopg
import pytest

from pgwork.config import RetentionPolicy
from pgwork.duties import materialise as materialiser
from pgwork.duties import retention
from pgwork.queries import Q

from .helpers import add, config, rows, running, until

pytestmark = pytest.mark.anyio

#: The row versions of the duties' state rows: a row lock (FOR UPDATE, FOR SHARE) sets xmax, an
#: update makes a new version (xmin). Unchanged: the row was neither written nor locked.
VERSIONS = """
SELECT (SELECT xmin::text || '/' || xmax::text FROM pgwork.materialiser_state) AS materialiser,
       (SELECT xmin::text || '/' || xmax::text FROM pgwork.retention_state) AS retention,
       (SELECT total_inserted FROM pgwork.materialiser_state) AS made
"""


def passes(d: Any, name: str) -> float:
    return float(d.metrics.registry.get_sample_value(name) or 0)


@pytest.mark.parametrize("lookahead", [0.0, 300.0])
@pytest.mark.parametrize("far_future", [0, 50])
async def test_an_idle_daemons_passes_write_nothing(
    dsn: str, conn: psycopg.AsyncConnection[Any], lookahead: float, far_future: int
) -> None:
    # Idle with nothing scheduled, and idle with reminders far ahead of any look-ahead.
    for i in range(far_future):
        await add(conn, f"far{i}", "now() + interval '30 days'")
    cfg = config(
        tick=0.1,
        lookahead=lookahead,
        metrics_enabled=True,
        metrics_listen="127.0.0.1:0",
        retention_interval=0.1,
        retention=RetentionPolicy(pause=0.0),
    )
    async with running(cfg, dsn) as d:

        async def first_passes() -> bool:
            return passes(d, "pgwork_materialiser_pass_seconds_count") >= 3

        await until(first_passes, what="the first passes")

        async def first_records() -> bool:
            # Each duty's first pass is recorded whatever it did (retention's first comes a
            # second after the start).
            got = await rows(
                conn,
                "SELECT 1 FROM pgwork.materialiser_state m, pgwork.retention_state r "
                "WHERE m.last_pass_at IS NOT NULL AND r.last_pass_at IS NOT NULL",
            )
            return bool(got)

        await until(first_records, what="each duty's first pass recorded")
        await anyio.sleep(0.3)
        (before,) = await rows(conn, VERSIONS)
        mat0 = passes(d, "pgwork_materialiser_pass_seconds_count")
        await anyio.sleep(2.0)
        (after,) = await rows(conn, VERSIONS)
        mat1 = passes(d, "pgwork_materialiser_pass_seconds_count")
    assert mat1 - mat0 >= 10  # passes ran meanwhile (one every tick) ...
    assert after == before  # ... and neither wrote nor locked a row


STATE = """
SELECT m.last_pass_at AS made_at, m.total_inserted AS made, r.last_pass_at AS kept_at,
       r.total_deleted AS deleted
  FROM pgwork.materialiser_state m, pgwork.retention_state r
"""


async def test_a_pass_that_did_something_is_recorded_at_once(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    # At the default bounds (a minute, ten minutes), far longer than this test.
    cfg = config(tick=0.1, retention_interval=0.1, retention=RetentionPolicy(keep=0.0, pause=0.0))
    async with running(cfg, dsn):
        await anyio.sleep(0.5)
        (idle,) = await rows(conn, STATE)
        await add(conn, "k")  # made, delivered, then deleted by retention (keep 0)

        async def recorded() -> bool:
            (s,) = await rows(conn, STATE)
            return bool(s["made"] == 1 and s["deleted"] == 1)

        await until(recorded, what="the passes that made and deleted it recorded", timeout=5.0)
    assert idle["made"] == 0 and idle["deleted"] == 0


async def test_idle_passes_are_recorded_once_a_bound(
    dsn: str, conn: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(materialiser, "IDLE_RECORD_EVERY", timedelta(seconds=1))
    monkeypatch.setattr(retention, "IDLE_RECORD_EVERY", timedelta(seconds=1))
    cfg = config(tick=0.1, retention_interval=0.1)
    async with running(cfg, dsn):
        await anyio.sleep(1.5)  # after retention's first pass, a second after the start
        (first,) = await rows(conn, STATE)
        await anyio.sleep(2.5)
        (later,) = await rows(conn, STATE)
    # Recorded again within the bound (what status shows, and what PgworkMaterialiserStale
    # would see if it read the table), not on every pass of the 25 in between.
    assert later["made_at"] > first["made_at"] and later["kept_at"] > first["kept_at"]
    assert later["made_at"] - first["made_at"] < timedelta(seconds=2.5)


# -- the heartbeat: alive by the session, not by writing ----------------------------------------


async def _daemon_row(conn: psycopg.AsyncConnection[Any], daemon_id: str) -> dict[str, Any]:
    got = await rows(
        conn,
        "SELECT xmin::text AS version, session_pid, heartbeat_at, heartbeat_every,"
        " pgwork.daemon_alive(d) AS alive FROM pgwork.daemon d WHERE id = %s",
        (daemon_id,),
    )
    assert got, f"no row for daemon {daemon_id}"
    return got[0]


async def test_an_idle_daemon_is_alive_without_writing_its_row(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 70: the heartbeat updated the daemon's row every lease/3 (3 of an idle daemon's 10
    WAL records a minute). Its LISTEN session now holds a lock keyed by the daemon's id and the
    row names that session: while both hold, the heartbeat writes nothing, and every reader sees
    the daemon alive long after its heartbeat would have aged out."""
    async with running(config(lease=1.5), dsn) as d:  # a heartbeat every 0.5 s

        async def named() -> bool:
            return (await _daemon_row(conn, d.daemon_id))["session_pid"] is not None

        await until(named, what="the daemon's row naming its session")
        before = await _daemon_row(conn, d.daemon_id)
        await anyio.sleep(4 * before["heartbeat_every"].total_seconds() + 1)  # > 3 intervals
        after = await _daemon_row(conn, d.daemon_id)
        assert after["version"] == before["version"]  # not written
        assert after["alive"], after
        (listed,) = await rows(conn, "SELECT id, gone FROM (" + Q["daemons"] + ") x")
        assert listed == {"id": d.daemon_id, "gone": False}


async def test_every_reader_judges_a_daemon_alive_the_same_way(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Every reader of pgwork.daemon — the list `pgwork status` and the web page show, `pgwork
    migrate`'s live daemons (which it asks to step aside), `channel retire`'s "served by", and the
    forgetting of gone daemons — over every state a row can be in: a heartbeat recent or an hour
    old, times its session lock held by the session the row names, held by another session (a pid
    reused by an unrelated session names a session without the lock), the row's session holding
    another daemon's lock, or no session named. Alive is: a recent heartbeat, or its own lock held
    by the session it names; a reader that disagreed would ask a dead daemon to step aside, or
    forget a live one."""
    from pgwork import store

    locks = ("none", "own", "reused_pid", "other_key")
    cases = [(fresh, lock) for fresh in (True, False) for lock in locks]
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as holder:
        holder_pid = holder.info.backend_pid
        other_pid = conn.info.backend_pid
        await conn.execute("INSERT INTO pgwork.channel (name, kind) VALUES ('c', 'log')")
        for fresh, lock in cases:
            daemon_id = f"d-{fresh}-{lock}"
            if lock in ("own", "reused_pid"):
                await holder.execute(
                    "SELECT pg_advisory_lock(pgwork.daemon_lock_class(), hashtext(%s))",
                    (daemon_id,),
                )
            await conn.execute(
                "INSERT INTO pgwork.daemon (id, host, pid, version, heartbeat_at, channels,"
                " session_pid) VALUES (%s, 'h', 1, 'v', now() - %s::interval, '{c}', %s)",
                (
                    daemon_id,
                    "0 seconds" if fresh else "1 hour",
                    {"none": None, "own": holder_pid, "reused_pid": other_pid}.get(
                        lock, holder_pid
                    ),
                ),
            )
        want = {f"d-{fresh}-{lock}": fresh or lock == "own" for fresh, lock in cases}
        listed = {r.id: not r.gone for r in await store.daemons(conn)}
        assert listed == want
        live = {d.id for d in await store.migrate_daemons(conn)}
        assert live == {i for i, alive in want.items() if alive}
        async with conn.transaction(force_rollback=True):
            (use,) = await rows(conn, Q["channel_retire_hold"], {"channel": "c"})
            served = {s.split(" ")[0] for s in use["served_by"]}
            assert served == {i for i, alive in want.items() if alive}
        async with conn.transaction(force_rollback=True):
            forgot = set(await store.daemons_forget_gone(conn))
            assert forgot == {i for i, alive in want.items() if not alive}


@pytest.mark.slow
async def test_a_killed_daemon_is_gone_at_once_and_its_pid_reused_does_not_revive_it(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    """A daemon SIGKILLed: its session ends with it and so does its lock, so it is shown gone at
    once, not three heartbeat intervals after its last write (it wrote none while idle). A new session that gets the dead
    session's pid (a wrap of the kernel's pids, made here) holds no lock of the daemon's and does
    not make it alive again."""
    from .processes import session_with_pid, toml

    d = procs(dsn, toml(channel='[channels.log]\nkind = "log"', lease="6s"))  # every 2 s

    async def alive_by_its_session_alone() -> bool:
        got = await rows(
            conn,
            "SELECT session_pid, heartbeat_at < now() - 3 * heartbeat_every AS stale,"
            " pgwork.daemon_alive(d) AS alive FROM pgwork.daemon d",
        )
        return bool(got) and got[0]["session_pid"] is not None and got[0]["stale"]

    await until(alive_by_its_session_alone, what="a heartbeat three intervals old (6 s)")
    (row,) = await rows(
        conn, "SELECT id, session_pid, pgwork.daemon_alive(d) AS alive FROM pgwork.daemon d"
    )
    assert row["alive"], row
    d.kill()

    async def gone() -> bool:
        listed = await rows(conn, "SELECT gone FROM (" + Q["daemons"] + ") x")
        return bool(listed[0]["gone"])

    await until(gone, timeout=2, what="the killed daemon shown gone")
    reused = await session_with_pid(dsn, row["session_pid"])
    if reused is None:
        pytest.skip("could not give a new session the dead session's pid here")
    try:
        assert await gone()
        live = await rows(conn, Q["migrate_daemons"])
        assert live == []
    finally:
        await reused.close()
