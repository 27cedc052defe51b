"""The benchmark workloads. Each takes a fresh database (cloned from a migrated template) and
returns its figures; the runner repeats them in interleaved rounds."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import psycopg

from pgwork import db, migration
from pgwork.channels import Delivered, Delivery, WebhookChannel
from pgwork.channels.python import PythonOptions
from pgwork.channels.webhook import WebhookOptions
from pgwork.config import ChannelConfig, Config, RetentionPolicy, RetryPolicy
from pgwork.daemon import Daemon
from pgwork.duties import gauges
from pgwork.duties import materialise as materialiser
from pgwork.duties.retention import Retention

from . import noop
from .cpu import CpuMeter, rss_kb

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Sizes:
    burndown: int = 100_000
    webhook: int = 20_000
    morning: int = 100_000
    latency_samples: int = 500
    lateness: int = 2_000
    lateness_window: float = 60.0
    materialise: int = 1_000_000
    retention: int = 1_000_000
    retention_burndown: int = 50_000
    scale_far: int = 10_000_000
    scale_terminal: int = 1_000_000
    app_insert: int = 100_000
    memory_seconds: float = 1200.0
    gauges_retained: int = 10_000_000
    fairness: int = 100_000
    #: Recurring reminders (monthly series) at one crunch (issue 27).
    series: int = 1_000_000
    #: Due sources the claim's cost is measured at (one claim of 100 rows each).
    fairness_sources: tuple[int, ...] = (1, 100, 10_000, 100_000)


FULL = Sizes()
QUICK = Sizes(
    burndown=50_000,
    webhook=10_000,
    morning=100_000,
    latency_samples=500,
    lateness=1_000,
    lateness_window=30,
    materialise=200_000,
    retention=200_000,
    retention_burndown=30_000,
    scale_far=1_000_000,
    scale_terminal=200_000,
    app_insert=50_000,
    memory_seconds=120,
    gauges_retained=1_000_000,
    fairness=100_000,
    series=100_000,
)
SMOKE = Sizes(
    burndown=2_000,
    webhook=300,
    morning=500,
    latency_samples=20,
    lateness=40,
    lateness_window=2,
    materialise=3_000,
    retention=3_000,
    retention_burndown=1_000,
    scale_far=5_000,
    scale_terminal=2_000,
    app_insert=2_000,
    memory_seconds=3,
    gauges_retained=20_000,
    fairness=2_000,
    fairness_sources=(1, 100, 1_000),
    series=1_000,
)

#: The daemon's settings for throughput workloads (no-op Python channel).
CONCURRENCY = 16
CLAIM_BATCH = 100


@dataclass
class Ctx:
    admin_dsn: str
    template: str
    postmaster: int | None
    sizes: Sizes
    #: Figures shared between workloads of one round (e.g. burn-down alone, for ratios).
    round_figures: dict[str, float] = field(default_factory=dict)
    _n: int = 0

    def fresh(self, template: str | None = None) -> tuple[str, str]:
        self._n += 1
        name = f"pgwork_bench_{os.getpid()}_{self._n}"
        with psycopg.connect(self.admin_dsn, autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template or self.template}"')
        return name, psycopg.conninfo.make_conninfo(self.admin_dsn, dbname=name)

    def drop(self, name: str) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def noop_channel(concurrency: int = CONCURRENCY) -> ChannelConfig:
    return ChannelConfig(
        name="noop",
        kind="python",
        options=PythonOptions(target="bench.noop:deliver"),
        concurrency=concurrency,
        retry=RetryPolicy(max_attempts=3, base=0.1, cap=1.0),
    )


def daemon_config(*channels: ChannelConfig, **kw: Any) -> Config:
    base: dict[str, Any] = {
        "metrics_enabled": False,
        "retention_enabled": False,
        "log_level": "warning",
        "claim_batch": CLAIM_BATCH,
        "pool_size": 8,
    }
    base.update(kw)
    return Config(channels={c.name: c for c in (channels or (noop_channel(),))}, **base)


async def insert_due(
    conn: psycopg.AsyncConnection[Any],
    n: int,
    *,
    channel: str = "noop",
    key: str = "k",
    due: str = "now() - interval '1 minute'",
    chunk: int = 50_000,
) -> None:
    for start in range(0, n, chunk):
        k = min(chunk, n - start)
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            f"SELECT 'bench', %s || g, {due}, %s, 'r' FROM generate_series(%s::int, %s::int) g",
            (key, channel, start + 1, start + k),
        )


async def migrate_with_noop(conn: psycopg.AsyncConnection[Any]) -> None:
    """The schema, and the bench's channels registered (so reminders naming them are
    accepted): ``noop`` (python) and ``hook`` (webhook)."""
    await migration.migrate(conn)
    await conn.execute(
        "INSERT INTO pgwork.channel (name, kind) VALUES ('noop', 'python'), ('hook', 'webhook')"
        " ON CONFLICT DO NOTHING"
    )


async def prepare_measure(conn: psycopg.AsyncConnection[Any]) -> None:
    """As the peer harness does before timing: fresh statistics, no dirty buffers."""
    await conn.execute("VACUUM (ANALYZE) pgwork.renewal_work, pgwork.reminder, pgwork.attempt")
    await conn.execute("CHECKPOINT")


async def seed_work(dsn: str, n: int, channel: str = "noop") -> None:
    """``n`` claimable work rows (reminders inserted and materialised; not timed)."""
    async with await db.connect(dsn) as c:
        await insert_due(c, n, channel=channel)
        res = await materialiser.run_once(c, lookahead=0, page_size=10_000)
        assert res is not None and res.made == n, res
        await prepare_measure(c)


async def drain(
    dsn: str,
    cfg: Config,
    n: int,
    postmaster: int | None,
    during: Callable[[], Coroutine[Any, Any, None]] | None = None,
    *,
    receiver: int | None = None,
) -> dict[str, float]:
    """Run a daemon until ``n`` outcomes are durable; time from its first claim. ``receiver``:
    the webhook receiver's pid, whose CPU is metered too."""
    d = Daemon(cfg, dsn)
    attempts = d.metrics.attempts
    claimed = d.metrics.claimed

    def settled() -> float:
        return sum(
            float(attempts.labels(c, o)._value.get())
            for c in cfg.channels
            for o in ("delivered", "duplicate")
        )

    def first() -> float:
        return float(sum(claimed.labels(c)._value.get() for c in cfg.channels))

    async with anyio.create_task_group() as tg:
        await tg.start(d.run)
        while first() == 0:
            await anyio.sleep(0.001)
        with CpuMeter(postmaster, receiver=receiver) as cpu:
            if during is not None:
                tg.start_soon(during)
            while settled() < n:
                await anyio.sleep(0.002)
        d.request_stop()
        tg.cancel_scope.deadline = anyio.current_time() + 30
    return {"jobs_per_s": n / cpu.elapsed, "seconds": cpu.elapsed, **cpu.as_dict()}


# -- 1. burn-down --------------------------------------------------------------------------


async def w_burndown(ctx: Ctx) -> dict[str, float]:
    name, dsn = ctx.fresh()
    try:
        n = ctx.sizes.burndown
        await seed_work(dsn, n)
        r = await drain(dsn, daemon_config(), n, ctx.postmaster)
        ctx.round_figures["burndown"] = r["jobs_per_s"]
        return r
    finally:
        ctx.drop(name)


# -- 2. webhook burn-down ------------------------------------------------------------------


def start_receiver() -> tuple[subprocess.Popen[str], str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen(
        [sys.executable, "-m", "bench.http_receiver", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p, f"http://127.0.0.1:{port}/hook"


#: The webhook workloads' channel concurrency, and the wide one's.
WEBHOOK_CONCURRENCY = 32
WIDE_CONCURRENCY = 64


def webhook_channel(url: str, concurrency: int) -> ChannelConfig:
    return ChannelConfig(
        name="hook",
        kind="webhook",
        options=WebhookOptions(url=url),
        concurrency=concurrency,
        retry=RetryPolicy(max_attempts=3, base=0.1, cap=1.0),
    )


async def _webhook_burndown(
    ctx: Ctx, dsn: str, receiver: subprocess.Popen[str], url: str, concurrency: int
) -> tuple[ChannelConfig, dict[str, float]]:
    """``webhook`` rows due, drained by a daemon whose webhook channel to ``url`` runs
    ``concurrency`` deliveries at once: the channel's config and the drain's figures."""
    n = ctx.sizes.webhook
    await seed_work(dsn, n, channel="hook")
    hook = webhook_channel(url, concurrency)
    return hook, await drain(dsn, daemon_config(hook), n, ctx.postmaster, receiver=receiver.pid)


async def w_webhook(ctx: Ctx) -> dict[str, float]:
    name, dsn = ctx.fresh()
    proc, url = start_receiver()
    try:
        n = ctx.sizes.webhook
        hook, r = await _webhook_burndown(ctx, dsn, proc, url, WEBHOOK_CONCURRENCY)
        ctx.round_figures["webhook"] = r["jobs_per_s"]
        # The HTTP limit: the same channel object (same clients, concurrency and document), no database.
        channel = WebhookChannel(hook)
        d = Delivery(
            work_id=1,
            operation_id=uuid.uuid4(),
            source="bench",
            business_key="k1",
            deadline=datetime.now(UTC),
            occurrence=timedelta(0),
            due_at=datetime.now(UTC),
            channel="hook",
            recipient="r",
            payload_json="{}",
            attempt=1,
        )
        left = n

        async def poster() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                assert isinstance(await channel.deliver(d), Delivered)

        try:
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(hook.concurrency):
                    tg.start_soon(poster)
            limit = n / (time.perf_counter() - t0)
        finally:
            await channel.aclose()
        body = d.document_json().encode()
        bare = await _aiohttp_bare(url, body, n, hook.concurrency)
        client_bare = await _client_bare(url, body, n, hook.concurrency)
        return {
            **r,
            "http_limit_per_s": limit,
            "ratio_to_http_limit": r["jobs_per_s"] / limit,
            "aiohttp_bare_per_s": bare,
            "ratio_to_aiohttp_bare": r["jobs_per_s"] / bare,
            "client_bare_per_s": client_bare,
            "ratio_to_client_bare": r["jobs_per_s"] / client_bare,
        }
    finally:
        proc.terminate()
        proc.wait(10)
        ctx.drop(name)


async def _posts_per_s(post: Callable[[], Awaitable[None]], n: int, concurrency: int) -> float:
    """``n`` calls of ``post``, ``concurrency`` at a time: calls per second."""
    left = n

    async def poster() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await post()

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(poster)
    return n / (time.perf_counter() - t0)


async def _aiohttp_bare(url: str, body: bytes, n: int, concurrency: int) -> float:
    """Requests/s of a bare aiohttp loop: one session, a connector of ``concurrency``
    connections, the same document, the same receiver, no database and no pgwork code."""
    import aiohttp

    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency), auto_decompress=False
    ) as session:

        async def post() -> None:
            async with session.post(url, data=body) as resp:
                await resp.read()
                assert resp.status == 200

        return await _posts_per_s(post, n, concurrency)


async def _client_bare(url: str, body: bytes, n: int, concurrency: int) -> float:
    """Requests/s of a bare loop of the client the webhook channel ships (pyreqwest): one
    client, ``concurrency`` requests in flight, the same document and receiver, no pgwork code."""
    from pyreqwest.client import ClientBuilder

    async with ClientBuilder().pool_max_idle_per_host(concurrency).gzip(False).build() as client:

        async def post() -> None:
            async with client.post(url).body_bytes(body).build_streamed() as resp:
                await resp.body_reader.read(65536)
                assert resp.status == 200

        return await _posts_per_s(post, n, concurrency)


# -- 2b. morning burst ---------------------------------------------------------------------

#: Fractions of the burst whose delivery time the morning workload reports (the curve).
MORNING_CURVE = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


async def _seed_morning(dsn: str, n: int) -> tuple[datetime, float]:
    """``n`` reminders at one local wall-clock time in Europe/London, far enough ahead to be
    written and materialised first: (the due instant, seconds it was ahead when written)."""
    lead = 20.0 + n / 10_000  # time to write and materialise before the due instant
    async with await db.connect(dsn) as c:
        cur = await c.execute(
            "SELECT date_trunc('second', (now() + make_interval(secs => %s)) "
            "AT TIME ZONE 'Europe/London') AS local",
            (lead,),
        )
        row = await cur.fetchone()
        assert row is not None
        await c.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, channel, recipient) "
            "SELECT 'bench', 'm' || g, %s, 'Europe/London', 'hook', 'r' FROM generate_series(1, %s) g",
            (row[0], n),
        )
        cur = await c.execute(
            "SELECT min(due_at), extract(epoch FROM min(due_at) - now()) FROM pgwork.reminder"
        )
        due_row = await cur.fetchone()
        assert due_row is not None and due_row[1] > 0, "the burst was written after its due time"
        await prepare_measure(c)
    return due_row[0], float(due_row[1])


async def _until_instant(dsn: str, at: datetime) -> None:
    """Sleep until ``at`` by the database's clock."""
    async with await db.connect(dsn) as c:
        cur = await c.execute("SELECT extract(epoch FROM %s::timestamptz - now())", (at,))
        left = await cur.fetchone()
    assert left is not None
    await anyio.sleep(max(0.0, float(left[0])))


async def _lateness(dsn: str) -> dict[str, float]:
    """From the ledger: seconds from each delivered row's due time to its delivery, p50 and p99,
    and to the last one."""
    async with await db.connect(dsn) as c:
        cur = await c.execute(
            "SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY late), max(late) "
            "FROM (SELECT extract(epoch FROM a.finished_at - w.due_at) AS late "
            "FROM pgwork.attempt a JOIN pgwork.renewal_work w ON w.id = a.work_id "
            "WHERE a.outcome = 'delivered') AS x"
        )
        lat = await cur.fetchone()
    assert lat is not None
    return {"late_p50_s": float(lat[0][0]), "late_p99_s": float(lat[0][1]), "last_s": float(lat[1])}


async def w_morning(ctx: Ctx) -> dict[str, float]:
    """Everyone's reminder at 09:00 local time: ``morning`` reminders with the same wall-clock
    due time in one zone, written ahead (the materialiser has made their rows by then, as its
    look-ahead does in production), sent through the webhook channel to the local receiver.
    Reports seconds from the due instant until the last is delivered, and the curve: seconds
    until each fraction in MORNING_CURVE was delivered."""
    name, dsn = ctx.fresh()
    proc, url = start_receiver()
    try:
        n = ctx.sizes.morning
        due_at, ahead = await _seed_morning(dsn, n)
        cfg = daemon_config(webhook_channel(url, WEBHOOK_CONCURRENCY), lookahead=60.0, tick=1.0)
        d = Daemon(cfg, dsn)
        done = d.metrics.attempts.labels("hook", "delivered")
        marks: dict[float, float] = {}
        async with anyio.create_task_group() as tg:
            await tg.start(d.run)
            await _until_instant(dsn, due_at)
            t0 = time.perf_counter()
            with CpuMeter(ctx.postmaster) as cpu:
                while len(marks) < len(MORNING_CURVE):
                    got = float(done._value.get())
                    for q in MORNING_CURVE:
                        if q not in marks and got >= q * n:
                            marks[q] = time.perf_counter() - t0
                    await anyio.sleep(0.01)
            d.request_stop()
            tg.cancel_scope.deadline = anyio.current_time() + 30
        late = await _lateness(dsn)
        return {
            "seconds": marks[1.0],
            "per_s": n / marks[1.0],
            "written_ahead_s": ahead,
            **{f"t{round(q * 100)}_s": marks[q] for q in MORNING_CURVE if q < 1.0},
            "late_p50_s": late["late_p50_s"],
            "late_p99_s": late["late_p99_s"],
            **cpu.as_dict(),
        }
    finally:
        proc.terminate()
        proc.wait(10)
        ctx.drop(name)


#: Daemon processes the ``*_group`` workloads run under one parent.
GROUP_PROCESSES = 2


@contextlib.contextmanager
def _group(dsn: str, url: str) -> Iterator[None]:
    """``pgwork run --processes GROUP_PROCESSES`` on ``dsn``, its webhook channel ``hook``
    posting to ``url`` as the in-process workloads' (concurrency 32, claim batch CLAIM_BATCH);
    stopped with SIGTERM on exit."""
    toml = (
        '[materialiser]\nlookahead = "60s"\ntick = "1s"\n'
        f"[worker]\nclaim_batch = {CLAIM_BATCH}\n[database]\npool_size = 8\n"
        '[metrics]\nenabled = false\n[retention]\nenabled = false\n[log]\nlevel = "warning"\n'
        f'[channels.hook]\nkind = "webhook"\nurl = "{url}"\nconcurrency = {WEBHOOK_CONCURRENCY}\n'
        'max_attempts = 3\nbackoff_base = "100ms"\nbackoff_cap = "1s"\n'
    )
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "group.toml"
        cfg.write_text(toml)
        group = subprocess.Popen(
            [sys.executable, "-m", "pgwork", "--config", str(cfg), "run", "--processes",
             str(GROUP_PROCESSES)],
            cwd=ROOT,
            env={**os.environ, "PGWORK_DSN": dsn},
        )  # fmt: skip
        try:
            yield
        finally:
            group.send_signal(signal.SIGTERM)
            try:
                group.wait(30)
            except subprocess.TimeoutExpired:
                group.kill()
                group.wait(10)


async def _until_delivered(dsn: str, n: int) -> None:
    async with await db.connect(dsn) as c:
        while True:
            cur = await c.execute(
                "SELECT count(*) FROM pgwork.renewal_work WHERE status = 'delivered'"
            )
            got = await cur.fetchone()
            if got is not None and got[0] >= n:
                return
            await anyio.sleep(0.25)


async def w_morning_group(ctx: Ctx) -> dict[str, float]:
    """The morning burst delivered by ``pgwork run --processes 2`` (real processes, as an
    operator runs them) instead of one daemon in this process. Its figures come from the
    ledger: seconds from the due instant to the last delivery, lateness p50 and p99. The
    daemons' CPU is in ``sys_cores`` (the machine), not ``py_cores`` (this process)."""
    name, dsn = ctx.fresh()
    proc, url = start_receiver()
    try:
        n = ctx.sizes.morning
        due_at, ahead = await _seed_morning(dsn, n)
        with _group(dsn, url):
            await _until_instant(dsn, due_at)
            with CpuMeter(ctx.postmaster) as cpu:
                await _until_delivered(dsn, n)
        late = await _lateness(dsn)
        return {
            "seconds": late["last_s"],
            "per_s": n / late["last_s"],
            "written_ahead_s": ahead,
            "late_p50_s": late["late_p50_s"],
            "late_p99_s": late["late_p99_s"],
            "processes": float(GROUP_PROCESSES),
            **cpu.as_dict(),
        }
    finally:
        proc.terminate()
        proc.wait(10)
        ctx.drop(name)


async def w_webhook_wide(ctx: Ctx) -> dict[str, float]:
    """The webhook burn-down with the channel twice as wide (WIDE_CONCURRENCY): a delivery waits
    on the receiver and on hand-offs between threads more than on the daemon's CPU, so the rate
    follows the concurrency (bench/README.md, issue 26). ``ratio_to_webhook``: against the
    ``webhook`` workload of the same round."""
    name, dsn = ctx.fresh()
    proc, url = start_receiver()
    try:
        _, r = await _webhook_burndown(ctx, dsn, proc, url, WIDE_CONCURRENCY)
        narrow = ctx.round_figures.get("webhook")
        return {
            **r,
            "concurrency": float(WIDE_CONCURRENCY),
            **({"ratio_to_webhook": r["jobs_per_s"] / narrow} if narrow else {}),
        }
    finally:
        proc.terminate()
        proc.wait(10)
        ctx.drop(name)


async def w_webhook_group(ctx: Ctx) -> dict[str, float]:
    """The webhook burn-down by ``pgwork run --processes 2``: ``webhook`` rows already due,
    drained by the group; deliveries per second from the ledger (first attempt started to last
    delivered), CPU of the machine in ``sys_cores``."""
    name, dsn = ctx.fresh()
    proc, url = start_receiver()
    try:
        n = ctx.sizes.webhook
        await seed_work(dsn, n, channel="hook")
        with _group(dsn, url), CpuMeter(ctx.postmaster) as cpu:
            await _until_delivered(dsn, n)
        async with await db.connect(dsn) as c:
            cur = await c.execute(
                "SELECT extract(epoch FROM max(finished_at) - min(started_at)) FROM pgwork.attempt"
            )
            row = await cur.fetchone()
        assert row is not None
        return {
            "jobs_per_s": n / float(row[0]),
            "seconds": float(row[0]),
            "processes": float(GROUP_PROCESSES),
            **cpu.as_dict(),
        }
    finally:
        proc.terminate()
        proc.wait(10)
        ctx.drop(name)


# -- 3. insert -> delivery latency ---------------------------------------------------------


async def latency_samples(
    dsn: str, n: int, cfg: Config | None = None, *, warmup: int = 0
) -> list[float]:
    """Milliseconds from before another connection's INSERT of a reminder due now until the
    channel is called, ``n`` times, on an otherwise idle daemon (after ``warmup`` samples that
    are not kept)."""
    noop.RECORD = True
    samples: list[float] = []
    try:
        async with anyio.create_task_group() as tg:
            d = Daemon(cfg or daemon_config(), dsn)
            await tg.start(d.run)
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as app:
                while d.metrics.listener_up._value.get() != 1:
                    await anyio.sleep(0.01)
                await anyio.sleep(0.2)
                for i in range(warmup + n):
                    key = f"lat{i}"
                    noop.expect(key)
                    t0 = time.time()
                    await app.execute(
                        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
                        "VALUES ('bench', %s, now(), 'noop', 'r')",
                        (key,),
                    )
                    with anyio.fail_after(10):
                        called = await noop.wait(key)
                    if i >= warmup:
                        samples.append((called - t0) * 1000)
                    await anyio.sleep(0.01)
            d.request_stop()
    finally:
        noop.RECORD = False
    return samples


async def w_latency(ctx: Ctx, *, template: str | None = None) -> dict[str, float]:
    name, dsn = ctx.fresh(template)
    try:
        return summary_ms(await latency_samples(dsn, ctx.sizes.latency_samples), "lat")
    finally:
        ctx.drop(name)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))]


def summary_ms(samples: list[float], prefix: str) -> dict[str, float]:
    return {
        f"{prefix}_p50_ms": pct(samples, 50),
        f"{prefix}_p99_ms": pct(samples, 99),
        f"{prefix}_max_ms": max(samples),
        f"{prefix}_mean_ms": statistics.fmean(samples),
        "samples": len(samples),
    }


# -- 4. lateness ---------------------------------------------------------------------------


async def w_lateness(ctx: Ctx) -> dict[str, float]:
    name, dsn = ctx.fresh()
    noop.RECORD = True
    try:
        n, window = ctx.sizes.lateness, ctx.sizes.lateness_window
        async with anyio.create_task_group() as tg:
            d = Daemon(daemon_config(), dsn)  # default tick (5 s) and look-ahead (5 min)
            await tg.start(d.run)
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as app:
                await app.execute(
                    "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
                    "SELECT 'bench', 'late' || g, now() + interval '2 seconds' + random() * %s * interval '1 second', "
                    "'noop', 'r' FROM generate_series(1, %s) g",
                    (window, n),
                )
                cur = await app.execute(
                    "SELECT business_key, extract(epoch FROM due_at) FROM pgwork.reminder"
                )
                due = {k: float(t) for k, t in await cur.fetchall()}
            with anyio.fail_after(window + 60):
                while len(noop.CALLED) < n:
                    await anyio.sleep(0.1)
            d.request_stop()
        late = [(noop.CALLED[k] - t) * 1000 for k, t in due.items()]
        return {**summary_ms(late, "late"), "early": sum(1 for x in late if x < 0)}
    finally:
        noop.RECORD = False
        ctx.drop(name)


# -- 5. materialise ------------------------------------------------------------------------


BARE_INSERT = """
INSERT INTO pgwork.renewal_work (reminder_id, source, business_key, deadline, occurrence, due_at, channel,
                                 operation_id, available_at)
SELECT r.id, r.source, r.business_key, r.due_at, b, r.due_at, r.channel,
       pgwork.operation_id(r.id, r.source, r.business_key, r.due_at, b), r.due_at
  FROM pgwork.reminder r, unnest(r.remind_before) b
"""


async def w_materialise(ctx: Ctx) -> dict[str, float]:
    n = ctx.sizes.materialise
    out: dict[str, float] = {}
    for bare in (False, True):
        name, dsn = ctx.fresh()
        try:
            async with await db.connect(dsn) as c:
                await insert_due(c, n, due="now() - interval '1 second'")
                await prepare_measure(c)
                with CpuMeter(ctx.postmaster) as cpu:
                    if bare:
                        await c.execute(BARE_INSERT)
                    else:
                        res = await materialiser.run_once(
                            c, lookahead=0, page_size=Config().page_size
                        )
                        assert res is not None and res.made == n
                if bare:
                    out["bare_rows_per_s"] = n / cpu.elapsed
                else:
                    assert res is not None
                    out.update(
                        {
                            "rows_per_s": n / cpu.elapsed,
                            "longest_txn_ms": res.longest_page * 1000,
                            **cpu.as_dict(),
                        }
                    )
        finally:
            ctx.drop(name)
    out["ratio_to_bare"] = out["rows_per_s"] / out["bare_rows_per_s"]
    return out


# -- 6. retention --------------------------------------------------------------------------


SEED_TERMINAL = """
INSERT INTO pgwork.renewal_work (reminder_id, source, business_key, deadline, occurrence, due_at, channel,
    operation_id, status, available_at, attempts, lease, claimed_at, claimed_by, finished_at)
SELECT -g, 'old', 'k' || g, now() - interval '40 days', '0', now() - interval '40 days', 'noop',
       md5('old' || g)::uuid, 'delivered', now(), 1, 1, now(), 'd',
       now() - interval '40 days' + g * interval '1 millisecond'
  FROM generate_series(%(start)s::int, %(end)s::int) g;
INSERT INTO pgwork.attempt (work_id, lease, attempt, daemon_id, host, pid, started_at, finished_at, outcome)
SELECT id, 1, 1, 'd', 'h', 1, finished_at, finished_at, 'delivered'
  FROM pgwork.renewal_work WHERE reminder_id BETWEEN -%(end)s AND -%(start)s
"""


async def seed_terminal(c: psycopg.AsyncConnection[Any], n: int) -> None:
    for start in range(1, n + 1, 200_000):
        end = min(n, start + 200_000 - 1)
        for stmt in SEED_TERMINAL.split(";"):
            await c.execute(stmt, {"start": start, "end": end})


async def w_retention(ctx: Ctx) -> dict[str, float]:
    n = ctx.sizes.retention
    out: dict[str, float] = {}
    name, dsn = ctx.fresh()
    try:
        async with await db.connect(dsn) as c:
            await seed_terminal(c, n)
            await prepare_measure(c)
            r = Retention(RetentionPolicy())
            with CpuMeter(ctx.postmaster) as cpu:
                res = await r.run_once(c)
            assert res.deleted == n, res
            out.update(
                {
                    "rows_per_s": n / cpu.elapsed,
                    "longest_batch_ms": res.longest_batch * 1000,
                    "batches": res.batches,
                    "timeouts": res.timeouts,
                }
            )
    finally:
        ctx.drop(name)
    # Burn-down alone, then with retention deleting n terminal rows at the same time.
    m = ctx.sizes.retention_burndown
    for with_retention in (False, True):
        name, dsn = ctx.fresh()
        try:
            async with await db.connect(dsn) as c:
                if with_retention:
                    await seed_terminal(c, n)
            await seed_work(dsn, m)
            longest = 0.0

            async def retention(dsn: str = dsn) -> None:
                nonlocal longest
                async with await db.connect(dsn) as rc:
                    rr = Retention(RetentionPolicy())
                    res = await rr.run_once(rc)
                    longest = res.longest_batch

            got = await drain(
                dsn,
                daemon_config(),
                m,
                ctx.postmaster,
                during=retention if with_retention else None,
            )
            key = "burndown_with_retention_per_s" if with_retention else "burndown_alone_per_s"
            out[key] = got["jobs_per_s"]
            if with_retention:
                out["longest_batch_during_burndown_ms"] = longest * 1000
        finally:
            ctx.drop(name)
    out["burndown_ratio_with_retention"] = (
        out["burndown_with_retention_per_s"] / out["burndown_alone_per_s"]
    )
    return out


# -- 7. scale ------------------------------------------------------------------------------


async def build_scale_template(ctx: Ctx) -> str:
    """A template with ``scale_far`` far-future reminders and ``scale_terminal`` retained rows."""
    name, dsn = ctx.fresh()
    async with await db.connect(dsn) as c:
        await insert_due(
            c,
            ctx.sizes.scale_far,
            key="far",
            chunk=500_000,
            due="now() + interval '30 days' + g * interval '1 second'",
        )
        await seed_terminal(c, ctx.sizes.scale_terminal)
        await prepare_measure(c)
    return name


async def w_scale(ctx: Ctx, scale_template: str) -> dict[str, float]:
    name, dsn = ctx.fresh(scale_template)
    try:
        n = ctx.sizes.burndown
        await seed_work(dsn, n)
        bd = await drain(dsn, daemon_config(), n, ctx.postmaster)
    finally:
        ctx.drop(name)
    lat = await w_latency(ctx, template=scale_template)
    out = {"burndown_per_s": bd["jobs_per_s"], **lat}
    if "burndown" in ctx.round_figures:
        out["burndown_ratio"] = bd["jobs_per_s"] / ctx.round_figures["burndown"]
    if "lat_p50_ms" in ctx.round_figures:
        out["latency_p50_ratio"] = ctx.round_figures["lat_p50_ms"] / lat["lat_p50_ms"]
    return out


# -- 7b. gauges ----------------------------------------------------------------------------

#: Live and dead rows present in both gauge databases: what the gauges should cost.
GAUGES_LIVE = 2_000
GAUGES_DEAD = 500

SEED_GAUGES = """
INSERT INTO pgwork.renewal_work (reminder_id, source, business_key, deadline, occurrence, due_at,
    channel, operation_id, status, available_at, attempts, lease, claimed_at, claimed_by,
    finished_at, dead_reason)
SELECT -g, 'g', 'k' || g, now() - interval '40 days', '0', now() - interval '1 hour', 'noop',
       md5('g' || g)::uuid, s.status, now() + interval '1 hour', 1, 1, now(), 'd',
       CASE WHEN s.status IN ('ready', 'claimed') THEN NULL
            ELSE now() - interval '40 days' + g * interval '1 millisecond' END,
       CASE WHEN s.status = 'dead' THEN 'seeded' END
  FROM generate_series(%(start)s::int, %(end)s::int) g,
       LATERAL (SELECT CASE WHEN g <= %(live)s THEN (CASE WHEN g %% 2 = 0 THEN 'ready' ELSE 'claimed' END)
                            WHEN g <= %(live)s + %(dead)s THEN 'dead'
                            ELSE 'delivered' END AS status) s
"""


async def build_gauges_template(ctx: Ctx, retained: int) -> str:
    """A database with the same live and dead rows, plus ``retained`` delivered rows."""
    name, dsn = ctx.fresh()
    async with await db.connect(dsn) as c:
        await c.execute("SET statement_timeout = 0")
        total = GAUGES_LIVE + GAUGES_DEAD + retained
        for start in range(1, total + 1, 1_000_000):
            end = min(total, start + 1_000_000 - 1)
            await c.execute(
                SEED_GAUGES,
                {"start": start, "end": end, "live": GAUGES_LIVE, "dead": GAUGES_DEAD},
            )
        await c.execute("VACUUM (ANALYZE) pgwork.renewal_work")
    return name


async def w_gauges(ctx: Ctx, empty_tpl: str, retained_tpl: str) -> dict[str, float]:
    """The daemon's gauge refresh (pgwork.gauges.read) on a database holding ``gauges_retained``
    delivered rows against one holding none, same live and dead rows, readings interleaved."""
    took: dict[str, list[float]] = {"empty": [], "retained": []}
    dsns = {
        "empty": psycopg.conninfo.make_conninfo(ctx.admin_dsn, dbname=empty_tpl),
        "retained": psycopg.conninfo.make_conninfo(ctx.admin_dsn, dbname=retained_tpl),
    }
    conns = {k: await db.connect(v) for k, v in dsns.items()}
    try:
        for _ in range(3):  # warm both caches
            for c in conns.values():
                await gauges.read(c, 20)
        for _ in range(40):
            for k, c in conns.items():
                took[k].append((await gauges.read(c, 20)).took)
        for k, c in conns.items():
            r = await gauges.read(c, 20)
            assert r.dead_letters == GAUGES_DEAD, (k, r.states)
    finally:
        for c in conns.values():
            await c.close()
    empty = statistics.median(took["empty"])
    retained = statistics.median(took["retained"])
    return {
        "refresh_empty_ms": empty * 1000,
        "refresh_retained_ms": retained * 1000,
        "refresh_ratio": empty / retained,
    }


# -- 8. app insert cost --------------------------------------------------------------------


async def w_app_insert(ctx: Ctx) -> dict[str, float]:
    n = ctx.sizes.app_insert
    out: dict[str, float] = {}
    for triggers in (True, False):
        name, dsn = ctx.fresh()
        try:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as app:
                if not triggers:
                    await app.execute("ALTER TABLE pgwork.reminder DISABLE TRIGGER USER")
                t0 = time.perf_counter()
                for start in range(0, n, 1000):  # one producer, chunks of 1000 rows
                    keys = [f"app{start + i}" for i in range(min(1000, n - start))]
                    await app.execute(
                        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
                        "SELECT 'app', k, now() + interval '60 days', 'noop', 'r' FROM unnest(%s::text[]) k",
                        (keys,),
                    )
                rate = n / (time.perf_counter() - t0)
            out["rows_per_s" if triggers else "no_triggers_rows_per_s"] = rate
        finally:
            ctx.drop(name)
    out["ratio"] = out["rows_per_s"] / out["no_triggers_rows_per_s"]
    return out


async def w_series(ctx: Ctx) -> dict[str, float]:
    """Recurring reminders (issue 27): n monthly rent series (09:00 Berlin on the 1st, a notice
    seven days before) written by an app in chunks of 1,000, and n one-off reminders of the same
    shape (local time, the same two sends) due a day earlier; then the materialiser with
    explicit cutoffs: a pass five minutes before the one-offs' notices (it visits every new
    series once and makes nothing: made_ahead), one at the one-offs' notices (the one-off crunch)
    and one at the series' (the rent-day crunch): rows/s of each, and their ratio. Insert cost
    against the same rows as one-off reminders, local-time and plain."""
    n = ctx.sizes.series
    name, dsn = ctx.fresh()
    try:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as app:
            row = await (
                await app.execute(
                    "SELECT (date_trunc('month', now() AT TIME ZONE 'Europe/Berlin') + interval '2 months'"
                    " + interval '9 hours')::timestamp"
                )
            ).fetchone()
            assert row is not None
            first: datetime = row[0]
            inserts = {
                "series": "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, "
                "remind_before, channel, recipient) SELECT 'rent', k, %(first)s, 'Europe/Berlin', "
                "'FREQ=MONTHLY;BYMONTHDAY=1', '{7 days, 0}', 'noop', 'r' FROM unnest(%(keys)s::text[]) k",
                # The one-off crunch's rows: the same sends, a day before the series' deadline.
                "local": "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, "
                "remind_before, channel, recipient) SELECT 'once', k, %(first)s - interval '1 day', "
                "'Europe/Berlin', '{7 days, 0}', 'noop', 'r' FROM unnest(%(keys)s::text[]) k",
                # Far ahead (they never reach the passes below): the plain insert's cost.
                "plain": "INSERT INTO pgwork.reminder (source, business_key, due_at, remind_before, "
                "channel, recipient) SELECT 'plain', k, now() + interval '400 days', "
                "'{7 days, 0}', 'noop', 'r' FROM unnest(%(keys)s::text[]) k",
            }
            rates = {}
            for kind, sql in inserts.items():
                t0 = time.perf_counter()
                for start in range(0, n, 1000):
                    keys = [f"{kind}{start + i}" for i in range(min(1000, n - start))]
                    await app.execute(sql, {"first": first, "keys": keys})
                rates[kind] = n / (time.perf_counter() - t0)
            await app.execute("VACUUM ANALYZE pgwork.reminder")
            notices = await (
                await app.execute(
                    "SELECT pgwork.local_to_instant(%(f)s::timestamp - interval '8 days', 'Europe/Berlin'),"
                    " pgwork.local_to_instant(%(f)s::timestamp - interval '7 days', 'Europe/Berlin')",
                    {"f": first},
                )
            ).fetchone()
            assert notices is not None
            oneoff_notice, series_notice = notices
        async with await db.connect(dsn) as c:
            await prepare_measure(c)

            async def crunch(cutoff: datetime) -> tuple[Any, float]:
                t0 = time.perf_counter()
                res = await materialiser.run_once(
                    c, lookahead=0, page_size=Config().page_size, cutoff=cutoff
                )
                assert res is not None
                return res, time.perf_counter() - t0

            ahead, visit_s = await crunch(oneoff_notice - timedelta(minutes=5))
            oneoff, oneoff_s = await crunch(oneoff_notice + timedelta(minutes=1))
            with CpuMeter(ctx.postmaster) as cpu:
                res, _ = await crunch(series_notice + timedelta(minutes=1))
            assert oneoff.made == n and res.made == n, (oneoff.made, res.made)
        return {
            "rows_per_s": n / cpu.elapsed,
            "oneoff_rows_per_s": n / oneoff_s,
            "ratio_to_oneoff": (n / cpu.elapsed) / (n / oneoff_s),
            "longest_txn_ms": res.longest_page * 1000,
            "oneoff_longest_txn_ms": oneoff.longest_page * 1000,
            "made_ahead": float(ahead.made),
            "first_visit_us": visit_s / n * 1e6,
            "insert_rows_per_s": rates["series"],
            "insert_ratio_to_local": rates["series"] / rates["local"],
            "insert_ratio_to_oneoff": rates["series"] / rates["plain"],
            **cpu.as_dict(),
        }
    finally:
        ctx.drop(name)


#: Seconds between the deadline and the crunch (the daemons' look-ahead), and the margin
#: between the last insert and the crunch; smaller in a smoke run.
RENT_DAY_LOOKAHEAD = {True: 5, False: 60}
RENT_DAY_MARGIN = {True: 5, False: 15}


async def w_rent_day(ctx: Ctx) -> dict[str, float]:
    """Rent day on real time (issue 27): n monthly series due at one local instant (Berlin),
    written ahead, made by three daemon processes (a look-ahead of a minute; a no-op channel):
    the share of occurrences made before their instant (target 1), how long the crunch took
    (first to last made), rows made for next month (target 0), and seconds from the instant to
    the last delivered. The SIGKILL during the crunch is tests/test_rent_day.py."""
    n = ctx.sizes.series
    smoke = n <= 10_000
    lookahead, margin = RENT_DAY_LOOKAHEAD[smoke], RENT_DAY_MARGIN[smoke]
    name, dsn = ctx.fresh()
    cfg = Path(f"/tmp/pgwork-bench-rent-{os.getpid()}.toml")
    cfg.write_text(noop_daemon_toml("1s", f"{lookahead}s"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as app:

            async def one(sql: str, *args: Any) -> Any:
                row = await (await app.execute(sql, args or None)).fetchone()
                return row[0] if row else None

            procs.extend(daemon_process(dsn, cfg) for _ in range(3))
            with anyio.fail_after(60):
                while await one("SELECT count(*) FROM pgwork.daemon") < 3:
                    await anyio.sleep(0.1)
            # The deadline: far enough ahead for the insert (at ~5k series/s) and the margin.
            lead = lookahead + margin + n / 5000
            first = await one(
                "SELECT date_trunc('second', now() AT TIME ZONE 'Europe/Berlin') + %s * interval '1 second'",
                lead,
            )
            for start in range(0, n, 1000):
                await app.execute(
                    "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, "
                    "channel, recipient) SELECT 'rent', 'flat-' || g, %s, 'Europe/Berlin', "
                    "'FREQ=MONTHLY', 'noop', 'r' FROM generate_series(%s::int, %s::int) g",
                    (first, start + 1, min(start + 1000, n)),
                )
            deadline = await one("SELECT pgwork.local_to_instant(%s, 'Europe/Berlin')", first)
            made_early = await one("SELECT count(*) FROM pgwork.renewal_work")
            with anyio.fail_after(lead + 600):
                while (
                    await one("SELECT count(*) FROM pgwork.renewal_work WHERE status = 'delivered'")
                    < n
                ):
                    await anyio.sleep(0.2)
            cur = await app.execute(
                "SELECT count(*) FILTER (WHERE created_at < deadline)::float8 / count(*),"
                " extract(epoch FROM max(created_at) - min(created_at)),"
                " count(*) FILTER (WHERE deadline_local <> %(first)s),"
                " extract(epoch FROM max(finished_at) - %(deadline)s)"
                " FROM pgwork.renewal_work",
                {"first": first, "deadline": deadline},
            )
            made_before, crunch_s, next_month, last_s = (await cur.fetchone()) or (0, 0, 0, 0)
        return {
            "made_before_instant": float(made_before),
            "crunch_s": float(crunch_s),
            "made_too_early": float(made_early),
            "next_month_rows": float(next_month),
            "last_delivered_s": float(last_s),
        }
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        cfg.unlink(missing_ok=True)
        ctx.drop(name)


# -- 9. memory -----------------------------------------------------------------------------


def noop_daemon_toml(tick: str, lookahead: str | None = None) -> str:
    """The config of the daemon processes the workloads start: the no-op channel (concurrency
    16), metrics and retention off, warnings only; the materialiser's tick (and look-ahead)."""
    ahead = f'lookahead = "{lookahead}"\n' if lookahead else ""
    return f"""
[materialiser]
tick = "{tick}"
{ahead}[metrics]
enabled = false
[retention]
enabled = false
[log]
level = "warning"
[channels.noop]
kind = "python"
target = "bench.noop:deliver"
concurrency = 16
"""


def daemon_process(dsn: str, cfg: Path) -> subprocess.Popen[bytes]:
    """``pgwork run`` with the config file ``cfg`` on database ``dsn``, as its own process."""
    return subprocess.Popen(
        [sys.executable, "-m", "pgwork", "--config", str(cfg), "run"],
        cwd=ROOT,
        env={**os.environ, "PGWORK_DSN": dsn, "PYTHONPATH": str(ROOT)},
    )


MEMORY_CONFIG = noop_daemon_toml("5s")


async def w_memory(ctx: Ctx, rate: float) -> dict[str, float]:
    """Peak RSS of a daemon process during a burn-down, then RSS growth under a steady load at
    ``rate`` reminders/s for ``memory_seconds``."""
    name, dsn = ctx.fresh()
    cfg = Path(f"/tmp/pgwork-bench-{os.getpid()}.toml")
    cfg.write_text(MEMORY_CONFIG)
    proc = None
    try:
        n = ctx.sizes.burndown
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as app:
            await insert_due(app, n)
            proc = daemon_process(dsn, cfg)

            async def delivered() -> int:
                cur = await app.execute(
                    "SELECT count(*) FROM pgwork.renewal_work WHERE status = 'delivered'"
                )
                row = await cur.fetchone()
                return int(row[0]) if row else 0

            with anyio.fail_after(600):
                while await delivered() < n:
                    await anyio.sleep(0.2)
            _, peak_kb = rss_kb(proc.pid)
            # Steady load: reminders due now, at `rate` per second, in ten inserts a second.
            per_tick = max(1, int(rate / 10))
            t_end = time.monotonic() + ctx.sizes.memory_seconds
            warm_at = time.monotonic() + min(60.0, ctx.sizes.memory_seconds / 4)
            warm_kb = 0
            i = 0
            while time.monotonic() < t_end:
                await insert_due(app, per_tick, key=f"steady{i}_", due="now()")
                i += 1
                if not warm_kb and time.monotonic() >= warm_at:
                    warm_kb = rss_kb(proc.pid)[0]
                await anyio.sleep(0.1)
            end_kb = rss_kb(proc.pid)[0]
        warm_kb = warm_kb or end_kb
        return {
            "peak_rss_mb": peak_kb / 1024,
            "steady_rss_start_mb": warm_kb / 1024,
            "steady_rss_end_mb": end_kb / 1024,
            "rss_growth_pct": 100 * (end_kb - warm_kb) / warm_kb,
            "steady_rate_per_s": per_tick * 10,
            "steady_seconds": ctx.sizes.memory_seconds,
        }
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        cfg.unlink(missing_ok=True)
        ctx.drop(name)


# -- 10. several daemons ---------------------------------------------------------------------

#: Daemon process counts the `daemons` workload compares.
DAEMON_COUNTS = (1, 2, 4)


async def w_daemons(ctx: Ctx) -> dict[str, float]:
    """Burn-down by 1, 2 and 4 daemon processes sharing one database (the memory workload's
    config: no-op channel, concurrency 16, claim batch 100): ``burndown`` reminders due now are
    inserted once every daemon has registered; rows/s from the insert until all are delivered,
    and how the deliveries split between the daemons (the largest and smallest share)."""
    out: dict[str, float] = {}
    cfg = Path(f"/tmp/pgwork-bench-daemons-{os.getpid()}.toml")
    cfg.write_text(MEMORY_CONFIG)
    try:
        for k in DAEMON_COUNTS:
            name, dsn = ctx.fresh()
            procs: list[subprocess.Popen[bytes]] = []
            try:
                procs.extend(daemon_process(dsn, cfg) for _ in range(k))
                n = ctx.sizes.burndown
                async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as app:

                    async def one(sql: str) -> int:
                        cur = await app.execute(sql)
                        row = await cur.fetchone()
                        return int(row[0]) if row else 0

                    with anyio.fail_after(60):
                        while await one("SELECT count(*) FROM pgwork.daemon") < k:
                            await anyio.sleep(0.1)
                    await anyio.sleep(1.0)  # every daemon past its first passes
                    t0 = time.perf_counter()
                    await insert_due(app, n, due="now()")
                    with anyio.fail_after(600):
                        while (
                            await one(
                                "SELECT count(*) FROM pgwork.renewal_work WHERE status = 'delivered'"
                            )
                            < n
                        ):
                            await anyio.sleep(0.02)
                    took = time.perf_counter() - t0
                    cur = await app.execute(
                        "SELECT count(*) FROM pgwork.attempt WHERE outcome = 'delivered' "
                        "GROUP BY daemon_id"
                    )
                    shares = [int(r[0]) / n for r in await cur.fetchall()]
                out[f"jobs_per_s_{k}"] = n / took
                out[f"share_max_{k}"] = max(shares)
                out[f"share_min_{k}"] = min(shares) if len(shares) == k else 0.0
            finally:
                for p in procs:
                    p.terminate()
                for p in procs:
                    p.wait(30)
                ctx.drop(name)
    finally:
        cfg.unlink(missing_ok=True)
    return out


# -- 11. fairness between sources ------------------------------------------------------------

#: Single reminders another source writes during the flood, and the pause before each.
FAIRNESS_PROBES = 5
FAIRNESS_EVERY = 0.5


async def w_fairness(ctx: Ctx) -> dict[str, float]:
    """One source's flood of ``fairness`` reminders due a minute ago, drained by one daemon
    (the burn-down's config); meanwhile another source writes one reminder due now, FAIRNESS_PROBES
    times, FAIRNESS_EVERY apart. Reports each probe's lateness (due -> delivered, database
    clock), median and max, and the flood rows still undelivered when the last probe was
    delivered (the probes did not wait for the flood)."""
    name, dsn = ctx.fresh()
    try:
        n = ctx.sizes.fairness
        await seed_work(dsn, n)

        async def probes() -> None:
            async with await db.connect(dsn) as app:
                for i in range(FAIRNESS_PROBES):
                    await anyio.sleep(FAIRNESS_EVERY)
                    await app.execute(
                        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
                        "VALUES ('other', %s, now(), 'noop', 'r')",
                        (f"probe-{i}",),
                    )

        r = await drain(dsn, daemon_config(), n + FAIRNESS_PROBES, ctx.postmaster, during=probes)
        async with await db.connect(dsn) as c:
            cur = await c.execute(
                "SELECT extract(epoch FROM a.finished_at - w.due_at)::float8, a.finished_at "
                "FROM pgwork.attempt a JOIN pgwork.renewal_work w ON w.id = a.work_id "
                "WHERE w.source = 'other' AND a.outcome = 'delivered' ORDER BY 1"
            )
            got = await cur.fetchall()
            assert len(got) == FAIRNESS_PROBES, got
            last = max(f for _, f in got)
            cur = await c.execute(
                "SELECT count(*) FROM pgwork.attempt a JOIN pgwork.renewal_work w ON w.id = a.work_id "
                "WHERE w.source = 'bench' AND a.outcome = 'delivered' AND a.finished_at > %s",
                (last,),
            )
            row = await cur.fetchone()
        late = [float(x) for x, _ in got]
        out = {
            "probe_late_p50_ms": statistics.median(late) * 1000,
            "probe_late_max_ms": max(late) * 1000,
            "flood_left_after_probes": float(row[0]) if row else 0.0,
            "flood_jobs_per_s": r["jobs_per_s"],
        }
    finally:
        ctx.drop(name)
    for sources in ctx.sizes.fairness_sources:
        out.update(await claim_cost(ctx, sources))
    return out


#: Claims timed per number of sources (median reported).
CLAIM_COST_SAMPLES = 7


async def claim_cost(ctx: Ctx, sources: int) -> dict[str, float]:
    """One claim of 100 rows with ``sources`` due sources (one row each; 10,000 rows between
    them when there are fewer): its time (median of CLAIM_COST_SAMPLES, each committed), the WAL
    it writes, the rows a second daemon's claim gets while the first one's transaction is open,
    and a claim's time when nothing is due (the rows and their sources' turns an hour ahead, as
    a lookahead materialises them). Uses only pgwork.store's claim, so the same code measures
    an older tree."""
    from pgwork import store

    name, dsn = ctx.fresh()
    try:
        rows = max(sources, 10_000)
        async with await db.connect(dsn) as c:
            await c.execute(
                "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
                "SELECT 'tenant-' || (g %% %s), 'k' || g, now() - interval '1 minute', 'noop', 'r' "
                "FROM generate_series(1, %s) g",
                (sources, rows),
            )
            made = 0
            while made < rows:
                res = await materialiser.run_once(c, lookahead=0, page_size=10_000)
                assert res is not None and res.made > 0, res
                made += res.made
            await c.execute("ANALYZE")
        req = store.ClaimRequest(
            channel="noop", limit=100, max_attempts=5, lease=timedelta(hours=1), daemon_id="bench"
        )

        async def lsn(c: psycopg.AsyncConnection[Any]) -> str:
            row = await (await c.execute("SELECT pg_current_wal_insert_lsn()::text")).fetchone()
            return str(row[0]) if row else "0/0"

        async def wal_since(c: psycopg.AsyncConnection[Any], at: str) -> float:
            q = "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s::pg_lsn)::float8"
            row = await (await c.execute(q, (at,))).fetchone()
            return float(row[0]) if row else 0.0

        times, wal = [], []
        async with await db.connect(dsn) as c, await db.connect(dsn) as probe:
            for _ in range(CLAIM_COST_SAMPLES):
                at = await lsn(probe)
                t0 = time.perf_counter()
                got = await store.claim_work(c, req)
                times.append(time.perf_counter() - t0)
                wal.append(await wal_since(probe, at))
                assert len(got) == 100, len(got)
        async with await db.connect(dsn) as a, await db.connect(dsn) as b:
            async with a.transaction():
                first = await store.claim_work(a, req)
                second = await store.claim_work(b, req)
        async with await db.connect(dsn) as c:
            await c.execute(
                "UPDATE pgwork.renewal_work SET available_at = now() + interval '1 hour' "
                "WHERE status = 'ready'"
            )
            if await (await c.execute("SELECT to_regclass('pgwork.lane')")).fetchone() != (None,):
                await c.execute("UPDATE pgwork.lane SET turn_at = now() + interval '1 hour'")
            await c.execute("ANALYZE")
            empty = []
            for _ in range(CLAIM_COST_SAMPLES):
                t0 = time.perf_counter()
                got = await store.claim_work(c, req)
                empty.append(time.perf_counter() - t0)
                assert not got, len(got)
        return {
            f"claim_ms_{sources}_sources": statistics.median(times) * 1000,
            f"claim_wal_kib_{sources}_sources": statistics.median(wal) / 1024,
            f"second_daemon_rows_{sources}_sources": float(len(second)) if first else 0.0,
            f"empty_claim_ms_{sources}_sources": statistics.median(empty) * 1000,
        }
    finally:
        ctx.drop(name)


def shrink(s: Sizes, factor: float) -> Sizes:
    scaled: dict[str, Any] = {
        k: max(1, int(v * factor)) if isinstance(v, int) else v for k, v in s.__dict__.items()
    }
    return replace(s, **scaled)


def randomise(seed: int) -> None:
    random.seed(seed)
