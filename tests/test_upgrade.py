"""Upgrades while deliveries run, as operators run them: real daemon processes of this version
and of the previous one, `pgwork migrate` beside them, an app writing throughout."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

from pgwork import SCHEMA_VERSION, db, migration

from .helpers import add, rows, until
from .history import old_schema
from .processes import ROOT, hook, toml
from .receiver import Receiver

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

#: The last commit whose code runs schema 14: the daemons that predate the migration handshake.
SCHEMA_14_COMMIT = "6802c5d"


def _errors(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in lines if e.get("level") in ("error", "critical")]


async def _app_writes(dsn: str, stop: anyio.Event, waits: list[float], prefix: str) -> None:
    """An app inserting a reminder due now every 50 ms, timing each insert."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        n = 0
        while not stop.is_set():
            t = time.monotonic()
            await add(c, f"{prefix}{n}", channel="hook")
            waits.append(time.monotonic() - t)
            n += 1
            await anyio.sleep(0.05)


async def test_a_running_daemon_steps_aside_for_the_next_migration(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    """A daemon of this version, delivering, is asked by the next migration (a test-only
    schema, one past this one) to step aside: it stops claiming, finishes what it holds, says so in one line
    and exits 75; the migration then runs. Nothing lost (every row delivered or ready, none left
    claimed), nothing sent twice, the app never waited long, no error logged anywhere."""
    waits: list[float] = []
    with Receiver() as receiver:
        daemon = procs(dsn, toml(channel=hook(receiver.url)))
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_app_writes, dsn, stop, waits, "k")
            await until(lambda: _delivered(conn, 20), what="deliveries under way")
            said = await migration.migrate(
                conn,
                version=SCHEMA_VERSION + 1,
                steps={SCHEMA_VERSION + 1: "ALTER TABLE pgwork.reminder ADD COLUMN test_only int;"},
                step_aside_within=30,
            )
            await anyio.sleep(0.5)
            stop.set()
        assert (
            said == f"upgraded pgwork schema from version {SCHEMA_VERSION} to {SCHEMA_VERSION + 1}"
        )
        assert daemon.wait(30) == 75
        keys = receiver.keys()
    lines = daemon.lines()
    assert not _errors(lines), _errors(lines)
    aside = [e for e in lines if "stepping aside" in str(e.get("event"))]
    assert len(aside) == 1 and aside[0]["level"] == "warning", aside
    assert max(keys.values()) == 1  # one request per occurrence: nothing sent twice
    states = await rows(conn, "SELECT status, count(*) AS n FROM pgwork.renewal_work GROUP BY 1")
    assert {s["status"] for s in states} <= {"delivered", "ready"}, states  # none left claimed
    made = await rows(conn, "SELECT count(*) AS n FROM pgwork.reminder")
    assert made[0]["n"] == len(waits) and sum(s["n"] for s in states) <= len(waits)
    assert (await rows(conn, "SELECT version FROM pgwork.schema_version"))[0]["version"] == (
        SCHEMA_VERSION + 1
    )
    assert max(waits) < 2.5, max(waits)


def _changed_build(into: Path) -> Path:
    """This build's package with one change to its SQL code (a function's comment) and none to
    its tables: what a code-only commit ships."""
    shutil.copytree(ROOT / "pgwork", into / "pgwork", ignore=shutil.ignore_patterns("__pycache__"))
    f = into / "pgwork" / "sql" / "code" / "channel_control.sql"
    text = f.read_text()
    assert "Returns false if it was neither.'" in text
    f.write_text(text.replace("Returns false if it was neither.'", "(A changed build.)'"))
    return into


def _cli(root: Path, dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``pgwork ARGS`` of the build whose package is under ``root``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PGWORK_"))}
    return subprocess.run(
        [sys.executable, "-m", "pgwork", *args],
        env={**env, "PGWORK_DSN": dsn, "PYTHONPATH": str(root)},
        cwd=root,
        capture_output=True,
        text=True,
        timeout=180,
    )


async def _resume_comment(conn: psycopg.AsyncConnection[Any]) -> str:
    got = await rows(
        conn,
        "SELECT obj_description(oid, 'pg_proc') AS c FROM pg_proc WHERE proname = 'resume_channel'",
    )
    return str(got[0]["c"])


async def test_a_code_change_is_applied_by_its_checksum_without_a_schema_version(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any, tmp_path: Path
) -> None:
    """The database learnt of code only through SCHEMA_VERSION, so a change to a function cost
    a version, an empty migration and a snapshot. The code's checksum now stands beside the
    version: a build whose SQL code differs at the same version says to run its migrate, whose
    migrate asks the running daemons to step aside and applies the code; the build it replaced
    then refuses to run or to migrate (its code is older), and a second migrate of the new build
    has nothing to do."""
    new = _changed_build(tmp_path / "new")
    with Receiver() as receiver:
        daemon = procs(dsn, toml(channel=hook(receiver.url)))
        await add(conn, "before", channel="hook")
        await until(lambda: _delivered(conn, 1), what="a delivery by this build")
        r = await anyio.to_thread.run_sync(_cli, new, dsn, "status")
        assert r.returncode == 2 and "run `pgwork migrate`" in r.stderr, r.stderr
        r = await anyio.to_thread.run_sync(_cli, new, dsn, "migrate")
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"applied the changed SQL code at version {SCHEMA_VERSION}" in r.stdout, r.stdout
        assert daemon.wait(30) == 75  # asked to step aside, as for a table change
    assert "(A changed build.)" in await _resume_comment(conn)
    assert (await rows(conn, "SELECT version FROM pgwork.schema_version"))[0]["version"] == (
        SCHEMA_VERSION
    )
    assert _cli(new, dsn, "status").returncode == 0
    r = _cli(ROOT, dsn, "status")
    assert r.returncode == 2 and "newer SQL code" in r.stderr, r.stderr
    r = _cli(ROOT, dsn, "migrate")
    assert r.returncode == 2 and "newer SQL code" in r.stderr, r.stderr
    assert "(A changed build.)" in await _resume_comment(conn)  # not put back by the older build
    r = _cli(new, dsn, "migrate")
    assert r.returncode == 0 and f"already at version {SCHEMA_VERSION}" in r.stdout, r.stdout


async def _delivered(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    got = await rows(
        conn, "SELECT count(*) AS n FROM pgwork.renewal_work WHERE status = 'delivered'"
    )
    return bool(got[0]["n"] >= n)


def _schema_14_code(into: Path) -> Path:
    """pgwork's package as it was at schema 14 (from git), for a daemon of the previous version."""
    r = subprocess.run(
        ["git", "-C", str(ROOT), "archive", SCHEMA_14_COMMIT, "pgwork"],
        capture_output=True,
        timeout=60,
    )
    if r.returncode != 0:
        pytest.skip(f"no git history with {SCHEMA_14_COMMIT} here: {r.stderr.decode()[:200]}")
    with tarfile.open(fileobj=BytesIO(r.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


async def _database_at_14(empty_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as c:
        await c.execute(old_schema(14))
        await c.execute("INSERT INTO pgwork.channel (name, kind) VALUES ('hook', 'webhook')")


def _migrate_cli(dsn: str, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PGWORK_"))}
    return subprocess.Popen(
        [sys.executable, "-m", "pgwork", "migrate", *args],
        env={**env, "PGWORK_DSN": dsn, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def test_migrate_names_a_daemon_of_the_previous_version_and_waits_for_it_when_told(
    empty_dsn: str, procs: Any, tmp_path: Path
) -> None:
    """Beside a running daemon of schema 14 (which knows no handshake), `pgwork migrate` refused
    with a bare deadlock after seconds, or succeeded and left that daemon erring for half a
    minute. It now refuses at once naming the daemon (exit 2, one line, nothing changed); with
    --wait it waits until the daemon is stopped, then migrates."""
    old_code = _schema_14_code(tmp_path / "old")
    await _database_at_14(empty_dsn)
    with Receiver() as receiver:
        old = procs(empty_dsn, toml(channel=hook(receiver.url)), env={"PYTHONPATH": str(old_code)})
        r = _migrate_cli(empty_dsn)
        out, err = r.communicate(timeout=60)
        assert r.returncode == 2, out + err
        assert err.count("\n") == 1 and "stop these daemons first" in err, err
        assert f"/{old.proc.pid} (pgwork" in err, err
        async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as c:
            assert (await rows(c, "SELECT version FROM pgwork.schema_version"))[0]["version"] == 14

            waiting = _migrate_cli(empty_dsn, "--wait", "60s")
            await anyio.sleep(1.5)
            assert waiting.poll() is None  # it waits for the old daemon
            old.signal(signal.SIGTERM)
            assert old.wait(30) == 0
            out, err = waiting.communicate(timeout=60)
            assert waiting.returncode == 0, err
            assert f"from version 14 to {SCHEMA_VERSION}" in out, out
            assert "deadlock" not in err
            assert not _errors(old.lines()), _errors(old.lines())


async def test_a_daemon_of_the_new_version_waits_for_the_migration_and_resumes(
    empty_dsn: str, procs: Any
) -> None:
    """Deployed before the migration (a rolling upgrade), a daemon of this version waits on a
    schema-14 database instead of exiting, says why, and delivers once `pgwork migrate` ran."""
    await _database_at_14(empty_dsn)
    with Receiver() as receiver:
        async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as c:
            await add(c, "before", channel="hook")
        new = procs(empty_dsn, toml(channel=hook(receiver.url)), ready=False)
        deadline = time.monotonic() + 20
        while not any("waiting for `pgwork migrate`" in str(e.get("event")) for e in new.lines()):
            assert new.proc.poll() is None, new.log.read_text()[-2000:]
            assert time.monotonic() < deadline, new.log.read_text()[-2000:]
            await anyio.sleep(0.1)
        assert receiver.requests == []
        r = _migrate_cli(empty_dsn)
        _, err = r.communicate(timeout=60)
        assert r.returncode == 0, err
        new.wait_ready()
        got = receiver.wait_for(1)
    assert got[0].key and got[0].body["business_key"] == "before"
    assert not _errors(new.lines()), _errors(new.lines())


async def test_a_request_left_by_a_killed_migrate_is_not_obeyed(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    """A migrate killed between its request and its commit leaves the request standing: daemons
    would wait for it for ever. Its session is gone with it, so the request is nobody's: a daemon
    runs, and the next migrate claims the schema over it."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as gone:
        pid = gone.info.backend_pid
    await conn.execute(
        "UPDATE pgwork.schema_version SET migration_requested_at = now(), "
        "migration_requested_by = 'gone-host/4242', migration_requester = %s",
        (pid,),
    )
    await until(
        lambda: _no_session(conn, pid), what="the killed migrate's session gone from the server"
    )
    with Receiver() as receiver:
        await add(conn, "k", channel="hook")
        daemon = procs(dsn, toml(channel=hook(receiver.url)))
        receiver.wait_for(1)
        assert daemon.proc.poll() is None
    assert not _errors(daemon.lines())
    with anyio.fail_after(10):
        said = await migration.migrate(conn)
    assert said == f"pgwork schema already at version {SCHEMA_VERSION}"
    left = await rows(
        conn, "SELECT migration_requested_at, migration_requester FROM pgwork.schema_version"
    )
    assert left == [{"migration_requested_at": None, "migration_requester": None}]


@pytest.mark.parametrize("step", ["asked", "in transaction"])
@pytest.mark.parametrize("cleared_by", ["a daemon's start", "pgwork migrate"])
async def test_a_killed_migrates_pid_taken_by_another_session_steps_no_daemon_aside(
    step: str, cleared_by: str, dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    """Issue 67: a next-version migrate SIGKILLed after asking the daemons to step aside (or
    inside its transaction) left its request with its session's pid; once an unrelated session
    got that pid (a wrap of pid_max), the daemon's restart waited for a migration nobody ran,
    until that session closed, and a no-op `pgwork migrate` did not clear it. The request names
    its session by pid and application_name now: the daemon starts and delivers at once, and
    the dead request is gone after the daemon's start, or after the next `pgwork migrate`."""
    from .processes import next_migrate, session_with_pid

    with Receiver() as receiver:
        first = procs(dsn, toml(channel=hook(receiver.url)))
        migrate = next_migrate(dsn)
        try:
            query = (
                "SELECT migration_requester AS pid FROM pgwork.schema_version "
                "WHERE migration_requested_at IS NOT NULL"
                if step == "asked"
                else "SELECT pid FROM pg_stat_activity WHERE query LIKE '%pg_sleep%' "
                "AND state = 'active' AND pid <> pg_backend_pid()"
            )

            async def reached() -> bool:
                return bool(await rows(conn, query))

            await until(reached, timeout=30, what=f"the migrate at its step ({step})")
            (got,) = await rows(
                conn, "SELECT migration_requester AS pid FROM pgwork.schema_version"
            )
            pid = got["pid"]
            migrate.send_signal(signal.SIGKILL)
            migrate.wait(10)
        finally:
            migrate.kill()
            migrate.wait(10)
        assert first.wait(30) == 75  # it had stepped aside, for the supervisor to restart it
        await until(lambda: _no_session(conn, pid), what="the killed migrate's session gone")
        stranger = await session_with_pid(dsn, pid)
        if stranger is None:
            pytest.skip("this machine cannot give a new session a chosen pid")
        try:
            left = await rows(conn, "SELECT migration_requested_at FROM pgwork.schema_version")
            assert left[0]["migration_requested_at"] is not None  # it stands, its pid alive
            if cleared_by == "pgwork migrate":
                with anyio.fail_after(10):
                    said = await migration.migrate(conn)
                assert said == f"pgwork schema already at version {SCHEMA_VERSION}"
                assert await _request(conn) == (None, None)
            await add(conn, "after", channel="hook")
            t = time.monotonic()
            again = procs(dsn, toml(channel=hook(receiver.url)))
            await anyio.to_thread.run_sync(receiver.wait_for, 1)
            assert time.monotonic() - t < 10
            assert again.proc.poll() is None
            assert await _request(conn) == (None, None)
            assert not _errors(again.lines())
        finally:
            await stranger.close()


async def _request(conn: psycopg.AsyncConnection[Any]) -> tuple[Any, Any]:
    (got,) = await rows(
        conn, "SELECT migration_requested_at, migration_requester FROM pgwork.schema_version"
    )
    return got["migration_requested_at"], got["migration_requester"]


async def _no_session(conn: psycopg.AsyncConnection[Any], pid: int) -> bool:
    got = await rows(conn, "SELECT count(*) AS n FROM pg_stat_activity WHERE pid = %s", (pid,))
    return bool(got[0]["n"] == 0)


# -- issue 53: only a migration steps a daemon aside, and no app holds a migration up ----------


def _next_step(extra: str = "") -> dict[int, str]:
    """The next schema, a test-only step: a column, and what ``extra`` adds."""
    return {SCHEMA_VERSION + 1: "ALTER TABLE pgwork.reminder ADD COLUMN test_only int;\n" + extra}


async def _a_role(conn: psycopg.AsyncConnection[Any], name: str, dsn: str) -> str:
    """A login role with no pgwork grant at all (any role of the cluster); its DSN."""
    from psycopg.conninfo import make_conninfo

    await conn.execute(f"DROP ROLE IF EXISTS {name}")
    await conn.execute(f"CREATE ROLE {name} LOGIN")
    return make_conninfo(dsn, user=name)


async def test_a_notification_from_any_role_does_not_step_a_daemon_aside(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    """`NOTIFY pgwork_migrate` is open to every role of the cluster: one from a role with no
    pgwork grant made the daemon step aside and exit 75 with no migration asked for. A daemon
    now steps aside only for a request that stands in a row only the schema's owner can write;
    the notification only makes it look."""
    stranger = await _a_role(conn, "no_grant_stranger", dsn)
    try:
        with Receiver() as receiver:
            daemon = procs(dsn, toml(channel=hook(receiver.url)))
            async with await psycopg.AsyncConnection.connect(stranger, autocommit=True) as s:
                for _ in range(3):
                    await s.execute("NOTIFY pgwork_migrate, 'evil-host/1'")
                    await anyio.sleep(0.5)
            await add(conn, "after", channel="hook")
            got = receiver.wait_for(1)
            assert got[0].body["business_key"] == "after"
            assert daemon.proc.poll() is None, daemon.log.read_text()[-2000:]
        assert not [e for e in daemon.lines() if "stepping aside" in str(e.get("event"))]
    finally:
        await conn.execute("DROP ROLE IF EXISTS no_grant_stranger")


async def test_an_app_holding_the_old_advisory_keys_holds_no_migration_up(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    """Migrate's locks were public advisory keys: an app session holding
    hashtext('pgwork.migrate') made it step the daemons aside, then fail after 30 s naming no
    one; holding the other, it waited silently. Its locks are now owned by the schema (a table
    lock only its owner may take): the keys an app holds are nobody's business, and the
    migration runs at once, the daemon stepping aside for it."""
    stranger = await _a_role(conn, "key_holder", dsn)
    try:
        with Receiver() as receiver:
            daemon = procs(dsn, toml(channel=hook(receiver.url)))
            async with await psycopg.AsyncConnection.connect(stranger, autocommit=True) as s:
                await s.execute(
                    "SELECT pg_advisory_lock(hashtext('pgwork.migrate')), "
                    "pg_advisory_lock(hashtext('pgwork.migration_request'))"
                )
                with anyio.fail_after(25):
                    said = await migration.migrate(
                        conn, version=SCHEMA_VERSION + 1, steps=_next_step(), step_aside_within=20
                    )
            assert said == (
                f"upgraded pgwork schema from version {SCHEMA_VERSION} to {SCHEMA_VERSION + 1}"
            )
            assert daemon.wait(30) == 75
    finally:
        await conn.execute("DROP ROLE IF EXISTS key_holder")


async def test_two_migrates_at_once_serialise_and_the_second_finds_nothing_to_do(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Two `pgwork migrate` at once, the step building an index concurrently: the second waited
    for the first's request lock inside a statement, whose snapshot the first's CREATE INDEX
    CONCURRENTLY waited for: "deadlock detected", the committed migration tried again five times.
    Now the second waits holding no snapshot, reads the version once the first is done, finds
    nothing to do, and asks no daemon to step aside."""
    from psycopg.conninfo import make_conninfo

    steps = _next_step(
        "SELECT pg_sleep(1.5);\n"
        "-- pgwork: concurrently\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS test_only_idx ON pgwork.reminder (test_only);\n"
    )
    told: list[str] = []
    said: dict[str, str] = {}

    async def one(name: str, delay: float) -> None:
        await anyio.sleep(delay)
        async with await db.connect(make_conninfo(dsn)) as c:
            await c.set_autocommit(True)
            said[name] = await migration.migrate(c, version=SCHEMA_VERSION + 1, steps=steps)

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as listen:
        await listen.execute("LISTEN pgwork_migrate")
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "first", 0.0)
                tg.start_soon(one, "second", 0.5)
        async for n in listen.notifies(timeout=0.5):
            told.append(n.payload)
    assert said["first"] == (
        f"upgraded pgwork schema from version {SCHEMA_VERSION} to {SCHEMA_VERSION + 1}"
    )
    assert said["second"] == f"pgwork schema already at version {SCHEMA_VERSION + 1}"
    assert len(told) == 1, told  # the first asked; the second asked nobody
    valid = await rows(
        conn, "SELECT indisvalid FROM pg_index WHERE indexrelid = 'pgwork.test_only_idx'::regclass"
    )
    assert valid == [{"indisvalid": True}]


#: The first commit of schema 14, whose materialise_page had a signature the version did not keep.
FIRST_SCHEMA_14_COMMIT = "d7e7eec"


async def test_a_database_installed_by_the_first_schema_14_commit_upgrades(
    empty_dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Installed by d7e7eec's schema.sql, with a reminder: `pgwork migrate` failed on every
    attempt ('function name "pgwork.materialise_page" is not unique', exit 3). Now it upgrades to
    what a fresh install has, and the reminder is kept."""
    from .test_schema import assert_upgrade_equals_a_fresh_install

    r = await anyio.run_process(
        ["git", "-C", str(ROOT), "show", f"{FIRST_SCHEMA_14_COMMIT}:schema.sql"], check=False
    )
    if r.returncode != 0:
        pytest.skip(f"no git history with {FIRST_SCHEMA_14_COMMIT} here: {r.stderr[:200]!r}")
    await assert_upgrade_equals_a_fresh_install(r.stdout.decode(), 14, empty_dsn, conn)


#: Work rows of schema 22 in every state, as its statements left them (one reminder each, made
#: already: next_fire_at 'infinity'). Lease numbers: the killed daemon's claim is the second.
STATES_22 = {
    "due": "status = 'ready', available_at = now() - interval '1 minute'",
    "later": "status = 'ready', available_at = now() + interval '1 hour'",
    "killed": "status = 'claimed', lease = 2, attempts = 2, claimed_by = 'gone', "
    "claimed_at = now() - interval '2 minutes', available_at = now() - interval '1 second'",
    "held": "status = 'claimed', lease = 1, attempts = 1, claimed_by = 'aside', "
    "claimed_at = now(), available_at = now() + interval '1 hour'",
    "retrying": "status = 'ready', lease = 1, attempts = 1, available_at = now() - interval '1 second'",
    "dead": "status = 'dead', lease = 3, attempts = 3, finished_at = now(), dead_reason = 'x'",
    "superseded": "status = 'superseded', finished_at = now()",
    "delivered": "status = 'delivered', lease = 1, attempts = 1, finished_at = now()",
}


async def test_schema_22_with_work_in_every_state_migrates_and_each_is_sent_once(
    empty_dsn: str,
) -> None:
    """Schema 23 moves the queue beside the record (pgwork.work_ready, pgwork.work_lease). From
    a schema-22 database with work in every state: the live rows are queued, a claimed one keeps
    its lease number (the outcome of the daemon that stepped aside with it is applied; one
    under a reclaimed lease is fenced), the invariant holds, and the drain sends each due
    occurrence once."""
    from pgwork.duties.outcomes import Record

    from .helpers import config, running, statement, webhook_channel

    snapshot = old_schema(22)
    async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as c:
        await c.execute(snapshot)
        await c.execute("INSERT INTO pgwork.channel (name, kind) VALUES ('hook', 'webhook')")
        for key, state in STATES_22.items():
            due = "now() + interval '1 hour'" if key == "later" else "now() - interval '1 minute'"
            await add(c, key, due, channel="hook")
            await c.execute(
                "INSERT INTO pgwork.renewal_work (reminder_id, source, business_key, deadline, "
                "occurrence, due_at, channel, operation_id, available_at) "
                "SELECT r.id, r.source, r.business_key, r.due_at, '0', r.due_at, r.channel, "
                "pgwork.operation_id(r.id, r.source, r.business_key, r.due_at, '0'), now() "
                "FROM pgwork.reminder r WHERE r.business_key = %s",
                (key,),
            )
            await c.execute(
                f"UPDATE pgwork.renewal_work SET {state} WHERE business_key = %s",
                (key,),
            )
        await c.execute("UPDATE pgwork.reminder SET next_fire_at = 'infinity'")
        said = await migration.migrate(c)
        assert said == f"upgraded pgwork schema from version 22 to {SCHEMA_VERSION}"
        assert await rows(c, "SELECT * FROM pgwork.work_invariant()") == []
        queued = await rows(
            c,
            "SELECT w.business_key, l.lease, w.lease AS settled, q.work_id IS NOT NULL AS ready "
            "FROM pgwork.renewal_work w LEFT JOIN pgwork.work_lease l ON l.work_id = w.id "
            "LEFT JOIN pgwork.work_ready q ON q.work_id = w.id ORDER BY w.business_key",
        )
        assert {r["business_key"]: (r["lease"], r["settled"], r["ready"]) for r in queued} == {
            "dead": (None, 3, False),
            "delivered": (None, 1, False),
            "due": (None, 0, True),
            "held": (1, 0, False),
            "killed": (2, 1, False),
            "later": (None, 0, True),
            "retrying": (None, 1, True),
            "superseded": (None, 0, False),
        }
        ids = {
            r["business_key"]: r["id"]
            for r in await rows(c, "SELECT id, business_key FROM pgwork.renewal_work")
        }

        async def outcome(key: str, lease: int) -> list[dict[str, Any]]:
            rec = Record(ids[key], lease, lease, "hook", "delivered", "delivered", None, 0.0, 0.0)
            return await statement(
                c,
                "record_outcomes",
                {
                    "outcomes": f"[{rec.json_text(0.0)}]",
                    "daemon_id": "aside",
                    "host": "h",
                    "pid": 1,
                },
            )

        # The daemon that stepped aside holding "held" reports it: applied under its lease.
        assert await outcome("held", 1) == []
        with Receiver() as receiver:
            async with running(config(webhook_channel(receiver.url)), empty_dsn):
                await until(lambda: _sent(receiver, 3), what="the due rows sent")
            keys = receiver.keys()
        # "killed" was claimed again (lease 3): the killed daemon's late answer is fenced.
        assert [f["fenced_id"] for f in await outcome("killed", 2)] == [ids["killed"]]
        final = await rows(
            c,
            "SELECT w.business_key, w.status, w.lease FROM pgwork.renewal_work w ORDER BY 1",
        )
        assert await rows(c, "SELECT * FROM pgwork.work_invariant()") == []
        ledger = await rows(
            c,
            "SELECT w.business_key, a.lease, a.outcome FROM pgwork.attempt a "
            "JOIN pgwork.renewal_work w ON w.id = a.work_id ORDER BY 1, 2",
        )
    assert sorted(keys.values()) == [1, 1, 1]  # due, killed, retrying: each sent once
    assert {r["business_key"]: (r["status"], r["lease"]) for r in final} == {
        "dead": ("dead", 3),
        "delivered": ("delivered", 1),
        "due": ("delivered", 1),
        "held": ("delivered", 1),
        "killed": ("delivered", 3),
        "later": ("ready", 0),
        "retrying": ("delivered", 2),
        "superseded": ("superseded", 0),
    }
    assert [
        (x["business_key"], x["lease"], x["outcome"])
        for x in ledger
        if x["business_key"] == "killed"
    ] == [
        ("killed", 2, "fenced"),
        ("killed", 3, "delivered"),
    ]


async def _sent(receiver: Receiver, n: int) -> bool:
    return sum(receiver.keys().values()) >= n
