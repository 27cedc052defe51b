"""Running a schedule: a database of its own, real daemon processes, one real HTTP receiver, the
apps' sessions, the faults, and a record of everything the oracle needs.

Every step is a task started at its time; an edit that waits for a point of a send's life waits
in its own task, so a fault or another write is never held up by it. Every daemon is supervised
as systemd would (`Restart=on-failure`): one that exits is started again half a second later,
unless the schedule holds it down; an exit nobody caused is a violation. Everything the run
started (daemons, migrate, sessions, the receiver) is stopped when it ends, whatever happened."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import psycopg
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row

from pgwork.embedded import LocalServer

from ..processes import ROOT, DaemonProcess, next_migrate, session_with_pid
from ..receiver import Answer, Receiver, Request
from .schedule import RULES, Edit, Fault, Flood, Probes, Schedule, Write

#: Exit code of a daemon that stepped aside for `pgwork migrate` (pgwork.daemon.STEPPED_ASIDE).
STEPPED_ASIDE = 75
#: How often the invariant and the lease numbers are sampled while a faults schedule runs.
SAMPLE_EVERY = 0.3


@dataclass
class Sent:
    """One request the receiver got, as the oracle reads it."""

    t: float  # arrival, wall clock
    channel: str
    source: str
    key: str
    deadline: datetime
    deadline_local: str | None
    occurrence: float
    op: str
    attempt: int
    recipient: str
    status: int = 0  # what it was answered (0: no answer: held when the run ended, or dropped)

    @property
    def identity(self) -> tuple[str, str, str, float]:
        """The occurrence: a series' by its local deadline (kept across zone edits), a one-off's
        by its deadline's instant."""
        at = self.deadline_local or self.deadline.astimezone(UTC).isoformat()
        return (self.source, self.key, at, self.occurrence)


@dataclass
class Version:
    """A reminder as one write of an app left it (``row`` None: deleted)."""

    t_db: datetime  # the writing transaction's now()
    t_wall: float  # when its commit returned
    row: dict[str, Any] | None
    #: The work rows' leases the writing transaction saw: identity -> (attempts, expired).
    leases: dict[tuple[str, str, str, float], tuple[int, bool]] = field(default_factory=dict)
    what: str = "write"


@dataclass
class Record:
    """What happened in a run: the oracle's input, and the report's."""

    schedule: Schedule
    sent: list[Sent] = field(default_factory=list)
    versions: dict[tuple[str, str], list[Version]] = field(default_factory=dict)
    #: The other app's probes: key -> due instant (database clock).
    probes: dict[str, datetime] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    #: Edits: (source, key, column, the life point waited for, whether it was reached).
    edits: list[tuple[str, str, str, str, bool]] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Channels served by some daemon at the end.
    served_at_end: set[str] = field(default_factory=set)
    #: The database's clock when the settling began: what fired before it must be delivered.
    cutoff: datetime | None = None
    started: float = 0.0
    ended: float = 0.0
    #: A stale migration request was left by a killed migrate, and a daemon started since.
    stale_request: str | None = None


class NemesisServer:
    """A PostgreSQL server of the nemesis' own (a database crash must not touch any other
    test's), with a migrated template database; each schedule gets a copy."""

    def __init__(self, root: Path, pgbin: Path | None = None) -> None:
        from ..helpers import FAST_SETTINGS

        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)
        settings = dict(FAST_SETTINGS)
        # A crash must lose what an asynchronous commit had not flushed, as on a busy server.
        settings.update({"fsync": "off", "max_connections": "200"})
        self.server = LocalServer(root / "data", pgbin, settings=settings)
        self.port = 0
        self._n = 0

    def start(self) -> None:
        self.port = self.server.start()
        with psycopg.connect(self.server.dsn(), autocommit=True) as c:
            c.execute("DROP DATABASE IF EXISTS nemesis_tpl")
            c.execute("CREATE DATABASE nemesis_tpl")

        async def migrate() -> None:
            from pgwork import migration

            conn = await psycopg.AsyncConnection.connect(
                self.server.dsn("nemesis_tpl"), autocommit=True
            )
            try:
                await migration.migrate(conn)
            finally:
                await conn.close()

        anyio.run(migrate)

    def server_version(self) -> str:
        with psycopg.connect(self.server.dsn(), autocommit=True) as c:
            row = c.execute("SHOW server_version").fetchone()
        return str(row[0]) if row else "?"

    def new_database(self) -> str:
        self._n += 1
        name = f"nemesis_{os.getpid()}_{self._n}"
        with psycopg.connect(self.server.dsn(), autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}" TEMPLATE nemesis_tpl STRATEGY FILE_COPY')
        return name

    def drop_database(self, name: str) -> None:
        with (
            contextlib.suppress(psycopg.Error),
            psycopg.connect(self.server.dsn(), autocommit=True) as c,
        ):
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def crash(self) -> None:
        self.server.stop("immediate")

    def restart(self) -> None:
        self.server.start(self.port)

    def destroy(self) -> None:
        self.server.destroy()


class Slot:
    """One daemon of the schedule: its process now, and the channels it serves."""

    def __init__(self, index: int, serve: tuple[str, ...]) -> None:
        self.index = index
        self.serve = serve
        self.proc: DaemonProcess | None = None
        self.down = False  # held down by a fault (not restarted meanwhile)
        self.expected_exit = False  # the next exit was caused (a kill) or asked (a migrate)
        self.started = 0


class World:
    def __init__(self, schedule: Schedule, server: NemesisServer, workdir: Path) -> None:
        self.s = schedule
        self.server = server
        self.workdir = workdir
        self.rec = Record(schedule)
        self.db = ""
        self.dsn = ""
        self.slots = [Slot(i, serve) for i, serve in enumerate(schedule.knobs.serve)]
        self.receiver: Receiver | None = None
        self._lock = threading.Lock()
        #: Per reminder (source, key): the script of its next requests (life points).
        self._targets: dict[tuple[str, str], _Target] = {}
        self._gone_answered: set[str] = set()
        self._crashing = False
        self._crashed_at: float | None = None
        self._migrate: subprocess.Popen[bytes] | None = None
        self._migrate_pid: int | None = None
        self._migrate_killed_at: float | None = None
        self._held: list[psycopg.AsyncConnection[Any]] = []
        self._last_start = 0.0
        #: Set once every flood of the schedule is written (committed).
        self._flooded = anyio.Event()
        self._floods = sum(1 for st in schedule.steps if isinstance(st, Flood))

    # -- the run ---------------------------------------------------------------------------

    async def run(self, limit: float = 240.0) -> Record:
        self.db = self.server.new_database()
        self.dsn = make_conninfo(self.server.server.dsn(self.db))
        self.rec.started = time.time()
        try:
            with anyio.fail_after(limit):
                await self._run()
        except TimeoutError:
            self.rec.violations.append(f"the run did not end within {limit:g}s")
        finally:
            self.rec.ended = time.time()
            await self._teardown()
        return self.rec

    async def _run(self) -> None:
        k = self.s.knobs
        with Receiver(self._answer) as receiver:
            self.receiver = receiver
            async with self._app() as app:
                await app.execute(
                    "INSERT INTO pgwork.channel (name, kind) SELECT c, 'webhook' "
                    "FROM unnest(%s::text[]) AS c ON CONFLICT DO NOTHING",
                    (list(k.channels),),
                )
                for st in self.s.steps:
                    if isinstance(st, Flood) and st.how == "update":
                        await self._flood_rows(app, st, due="now() + interval '30 days'")
            await anyio.to_thread.run_sync(self._start_all)
            t0 = anyio.current_time()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._supervise)
                tg.start_soon(self._operator)
                if self.s.family == "faults":
                    tg.start_soon(self._sample)
                async with anyio.create_task_group() as steps:
                    for st in self.s.steps:
                        steps.start_soon(self._step_at, t0, st)
                await self._settle()
                tg.cancel_scope.cancel()
            await self._final_checks()

    async def _step_at(self, t0: float, st: Any) -> None:
        if isinstance(st, Probes) and st.after_flood:
            await self._flooded.wait()
            t0 = anyio.current_time()
        await anyio.sleep_until(t0 + st.at)
        try:
            if isinstance(st, Write):
                await self._write(st)
            elif isinstance(st, Flood):
                await self._flood(st)
            elif isinstance(st, Probes):
                await self._probes(st)
            elif isinstance(st, Edit):
                await self._edit(st)
            elif isinstance(st, Fault):
                await self._fault(st)
        except psycopg.OperationalError as e:
            # The database was down (a crash of the schedule's own): the step is lost, as an
            # app's would be; nothing the oracle expects rests on it (versions are recorded
            # only once committed).
            self.rec.notes.append(f"{type(st).__name__} at {st.at:.1f}s lost: {e}".strip())

    # -- daemons ---------------------------------------------------------------------------

    def _toml(self, serve: tuple[str, ...]) -> str:
        k = self.s.knobs
        assert self.receiver is not None
        chans = "".join(
            f'[channels.{c}]\nkind = "webhook"\nurl = "{self.receiver.url}"\n'
            f"concurrency = {k.concurrency}\nmax_attempts = {k.max_attempts}\n"
            'backoff_base = "50ms"\nbackoff_cap = "300ms"\nread_timeout = "5s"\n'
            'connect_timeout = "1s"\n'
            for c in serve
        )
        return (
            f"[database]\nsynchronous_claims = {str(k.synchronous_claims).lower()}\n"
            f'[materialiser]\ntick = "{_ms(k.tick)}"\nlookahead = "{_ms(k.lookahead)}"\n'
            f"page_size = {k.page_size}\n"
            f'[worker]\nlease = "{_ms(k.lease)}"\nclaim_batch = {k.claim_batch}\n'
            '[daemon]\nshutdown_grace = "2s"\n[metrics]\nenabled = false\n'
            '[log]\nformat = "json"\nlevel = "info"\n' + chans
        )

    def _start(self, slot: Slot) -> None:
        self._last_start = time.time()
        slot.started += 1
        slot.proc = DaemonProcess(
            self.dsn, self.workdir, self._toml(slot.serve), f"d{slot.index}.{slot.started}"
        )
        slot.expected_exit = False

    def _start_all(self) -> None:
        for slot in self.slots:
            self._start(slot)
        for slot in self.slots:
            assert slot.proc is not None
            slot.proc.wait_ready(40)

    async def _supervise(self) -> None:
        """Restart a daemon that exited, as systemd would; an exit nobody caused is a
        violation (with the end of its log)."""
        while True:
            await anyio.sleep(0.2)
            for slot in self.slots:
                p = slot.proc
                if p is None or slot.down or p.proc.poll() is None:
                    continue
                rc = p.proc.returncode
                if not slot.expected_exit and rc != STEPPED_ASIDE:
                    tail = p.log.read_text(errors="replace")[-2000:]
                    self.rec.violations.append(f"daemon {slot.index} exited {rc}:\n{tail}")
                p.kill()
                await anyio.sleep(0.5)
                if not slot.down:
                    self._start(slot)

    def _slot_of_pid(self, pid: int) -> Slot | None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.proc.pid == pid:
                return slot
        return None

    # -- the receiver ----------------------------------------------------------------------

    def _answer(self, r: Request) -> Answer:
        """Every request: recorded, then answered as its target (a life point) or its channel's
        receiver says. Runs in the receiver's thread."""
        b = r.body
        sent = Sent(
            t=r.at,
            channel=b["channel"],
            source=b["source"],
            key=b["business_key"],
            deadline=datetime.fromisoformat(b["deadline"]),
            deadline_local=b.get("deadline_local"),
            occurrence=float(b["occurrence_seconds"]),
            op=b["operation_id"],
            attempt=int(b["attempt"]),
            recipient=b["recipient"],
        )
        with self._lock:
            self.rec.sent.append(sent)
            target = self._targets.get((sent.source, sent.key))
        ans = target.answer(sent) if target is not None else None
        if ans is None:
            ans = self._channel_answer(sent)
        sent.status = 0 if ans.drop or ans.garbage else ans.status
        return ans

    def _channel_answer(self, sent: Sent) -> Answer:
        k = self.s.knobs
        how = k.answers[k.channels.index(sent.channel)] if sent.channel in k.channels else "ok"
        h = hash((self.s.seed, sent.op)) % 100
        if how == "flaky" and sent.attempt == 1 and h < 50:
            return Answer(status=500)
        if how == "throttle" and sent.attempt == 1 and h < 20:
            return Answer(status=429, headers={"Retry-After": "1"})
        if how == "slow" and h < 50:
            return Answer(delay=h / 50)
        if how == "gone":
            with self._lock:
                first = sent.channel not in self._gone_answered
                self._gone_answered.add(sent.channel)
            if first:
                return Answer(status=410)
        return Answer()

    async def _operator(self) -> None:
        """The operator on call: a channel a receiver paused with a 410 is resumed a moment
        later (`pgwork channel resume`), as the runbook says."""
        if "gone" not in self.s.knobs.answers:
            return
        while True:
            await anyio.sleep(1.0)
            try:
                async with self._app() as app:
                    cur = await app.execute("SELECT name FROM pgwork.channel WHERE paused")
                    paused = [r[0] for r in await cur.fetchall()]
            except psycopg.OperationalError:
                continue
            for name in paused:
                await anyio.to_thread.run_sync(
                    lambda n=name: self._pgwork("channel", "resume", n)  # type: ignore[misc]
                )

    def _pgwork(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pgwork", *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=self.workdir,
            env={**os.environ, "PGWORK_DSN": self.dsn, "PYTHONPATH": str(ROOT)},
        )

    # -- the apps --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _app(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        c = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
        try:
            yield c
        finally:
            await c.close()

    async def _version(
        self, app: psycopg.AsyncConnection[Any], source: str, key: str, what: str
    ) -> Version:
        """The reminder as the app's open transaction leaves it, and the leases of its work rows
        that transaction sees (read after the write: a claim that took a row first is seen)."""
        async with app.cursor(row_factory=dict_row) as cur:
            await cur.execute("SELECT now() AS t")
            got = await cur.fetchone()
            assert got is not None
            await cur.execute(
                "SELECT due_at, channel, recipient, recur, due_local, due_tz, recur_until, "
                "recur_skip, paused, ARRAY(SELECT extract(epoch FROM b)::float8 "
                "FROM unnest(remind_before) AS b) AS before FROM pgwork.reminder "
                "WHERE source = %s AND business_key = %s",
                (source, key),
            )
            row = await cur.fetchone()
            await cur.execute(
                "SELECT w.deadline, w.deadline_local, extract(epoch FROM w.occurrence)::float8 "
                "AS occurrence, l.attempts, l.expires_at <= now() + interval '2 seconds' AS "
                "expiring FROM pgwork.renewal_work w JOIN pgwork.work_lease l ON l.work_id = w.id "
                "WHERE w.source = %s AND w.business_key = %s",
                (source, key),
            )
            leases = {}
            for x in await cur.fetchall():
                at = (
                    x["deadline_local"].isoformat()
                    if x["deadline_local"] is not None
                    else x["deadline"].astimezone(UTC).isoformat()
                )
                leases[(source, key, at, float(x["occurrence"]))] = (x["attempts"], x["expiring"])
        return Version(got["t"], 0.0, row, leases, what)

    def _keep(self, source: str, key: str, v: Version) -> None:
        v.t_wall = time.time()
        self.rec.versions.setdefault((source, key), []).append(v)

    async def _write(self, st: Write) -> None:
        async with self._app() as app:
            for key in st.keys:
                async with app.transaction():
                    if st.rule is None:
                        await app.execute(
                            "INSERT INTO pgwork.reminder (source, business_key, due_at, "
                            "remind_before, channel, recipient, payload) VALUES (%s, %s, now() + "
                            "%s * interval '1 second', %s::interval[], %s, 'r', "
                            "jsonb_build_object('pad', repeat('x', %s)))",
                            (st.source, key, st.due_in, _intervals(st.before), st.channel,
                             st.payload),
                        )  # fmt: skip
                    else:
                        await app.execute(
                            "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, "
                            "recur, remind_before, channel, recipient) VALUES (%s, %s, "
                            "date_trunc('minute', now() AT TIME ZONE %s) + interval '1 minute', "
                            "%s, %s, %s::interval[], %s, 'r')",
                            (st.source, key, st.zone, st.zone, await _rule(app, st.rule, st.zone),
                             _intervals(st.before), st.channel),
                        )  # fmt: skip
                    v = await self._version(app, st.source, key, "insert")
                self._keep(st.source, key, v)

    async def _flood_rows(self, app: psycopg.AsyncConnection[Any], st: Flood, due: str) -> None:
        await app.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            f"SELECT 'noisy' || (g %% %s), 'flood:' || g, {due}, %s, 'r' "
            "FROM generate_series(1, %s) g",
            (st.sources, st.channel, st.n),
        )

    async def _flood(self, st: Flood) -> None:
        t = time.monotonic()
        try:
            async with self._app() as app:
                if st.how == "insert":
                    await self._flood_rows(app, st, due="now()")
                else:
                    await app.execute(
                        "UPDATE pgwork.reminder SET due_at = now() "
                        "WHERE business_key LIKE 'flood:%%'"
                    )
            self.rec.notes.append(
                f"flood of {st.n:,} over {st.sources} source(s) by {st.how}: "
                f"{time.monotonic() - t:.1f}s to write"
            )
        finally:
            self._floods -= 1
            if self._floods == 0:
                self._flooded.set()

    async def _probes(self, st: Probes) -> None:
        async with self._app() as app:
            for i in range(st.count):
                cur = await app.execute(
                    "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
                    "VALUES (%s, %s, now() + %s * interval '1 second', %s, 'r') "
                    "RETURNING due_at",
                    (f"other{i}", f"probe{i}", st.due_in, st.channel),
                )
                row = await cur.fetchone()
                assert row is not None
                self.rec.probes[f"probe{i}"] = row[0]
                await anyio.sleep(st.every)

    # -- edits at a point of a send's life -------------------------------------------------

    async def _edit(self, st: Edit) -> None:
        target = _Target(st.when)
        reached = True
        if st.when in ("in flight", "retrying", "dead", "redriven"):
            with self._lock:
                self._targets[(st.source, st.key)] = target
        try:
            if st.when == "ready":
                reached = await self._wait_ready(st)
            elif st.when in ("in flight", "retrying", "dead", "redriven"):
                reached = await _wait_event(target.arrived, st.within)
                if reached and st.when == "retrying":
                    await anyio.sleep(0.3)  # its outcome recorded: it waits for its retry
                if reached and st.when in ("dead", "redriven"):
                    reached = await self._wait_dead(st)
                    if reached and st.when == "redriven":
                        await self._redrive(st)
            elif st.when == "unmade":
                await self._wait_exists(st)
            await self._apply(st)
            if st.racing is not None and reached and st.when == "in flight":
                # Its daemon killed, the held request gets no answer: the send is owed again.
                target.drop = st.racing.kind == "kill"
                await self._fault(st.racing, holder=await self._holder(st))
            if st.when == "dead" and reached:
                await self._redrive(st)
        finally:
            target.release.set()
            with self._lock:
                if self._targets.get((st.source, st.key)) is target:
                    del self._targets[(st.source, st.key)]
        self.rec.edits.append((st.source, st.key, st.column, st.when, reached))

    async def _apply(self, st: Edit) -> None:
        async with self._app() as app:
            async with app.transaction():
                await app.execute(
                    "SELECT 1 FROM pgwork.reminder WHERE source = %s AND business_key = %s "
                    "FOR UPDATE",
                    (st.source, st.key),
                )
                sql, params = await _edit_sql(app, st)
                await app.execute(sql, params)
                v = await self._version(app, st.source, st.key, f"{st.column} at {st.when}")
            self._keep(st.source, st.key, v)

    async def _wait_exists(self, st: Edit) -> None:
        for _ in range(int(st.within / 0.1)):
            if (st.source, st.key) in self.rec.versions:
                return
            await anyio.sleep(0.1)

    async def _wait_ready(self, st: Edit) -> bool:
        """Its work row is made and waits in the queue."""
        return await self._wait_for(
            st,
            "SELECT 1 FROM pgwork.renewal_work w JOIN pgwork.work_ready q ON q.work_id = w.id "
            "WHERE w.source = %s AND w.business_key = %s",
        )

    async def _wait_dead(self, st: Edit) -> bool:
        """Its work row is a dead letter."""
        return await self._wait_for(
            st,
            "SELECT 1 FROM pgwork.renewal_work WHERE source = %s AND business_key = %s "
            "AND status = 'dead'",
        )

    async def _wait_for(self, st: Edit, sql: Any) -> bool:
        """Until ``sql`` (of the edit's source and key) finds a row, at most ``st.within``."""
        deadline = anyio.current_time() + st.within
        async with self._app() as app:
            while anyio.current_time() < deadline:
                cur = await app.execute(sql, (st.source, st.key))
                if await cur.fetchone():
                    return True
                await anyio.sleep(0.05)
        return False

    async def _redrive(self, st: Edit) -> None:
        """The operator redrives the reminder's dead letters (`pgwork dlq redrive ID…`)."""
        async with self._app() as app:
            cur = await app.execute(
                "SELECT id FROM pgwork.renewal_work WHERE source = %s AND business_key = %s "
                "AND status = 'dead'",
                (st.source, st.key),
            )
            ids = [str(r[0]) for r in await cur.fetchall()]
        if not ids:
            return
        r = await anyio.to_thread.run_sync(lambda: self._pgwork("dlq", "redrive", *ids))
        self.rec.notes.append(
            f"redrive of {st.source}/{st.key}: rc {r.returncode} {r.stdout.strip()[-200:]}"
            f"{r.stderr.strip()[-300:]}"
        )

    async def _holder(self, st: Edit) -> int | None:
        """The pid of the daemon holding a lease of this reminder's work (None: nobody)."""
        async with self._app() as app:
            cur = await app.execute(
                "SELECT d.pid FROM pgwork.renewal_work w JOIN pgwork.work_lease l "
                "ON l.work_id = w.id JOIN pgwork.daemon d ON d.id = l.claimed_by "
                "WHERE w.source = %s AND w.business_key = %s LIMIT 1",
                (st.source, st.key),
            )
            row = await cur.fetchone()
        return int(row[0]) if row else None

    # -- faults ----------------------------------------------------------------------------

    async def _fault(self, f: Fault, holder: int | None = None) -> None:
        self.rec.faults.append(f"{f.kind} at {f.at:.1f}s")
        if f.kind in ("kill", "stop"):
            slot = self._slot_of_pid(holder) if holder is not None else None
            slot = slot or self.slots[f.daemon % len(self.slots)]
            p = slot.proc
            if p is None or p.proc.poll() is not None:
                return
            if f.kind == "kill":
                slot.down = slot.expected_exit = True
                p.proc.send_signal(signal.SIGKILL)
                await anyio.sleep(f.hold)
                await anyio.to_thread.run_sync(lambda: p.proc.wait(10))
                if f.then_serve is not None:
                    slot.serve = f.then_serve
                p.kill()
                self._start(slot)
                slot.down = False
            else:
                p.proc.send_signal(signal.SIGSTOP)
                await anyio.sleep(f.hold)
                p.proc.send_signal(signal.SIGCONT)
        elif f.kind == "db crash":
            await anyio.to_thread.run_sync(self.server.crash)
            self._crashed_at = time.time()
            await anyio.sleep(f.hold)
            await anyio.to_thread.run_sync(self.server.restart)
        elif f.kind == "migrate killed":
            await self._migrate_killed(f)
        elif f.kind == "pid reused":
            await self._pid_reused(f)
        elif f.kind in ("app lock", "app transaction"):
            async with self._app() as app:
                async with app.transaction():
                    if f.kind == "app lock":
                        await app.execute(
                            "SELECT 1 FROM pgwork.reminder WHERE source = %s FOR UPDATE",
                            (f.source,),
                        )
                    else:
                        await app.execute("SELECT txid_current()")
                    await anyio.sleep(f.hold)

    async def _migrate_killed(self, f: Fault) -> None:
        """A next-version `pgwork migrate` (one step that sleeps in its transaction), SIGKILLed
        once it asked the daemons to step aside, or once it is inside its transaction."""
        self._migrate = next_migrate(self.dsn)
        for slot in self.slots:
            slot.expected_exit = True  # asked to step aside: they exit 75
        deadline = anyio.current_time() + 20
        async with self._app() as app:
            while anyio.current_time() < deadline and self._migrate.poll() is None:
                if f.step == "asked":
                    cur = await app.execute(
                        "SELECT migration_requester FROM pgwork.schema_version "
                        "WHERE migration_requested_at IS NOT NULL"
                    )
                else:
                    # The migrate names its session `pgwork migrate <token>` once it claims
                    # the migration (it starts as 'pgwork nemesis migrate').
                    cur = await app.execute(
                        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE "
                        "'pgwork%%migrate%%' AND query LIKE '%%pg_sleep%%' "
                        "AND state = 'active'"
                    )
                row = await cur.fetchone()
                if row is not None:
                    self._migrate_pid = int(row[0])
                    break
                await anyio.sleep(0.02)
        finished = self._migrate.poll() is not None
        self._migrate.send_signal(signal.SIGKILL)
        await anyio.to_thread.run_sync(lambda: self._migrate and self._migrate.wait(10))
        if finished:
            # Not pgwork's fault: the next version is installed and the daemons rightly refuse it.
            raise AssertionError(
                "harness: the next-version migrate finished before it was killed at its step"
            )
        self._migrate_killed_at = time.time()
        if self._migrate_pid is None:
            self.rec.notes.append("the migrate was killed before it reached its step")

    async def _pid_reused(self, f: Fault) -> None:
        """A new session, unrelated to pgwork, with the pid of the killed migrate's session
        (the kernel's next pid set to it, as a wrap of pid_max would), kept for ``hold``."""
        pid = self._migrate_pid
        if pid is None:
            self.rec.notes.append("no killed migrate's pid to reuse")
            return
        async with self._app() as app:
            for _ in range(100):  # the killed session's backend goes once its statement ends
                cur = await app.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,))
                if not await cur.fetchone():
                    break
                await anyio.sleep(0.1)
        c = await session_with_pid(self.dsn, pid)
        if c is None:
            self.rec.notes.append(f"pid {pid} could not be reused here; skipped")
            return
        self._held.append(c)
        self.rec.notes.append(f"pid {pid} reused by an unrelated session")
        await anyio.sleep(f.hold)

    # -- sampling and settling -------------------------------------------------------------

    async def _sample(self) -> None:
        """The queue's invariant while the run goes on, and lease numbers that never go down
        (after a crash, a claim committed without waiting for the disk may be gone with it:
        with synchronous_claims off the numbers are read afresh)."""
        highest: dict[int, int] = {}
        while True:
            await anyio.sleep(SAMPLE_EVERY)
            try:
                async with self._app() as app:
                    cur = await app.execute("SELECT * FROM pgwork.work_invariant() LIMIT 5")
                    broken = await cur.fetchall()
                    if broken:
                        self.rec.violations.append(f"the queue's invariant is broken: {broken}")
                    cur = await app.execute(
                        "SELECT w.id, greatest(w.lease, l.lease) FROM pgwork.renewal_work w "
                        "LEFT JOIN pgwork.work_lease l ON l.work_id = w.id"
                    )
                    now = await cur.fetchall()
            except psycopg.OperationalError:
                continue
            if self._crashed_at is not None and not self.s.knobs.synchronous_claims:
                highest.clear()
                self._crashed_at = None
            for wid, lease in now:
                if lease < highest.get(wid, 0):
                    self.rec.violations.append(
                        f"work row {wid}'s lease number went down: {highest[wid]} -> {lease}"
                    )
                highest[wid] = max(lease, highest.get(wid, 0))

    async def _settle(self) -> None:
        """Wait for the steps' tasks, then until every occurrence the oracle wants by now is
        delivered (at most ``settle`` seconds)."""
        from .oracle import missing

        async with self._app_retrying() as app:
            cur = await app.execute("SELECT now()")
            row = await cur.fetchone()
            assert row is not None
            self.rec.cutoff = row[0]
        self.rec.served_at_end = {c for slot in self.slots for c in slot.serve}
        deadline = anyio.current_time() + self.s.settle
        while anyio.current_time() < deadline:
            with self._lock:
                left = missing(self.rec)
            if not left:
                return
            await anyio.sleep(0.5)

    @contextlib.asynccontextmanager
    async def _app_retrying(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        for _ in range(100):
            try:
                c = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
                break
            except psycopg.OperationalError:
                await anyio.sleep(0.2)
        try:
            yield c
        finally:
            await c.close()

    async def _final_checks(self) -> None:
        from .oracle import judge

        async with self._app_retrying() as app:
            cur = await app.execute("SELECT * FROM pgwork.work_invariant() LIMIT 5")
            broken = await cur.fetchall()
            if broken:
                self.rec.violations.append(f"the queue's invariant is broken at the end: {broken}")
            if self._migrate_killed_at is not None and self._last_start > self._migrate_killed_at:
                cur = await app.execute(
                    "SELECT migration_requested_at, migration_requested_by "
                    "FROM pgwork.schema_version WHERE migration_requested_at IS NOT NULL"
                )
                left = await cur.fetchone()
                if left is not None:
                    self.rec.stale_request = f"requested at {left[0]} by {left[1]}"
            if self.rec.probes:
                # Where each probe's time went: made (its work row), then claimed and sent.
                cur = await app.execute(
                    "SELECT w.business_key, extract(epoch FROM w.created_at - w.due_at), "
                    "extract(epoch FROM w.claimed_at - w.due_at), "
                    "extract(epoch FROM (SELECT min(a.started_at) FROM pgwork.attempt a "
                    "WHERE a.work_id = w.id) - w.due_at) FROM pgwork.renewal_work w "
                    "WHERE w.source LIKE 'other%%' ORDER BY w.business_key"
                )
                self.rec.notes.append(
                    "probes made, claimed, sent (s after due): "
                    + ", ".join(
                        f"{k} {m:.2f} {c or 0:.2f} {s or 0:.2f}"
                        for k, m, c, s in await cur.fetchall()
                    )
                )
        with self._lock:
            judge(self.rec)

    async def _teardown(self) -> None:
        for c in self._held:
            with contextlib.suppress(Exception):
                await c.close()
        if self._migrate is not None and self._migrate.poll() is None:
            self._migrate.kill()
            self._migrate.wait(10)
        for slot in self.slots:
            p = slot.proc
            if p is None:
                continue
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)
                p.proc.send_signal(signal.SIGTERM)
                try:
                    await anyio.to_thread.run_sync(lambda p=p: p.proc.wait(10))  # type: ignore[misc]
                except subprocess.TimeoutExpired:
                    pass
            p.kill()
        with self._lock:
            for t in self._targets.values():
                t.release.set()
        with contextlib.suppress(Exception):
            if not self.server.server.running_port():
                self.server.restart()
        await anyio.to_thread.run_sync(lambda: self.server.drop_database(self.db))


class _Target:
    """The script of one reminder's next request: held while an edit runs (``in flight``),
    answered 503 with Retry-After 3 (``retrying``), or 400 (``dead``, ``redriven``)."""

    def __init__(self, when: str) -> None:
        self.when = when
        self.arrived = threading.Event()
        self.release = threading.Event()
        self.used = False
        self.drop = False

    def answer(self, sent: Sent) -> Answer | None:
        if self.used:
            return None
        self.used = True
        self.arrived.set()
        if self.when == "in flight":
            self.release.wait(30)
            return Answer(drop=True) if self.drop else None
        if self.when == "retrying":
            return Answer(status=503, headers={"Retry-After": "3"})
        return Answer(status=400)


async def _wait_event(event: threading.Event, within: float) -> bool:
    deadline = anyio.current_time() + within
    while not event.is_set():
        if anyio.current_time() > deadline:
            return False
        await anyio.sleep(0.02)
    return True


def _ms(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"


def _intervals(seconds: tuple[float, ...]) -> str:
    return "{" + ", ".join(f"{s:g} seconds" for s in seconds) + "}"


async def _rule(app: psycopg.AsyncConnection[Any], name: str, zone: str) -> str:
    """A rule of ``RULES`` for a series written now in ``zone``."""
    cur = await app.execute(
        "SELECT extract(hour FROM l)::int, to_char(l + interval '1 hour', 'YYYYMMDD\"T\"HH24MISS') "
        "FROM (SELECT date_trunc('minute', now() AT TIME ZONE %s) + interval '1 minute' AS l) x",
        (zone,),
    )
    row = await cur.fetchone()
    assert row is not None
    hour, until = row
    return RULES[name].format(h=f"{hour},{(hour + 1) % 24}", until=until)


async def _edit_sql(app: psycopg.AsyncConnection[Any], st: Edit) -> tuple[str, tuple[Any, ...]]:
    where = " WHERE source = %s AND business_key = %s"
    who = (st.source, st.key)
    if st.column == "delete":
        return "DELETE FROM pgwork.reminder" + where, who
    if st.column == "due_at":
        return (
            "UPDATE pgwork.reminder SET due_at = now() + %s * interval '1 second'" + where,
            (float(st.value), *who),
        )
    if st.column == "payload":
        return (
            "UPDATE pgwork.reminder SET payload = jsonb_build_object('pad', repeat('x', %s))"
            + where,
            (int(st.value), *who),
        )
    if st.column == "remind_before":
        return "UPDATE pgwork.reminder SET remind_before = %s::interval[]" + where, (
            st.value,
            *who,
        )
    if st.column == "recur":
        cur = await app.execute("SELECT due_tz FROM pgwork.reminder" + where, who)
        row = await cur.fetchone()
        zone = row[0] if row and row[0] else "UTC"
        return "UPDATE pgwork.reminder SET recur = %s" + where, (
            await _rule(app, st.value, zone),
            *who,
        )
    if st.column == "recur_skip":
        return (
            "UPDATE pgwork.reminder SET recur_skip = coalesce(recur_skip, '{}') || "
            "(date_trunc('minute', now() AT TIME ZONE due_tz) + interval '1 minute')" + where,
            who,
        )
    if st.column == "recur_until":
        return (
            "UPDATE pgwork.reminder SET recur_until = greatest(due_local, "
            "date_trunc('minute', now() AT TIME ZONE due_tz) + interval '1 minute')" + where,
            who,
        )
    if st.column == "paused":
        return "UPDATE pgwork.reminder SET paused = %s" + where, (st.value == "true", *who)
    # channel, recipient, due_tz: the value as it is.
    return f"UPDATE pgwork.reminder SET {st.column} = %s" + where, (st.value, *who)


def describe(rec: Record) -> dict[str, Any]:
    """A run's figures, for the report."""
    from .oracle import isolation_bound

    s = rec.schedule
    late = lateness(rec)
    worst = max(late.items(), key=lambda kv: kv[1], default=(None, None))
    return {
        "seed": s.seed,
        "family": s.family,
        "knobs": json.loads(json.dumps(s.knobs.__dict__, default=list)),
        "steps": len(s.steps),
        "edits": len(rec.edits),
        "edits_at_their_point": sum(1 for e in rec.edits if e[4]),
        "faults": rec.faults,
        "requests": len(rec.sent),
        "violations": rec.violations,
        "worst_probe_lateness_s": worst[1],
        "worst_probe": worst[0],
        "isolation_bound_s": round(isolation_bound(rec), 2) if rec.probes else None,
        "notes": rec.notes,
        "seconds": round(rec.ended - rec.started, 1),
    }


def lateness(rec: Record) -> dict[str, float]:
    """Each probe's first request after its due time, seconds (infinite: never sent)."""
    first: dict[str, float] = {}
    for x in rec.sent:
        if x.source.startswith("other"):
            first[x.key] = min(first.get(x.key, x.t), x.t)
    return {
        k: (first[k] - due.timestamp()) if k in first else float("inf")
        for k, due in rec.probes.items()
    }
