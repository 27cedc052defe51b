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
