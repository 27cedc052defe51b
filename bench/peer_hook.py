"""pgwork's row in ``shared/bench-peers`` (its ``PGWORK_BENCH_CMD`` hook).

The peer harness runs this each round against a fresh database (libpq variables, PGDATABASE)
with PB_JOBS, PB_BATCH, PB_WORKERS and PB_LAT_SAMPLES set, and reads the last stdout line::

    PGWORK_BENCH_CMD='cd /path/to/pgwork && .venv/bin/python -m bench.peer_hook' \\
        bash ../shared/bench-peers/run.sh

Like the other rows: enqueue PB_JOBS jobs (chunks of 1000, one producer; for pgwork that is an
app inserting reminders already due: what the producer waits for), VACUUM (ANALYZE) and
CHECKPOINT, then time only the drain (no-op Python channel, attempt ledger and fencing on): for
pgwork the daemon makes the work from the reminders and delivers it, its materialiser's pages
claiming what they make, as it runs in production. ``PGWORK_HOOK_MAKE_FIRST=1`` makes the work
before the drain and counts it in the enqueue instead (how this row was measured before
2026-12-08: its enqueue was the insert and the making together). Then measure
enqueue-to-handler latency on an idle daemon, on a schema made again (empty tables, as the other
rows' latency runs in a fresh database). ``PGWORK_HOOK_BATCH`` and ``PGWORK_HOOK_CONCURRENCY``
override the claim batch and the channel concurrency (defaults: PB_BATCH and PB_WORKERS).
``PGWORK_HOOK_SYNCHRONOUS_CLAIMS=1`` runs with ``database.synchronous_claims`` (claims durable at
commit, as the peers' are): the side-by-side table's like-for-like pgwork row.
"""

from __future__ import annotations

import json
import os
import sys
import time

import anyio
import psycopg

from pgwork import db
from pgwork.duties import materialise as materialiser

from . import workloads as w


def env_dsn() -> str:
    return psycopg.conninfo.make_conninfo(
        "",
        **{
            k: os.environ[v]
            for k, v in (
                ("host", "PGHOST"),
                ("port", "PGPORT"),
                ("user", "PGUSER"),
                ("dbname", "PGDATABASE"),
            )
            if os.environ.get(v)
        },
    )


async def main() -> dict[str, float]:
    jobs = int(os.environ.get("PB_JOBS", "100000"))
    batch = int(os.environ.get("PGWORK_HOOK_BATCH") or os.environ.get("PB_BATCH", "10"))
    conc = int(os.environ.get("PGWORK_HOOK_CONCURRENCY") or os.environ.get("PB_WORKERS", "4"))
    samples = int(os.environ.get("PB_LAT_SAMPLES", "200"))
    dsn = env_dsn()
    make_first = os.environ.get("PGWORK_HOOK_MAKE_FIRST", "") not in ("", "0")
    async with await db.connect(dsn) as c:
        await w.migrate_with_noop(c)
        t0 = time.perf_counter()
        await w.insert_due(c, jobs, chunk=1000)
        inserted = jobs / (time.perf_counter() - t0)
        if make_first:
            res = await materialiser.run_once(c, lookahead=0, page_size=10_000)
            assert res is not None and res.made == jobs
        enqueue = jobs / (time.perf_counter() - t0)
        await w.prepare_measure(c)
    sync = os.environ.get("PGWORK_HOOK_SYNCHRONOUS_CLAIMS", "") not in ("", "0")
    cfg = w.daemon_config(w.noop_channel(conc), claim_batch=batch, synchronous_claims=sync)
    drained = await w.drain(dsn, cfg, jobs, w_postmaster(dsn))
    # Latency: one reminder due now, inserted by another connection, until the channel is called;
    # on empty tables, as the other rows measure theirs (each in a fresh database): the schema is
    # made again, so the drain's 2 x PB_JOBS dead index entries are not what is measured.
    async with await db.connect(dsn) as c:
        await c.execute("DROP SCHEMA pgwork CASCADE")
        await w.migrate_with_noop(c)
    # The peer harness's rows each drop their first 10 samples (--warmup 10): so does this one.
    lat = await w.latency_samples(
        dsn,
        samples,
        w.daemon_config(w.noop_channel(1), claim_batch=1, synchronous_claims=sync),
        warmup=10,
    )
    return {
        "drain_jobs_per_s": round(drained["jobs_per_s"], 1),
        "enqueue_jobs_per_s": round(enqueue, 1),
        "insert_jobs_per_s": round(inserted, 1),
        "made_in_drain": not make_first,
        "lat_p50_ms": round(w.pct(lat, 50), 3),
        "lat_p99_ms": round(w.pct(lat, 99), 3),
        "pg_cores": drained["pg_cores"],
        "py_cores": drained["py_cores"],
        "sys_cores": drained["sys_cores"],
        "claim_batch": batch,
        "concurrency": conc,
    }


def w_postmaster(dsn: str) -> int | None:
    from .run import postmaster_of

    return postmaster_of(dsn)


if __name__ == "__main__":
    result = anyio.run(main)
    sys.stdout.flush()
    print(json.dumps(result, sort_keys=True), flush=True)
