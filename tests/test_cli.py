"""The `pgwork` command as an operator uses it: real processes, exit codes, one-line errors."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

from pgwork import SCHEMA_VERSION, __version__, build, db

from .helpers import add, add_in_an_unknown_zone, claim, materialise, rows, sync_queue, until

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parent.parent


def pgwork(
    *args: str, dsn: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PGWORK_"))}
    if dsn is not None:
        e["PGWORK_DSN"] = dsn
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pgwork", *args],
        capture_output=True,
        text=True,
        env=e,
        cwd=ROOT,
        timeout=60,
    )


def test_version_and_help_for_every_command() -> None:
    assert pgwork("--version").stdout.strip() == f"pgwork {__version__}+{build.digest()}"
    for cmd in (
        ["run"],
        ["migrate"],
        ["psql"],
        ["status"],
        ["dlq"],
        ["dlq", "list"],
        ["dlq", "show"],
        ["dlq", "redrive"],
        ["dlq", "retrying"],
        ["reminder"],
        ["channel"],
        ["channel", "list"],
        ["channel", "pause"],
        ["channel", "resume"],
        ["web"],
    ):
        r = pgwork(*cmd, "--help")
        assert r.returncode == 0 and "usage: pgwork" in r.stdout, cmd


def test_wrong_flag_is_one_line() -> None:
    r = pgwork("status", "--colour")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "unrecognized arguments: --colour" in r.stderr


def test_wrong_config_value_is_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[worker]\nlease = "long"\n')
    r = pgwork("--config", str(cfg), "status", dsn="host=127.0.0.1 port=1")
    assert r.returncode == 2
    assert (
        r.stderr.strip() == "pgwork: configuration error: worker.lease: not a duration: 'long' "
        "(write e.g. '250ms', '5s', '10m', '1h', '2d') (got 'long')"
    )


def test_unreachable_database_is_one_line_without_password() -> None:
    r = pgwork("status", dsn="postgresql://app:hunter2@127.0.0.1:1/db")
    assert r.returncode == 3
    assert (
        r.stderr.count("\n") == 1
        and "cannot connect to the database (app@127.0.0.1:1/db)" in r.stderr
    )
    assert "hunter2" not in r.stderr + r.stdout


async def test_migrate_then_run_refusals(empty_dsn: str) -> None:
    r = pgwork("run", dsn=empty_dsn)
    assert (r.returncode, r.stderr.strip()) == (
        2,
        "pgwork: this database has no pgwork schema: run `pgwork migrate` first",
    )
    assert (
        f"installed pgwork schema version {SCHEMA_VERSION}"
        in pgwork("migrate", dsn=empty_dsn).stdout
    )
    assert f"already at version {SCHEMA_VERSION}" in pgwork("migrate", dsn=empty_dsn).stdout
    async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as c:
        await c.execute("UPDATE pgwork.schema_version SET version = 99")
    r = pgwork("run", dsn=empty_dsn)
    assert r.returncode == 2 and "newer than this pgwork" in r.stderr
    r = pgwork("migrate", dsn=empty_dsn)
    assert r.returncode == 2 and "refusing to touch it" in r.stderr


async def test_migrate_registers_the_configured_channels(empty_dsn: str, tmp_path: Path) -> None:
    """Apps can schedule for a channel as soon as `pgwork migrate` has run with the daemons'
    config, before any daemon starts; without a config, no demo channel is registered."""
    insert = (
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "VALUES ('app', 'k', now() + interval '1 day', 'billing', 'r')"
    )
    r = pgwork("migrate", dsn=empty_dsn)
    assert r.returncode == 0 and "registered" not in r.stdout
    async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as c:
        with pytest.raises(psycopg.errors.ForeignKeyViolation):
            await c.execute(insert)
    cfg = tmp_path / "pgwork.toml"
    cfg.write_text('[channels.billing]\nkind = "log"\nrate_limit = "5/s"\n')
    r = pgwork("--config", str(cfg), "migrate", dsn=empty_dsn)
    assert r.returncode == 0, r.stderr
    assert "channels registered: billing" in r.stdout
    async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as c:
        await c.execute(insert)
        got = await rows(c, "SELECT name, kind, rate_limit FROM pgwork.channel ORDER BY name")
    assert got == [{"name": "billing", "kind": "log", "rate_limit": 5.0}]


async def test_status_and_dlq_commands(dsn: str, conn: psycopg.AsyncConnection[Any]) -> None:
    await add(conn, "dead-one", "now() - interval '1 hour'", channel="log")
    await add(conn, "waiting", "now() - interval '1 minute'", channel="log")
    await materialise(dsn)
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'dead', finished_at = now(), attempts = 3, lease = 3, "
        "dead_reason = 'permanent failure: HTTP 400' WHERE business_key = 'dead-one'"
    )
    await sync_queue(conn)
    st = pgwork("status", "--json", dsn=dsn)
    assert st.returncode == 0, st.stderr
    doc = json.loads(st.stdout)
    assert doc["dead_letters"] == 1 and doc["lag"]["lag_seconds"] >= 60
    assert pgwork("status", "--max-lag", "10s", dsn=dsn).returncode == 1
    assert pgwork("status", "--max-lag", "1d", dsn=dsn).returncode == 0
    assert "lag:" in pgwork("status", dsn=dsn).stdout

    listed = json.loads(pgwork("dlq", "list", "--json", dsn=dsn).stdout)
    assert [x["business_key"] for x in listed] == ["dead-one"]
    assert json.loads(pgwork("dlq", "list", "--json", "--channel", "test", dsn=dsn).stdout) == []
    wid = listed[0]["id"]
    shown = json.loads(pgwork("dlq", "show", str(wid), "--json", dsn=dsn).stdout)
    assert shown["work"]["dead_reason"] == "permanent failure: HTTP 400"
    assert pgwork("dlq", "show", "999999", dsn=dsn).returncode == 1

    waiting = (
        await rows(conn, "SELECT id FROM pgwork.renewal_work WHERE business_key = 'waiting'")
    )[0]["id"]
    r = pgwork("dlq", "redrive", str(waiting), dsn=dsn)
    assert r.returncode == 1 and f"work {waiting} is not a dead letter" in r.stderr
    r = pgwork("dlq", "redrive", str(wid), dsn=dsn)
    assert r.returncode == 0 and "redrove 1 dead letter:" in r.stdout
    (w,) = await rows(
        conn,
        "SELECT status, attempts_base, redriven_by FROM pgwork.renewal_work WHERE id = %s",
        (wid,),
    )
    assert (w["status"], w["attempts_base"]) == ("ready", 3) and "@" in w["redriven_by"]
    assert pgwork("dlq", "redrive", dsn=dsn).returncode == 2


async def test_psql_passes_its_arguments(dsn: str, conn: psycopg.AsyncConnection[Any]) -> None:
    await add(conn, "k", channel="log")
    r = pgwork("psql", "-X", "-A", "-t", "-c", "SELECT business_key FROM pgwork.reminder", dsn=dsn)
    assert (r.returncode, r.stdout.strip()) == (0, "k"), r.stderr


async def test_psql_gets_its_arguments_in_the_order_given(tmp_path: Path, dsn: str) -> None:
    """Options after the query went first (`-c "SELECT 1" -At` ran `-At` as SQL), and
    `-v ON_ERROR_STOP=1 -f q.sql` ran nothing and exited 0."""
    r = pgwork("psql", "-X", "-c", "SELECT 1", "-At", dsn=dsn)
    assert (r.returncode, r.stdout.strip()) == (0, "1"), r.stdout + r.stderr
    q = tmp_path / "q.sql"
    q.write_text("SELECT 40 + 2;\nSELECT nonsense;\n")
    r = pgwork(
        "--config", "/dev/null", "psql", "-X", "-v", "ON_ERROR_STOP=1", "-At", "-f", str(q), dsn=dsn
    )
    assert r.returncode == 3 and r.stdout.strip() == "42", r.stdout + r.stderr
    assert "nonsense" in r.stderr


async def test_psql_connects_as_the_user_and_to_the_database_asked_for(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """`pgwork psql -U billing` ran as the configured user (on the embedded server a superuser:
    an operator checking what an app may do saw everything), and `-d postgres` took the
    configured connection string for a user name, dropping its host. Both now go into the
    connection string, in each of psql's spellings; the rest of the configuration stays."""
    await conn.execute("DROP ROLE IF EXISTS psql_probe")
    await conn.execute("CREATE ROLE psql_probe LOGIN")
    try:
        query = "SELECT current_user || ' ' || current_database()"
        db = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
        for args in (["-U", "psql_probe"], ["-Upsql_probe"], ["--username=psql_probe"]):
            r = pgwork("psql", *args, "-XAtc", query, dsn=dsn)
            assert (r.returncode, r.stdout.strip()) == (0, f"psql_probe {db}"), (args, r.stderr)
        for args in (
            ["-d", "postgres"],
            ["--dbname", "postgres"],
            ["-U", "psql_probe", "-d", "postgres"],
        ):
            r = pgwork("psql", *args, "-XAtc", query, dsn=dsn)
            who = "psql_probe" if "-U" in args else "postgres"
            assert (r.returncode, r.stdout.strip()) == (0, f"{who} postgres"), (args, r.stderr)
    finally:
        await conn.execute("DROP ROLE psql_probe")


def test_a_reader_that_goes_away_early_gets_no_traceback(dsn: str) -> None:
    """`pgwork status | head -1`: the reader closes the pipe before status has printed all.
    That printed a BrokenPipeError traceback (3 runs of 6); it is a quiet end, as for any
    command line tool."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PGWORK_"))}
    for _ in range(3):
        p = subprocess.Popen(
            [sys.executable, "-m", "pgwork", "status"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**e, "PGWORK_DSN": dsn},
            cwd=ROOT,
        )
        assert p.stdout is not None and p.stderr is not None
        p.stdout.close()  # gone before the first line
        err = p.stderr.read().decode()
        p.wait(60)
        assert "Traceback" not in err and "BrokenPipe" not in err, err


async def test_redrive_says_which_ids_do_not_exist_and_which_are_not_dead(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """`pgwork dlq redrive 99999` said "is not a dead letter" of a row that does not exist."""
    await add(conn, "k")
    await materialise(dsn)
    (w,) = await rows(conn, "SELECT id FROM pgwork.renewal_work")
    r = pgwork("dlq", "redrive", "99999", str(w["id"]), dsn=dsn)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "work 99999 does not exist" in r.stderr, r.stderr
    assert f"work {w['id']} is not a dead letter (it is ready)" in r.stderr, r.stderr


async def test_what_waits_for_a_retry_and_when_is_shown(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """channels.md sends operators to `dlq show` for `retry_at`, which it never showed, and no
    command listed the rows waiting for a retry."""
    await add(conn, "k")
    await materialise(dsn)
    (w,) = await claim(dsn)
    await conn.execute(
        "INSERT INTO pgwork.attempt (work_id, lease, attempt, daemon_id, host, pid, started_at, "
        "finished_at, outcome, error, retry_at) VALUES (%s, %s, 1, 'd', 'h', 1, now(), now(), "
        "'retry', 'HTTP 503', '2030-01-01 00:00+00')",
        (w["id"], w["lease"]),
    )
    await conn.execute("DELETE FROM pgwork.work_lease WHERE work_id = %s", (w["id"],))
    await conn.execute(  # what the outcome of that attempt writes
        "UPDATE pgwork.renewal_work SET status = 'ready', available_at = '2030-01-01 00:00+00', "
        "lease = %s, attempts = %s, last_error = 'HTTP 503' WHERE id = %s",
        (w["lease"], w["attempts"], w["id"]),
    )
    await sync_queue(conn)
    shown = pgwork("dlq", "show", str(w["id"]), dsn=dsn)
    assert shown.returncode == 0, shown.stderr
    assert "retry_at" in shown.stdout and "2030-01-01" in shown.stdout, shown.stdout
    waiting = pgwork("dlq", "retrying", dsn=dsn)
    assert waiting.returncode == 0, waiting.stderr
    assert str(w["id"]) in waiting.stdout and "2030-01-01" in waiting.stdout, waiting.stdout
    assert "HTTP 503" in waiting.stdout
    js = json.loads(pgwork("dlq", "retrying", "--json", dsn=dsn).stdout)
    assert [r["id"] for r in js] == [w["id"]] and js[0]["attempts"] == 1


def test_only_run_needs_the_channels_secrets(tmp_path: Path, dsn: str) -> None:
    """The README's production `migrate` line failed with the README's own config
    (`CRM_SIGNING_SECRET is not set`): every command read every channel's secrets, though only
    sending needs them."""
    cfg = tmp_path / "pgwork.toml"
    cfg.write_text(
        '[channels.crm]\nkind = "webhook"\nurl = "https://crm.internal/hooks/reminders"\n'
        'signing_secret = "env:CRM_SIGNING_SECRET"\nheaders = { Authorization = "env:CRM_TOKEN" }\n'
    )
    for args in (["migrate"], ["status"], ["channel", "list"], ["dlq", "list"]):
        r = pgwork("--config", str(cfg), *args, dsn=dsn)
        assert r.returncode == 0, (args, r.stderr)
    r = pgwork("--config", str(cfg), "run", dsn=dsn)
    assert r.returncode == 2 and "environment variable CRM_TOKEN is not set" in r.stderr, r.stderr


async def test_run_refuses_a_schema_whose_outcome_record_disagrees(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A daemon whose outcome records carry a key pgwork.outcome does not declare (a type
    changed by hand, or code and schema files out of step) would have every throttle or error
    it sends dropped to NULL by record_outcomes: it does not start, naming the difference."""
    await conn.execute("ALTER TYPE pgwork.outcome RENAME ATTRIBUTE throttle TO throttle_s")
    r = pgwork("run", dsn=dsn)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "pgwork.outcome declares throttle_s and not throttle" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize(("part", "said"), [("dbname", "database"), ("user", "role")])
def test_run_fails_fast_when_the_database_says_no_for_good(dsn: str, part: str, said: str) -> None:
    """A DSN naming a database (or role) that does not exist made `pgwork run` retry for ever
    (under systemd: until TimeoutStartSec). The server's answer will not change: exit 3, one line."""
    wrong = psycopg.conninfo.make_conninfo(dsn, **{part: "nosuch"})
    r = pgwork("run", dsn=wrong)
    assert r.returncode == 3, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pgwork: ") and f'{said} "nosuch" does not exist' in last, last


@pytest.fixture
def password_server(tmp_path: Path) -> Any:
    """A server of its own that asks role ``app`` for its password (scram-sha-256), with the
    pgwork schema; yields a DSN for ``app`` without a password."""
    from pgwork.embedded import LocalServer

    root = tmp_path / "pw"
    root.mkdir()
    root.chmod(0o755)
    hba = root / "pg_hba.conf"
    hba.write_text(
        "host all postgres 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
    )
    hba.chmod(0o644)
    server = LocalServer(root / "data", settings={"hba_file": str(hba), "fsync": "off"})
    try:
        server.start()
        with psycopg.connect(server.dsn(), autocommit=True) as c:
            c.execute("CREATE ROLE app LOGIN PASSWORD 'secret' SUPERUSER")
        yield psycopg.conninfo.make_conninfo(server.dsn(), user="app")
    finally:
        server.destroy()


@pytest.mark.parametrize("cmd", [["run"], ["status"]])
def test_a_missing_password_fails_fast_and_says_where_it_should_come_from(
    password_server: str, cmd: list[str], tmp_path: Path
) -> None:
    """Issue 68: a DSN without the password the server asks for (an env file without it, a
    .pgpass the service's user cannot read) made `pgwork run` retry for ever as "database
    unreachable" (under systemd: until TimeoutStartSec), while `pgwork status` exited 3 at
    once. The server's answer will not change: both exit 3 with one line that says where a
    password comes from."""
    r = pgwork(*cmd, dsn=password_server, env={"PGPASSFILE": str(tmp_path / "none")})
    assert r.returncode == 3, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pgwork: ") and "no password supplied" in last, last
    assert "PGPASSWORD" in last and ".pgpass" in last, last
    assert "retrying" not in r.stderr


@pytest.mark.parametrize("mode", ["require", "verify-full"])
def test_run_fails_fast_when_tls_is_required_of_a_server_without_it(dsn: str, mode: str) -> None:
    """`sslmode=require` (the shipped env file says verify-full) against a server without TLS:
    `pgwork run` retried for ever while `pgwork status` failed at once. Nothing a retry changes
    (the server's configuration or the DSN must): exit 3, one line naming it."""
    r = pgwork("run", dsn=psycopg.conninfo.make_conninfo(dsn, sslmode=mode))
    assert r.returncode == 3, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pgwork: ") and "server does not support SSL" in last, last


@pytest.mark.parametrize("args", [["status"], ["psql", "-c", "SELECT 1"], ["dlq", "list"]])
def test_a_command_outside_a_project_makes_no_empty_cluster(
    tmp_path: Path, args: list[str]
) -> None:
    """Run outside the project (no PGWORK_DSN, no embedded server's data here), `pgwork status`
    ran initdb for a new, empty cluster in ./.pgwork/pgdata and then said "no pgwork schema: run
    `pgwork migrate`", the wrong fix. It says what it looked for and how to point at a database,
    and makes nothing; only `pgwork run` makes the embedded server's data."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PGWORK_"))}
    r = subprocess.run(
        [sys.executable, "-m", "pgwork", *args],
        capture_output=True, text=True, env=e, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no database: PGWORK_DSN" in r.stderr and str(tmp_path) in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1
    assert not (tmp_path / ".pgwork").exists()


async def test_cleanup_with_only_its_retention_dsn_touches_no_other_database(
    tmp_path: Path, dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The cleanup timer's environment holds PGWORK_RETENTION_DSN alone (operations.md): the
    command started an embedded server in its working directory all the same. Off a terminal
    it said its pass twice, as the duty's log line and as its summary (issue 68): once now."""
    from .test_retention import seed

    await seed(conn, 3, "delivered", "40 days")
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PGWORK_"))}
    r = await anyio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "pgwork", "cleanup", "--once"],
        capture_output=True, text=True, env={**e, "PGWORK_RETENTION_DSN": dsn}, cwd=tmp_path,
        timeout=60,
    ))  # fmt: skip
    assert r.returncode == 0 and "deleted 3 work rows" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / ".pgwork").exists()
    # Off a terminal its logs are JSON lines, and so is its summary: one format for a journal.
    lines = [json.loads(line) for line in (r.stdout + r.stderr).splitlines()]
    (summary,) = [d for d in lines if "deleted" in d["event"]]
    assert summary["deleted"] == 3 and summary["level"] == "info", lines


# -- issue 9, item 17: every mistake is one line and exit 2 -----------------------------------


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        ("dir", ["status"], "config file {p} cannot be read: Is a directory"),
        ("latin1", ["status"], "config file {p} is not UTF-8 text"),
        (
            '[database]\nembedded_dir = "{t}/afile/sub"\n',
            ["run"],
            "database.embedded_dir: cannot use '{t}/afile/sub' for the embedded server's data",
        ),
        ('[metrics]\nlisten = "127.0.0.1:99999"\n', ["run"], "metrics.listen: expected HOST:PORT"),
        (
            '[metrics]\nlisten = "127.0.0.1:9470-9460"\n',
            ["run"],
            "metrics.listen: expected HOST:PORT",
        ),
        ('[web]\ntoken = "short"\n', ["web"], "web.token: at least 16 characters"),
        ('[web]\nlisten = "localhost"\n', ["web"], "web.listen: expected HOST:PORT"),
        ('[channels.h]\nkind = "webhook"\nurl = "http://"\n', ["status"], "the URL has no host"),
        (
            '[channels.h]\nkind = "webhook"\nurl = "https://[::1"\n',
            ["status"],
            "channels.h.url: not a valid URL",
        ),
        (
            '[channels.h]\nkind = "webhook"\nurl = "http://exa mple.com/"\n',
            ["status"],
            "channels.h.url: the URL has a space",
        ),
        ("", ["dlq", "list", "--limit", "-1"], "argument --limit: must be between 1 and 1000000"),
        ("", ["dlq", "redrive", str(2**70)], "argument ids: not a work id"),
        ("", ["dlq", "show", "x"], "argument id: not a work id"),
    ],
)
def test_config_and_usage_mistakes_are_one_line_and_exit_2(
    tmp_path: Path, setup: str, args: list[str], message: str
) -> None:
    p = tmp_path / "c.toml"
    (tmp_path / "afile").write_text("x")
    if setup == "dir":
        p.mkdir()
    elif setup == "latin1":
        p.write_bytes(b'[log]\nlevel = "d\xe9bug"\n')
    else:
        p.write_text(setup.format(t=tmp_path))
    r = pgwork(
        "--config", str(p), *args, dsn="host=127.0.0.1 port=1" if "dir" not in setup else None
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert message.format(p=p, t=tmp_path) in r.stderr


async def test_status_names_a_session_that_locks_pgwork_out(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """An app holding LOCK TABLE pgwork.reminder stops claims and the materialiser (a claim reads
    the reminder: its recipient, its payload, whether it was cancelled). `pgwork status` must not
    wait behind it too: it answers within its lock timeout, naming the session (pid, application,
    for how long), and says what it could not read."""
    await add(conn, "k")
    async with await psycopg.AsyncConnection.connect(
        psycopg.conninfo.make_conninfo(dsn, application_name="billing-migration")
    ) as app:
        await app.execute("LOCK TABLE pgwork.reminder IN ACCESS EXCLUSIVE MODE")
        pid = app.info.backend_pid
        text = pgwork("status", dsn=dsn)
        js = pgwork("status", "--json", dsn=dsn)
        await app.rollback()
    assert text.returncode == 4, text.stderr
    assert f"pid {pid}" in text.stdout and "billing-migration" in text.stdout, text.stdout
    assert "AccessExclusiveLock on pgwork.reminder" in text.stdout, text.stdout
    assert js.returncode == 4, js.stderr
    (holder,) = json.loads(js.stdout)["lock_holders"]
    assert (holder["pid"], holder["application_name"], holder["relation"]) == (
        pid,
        "billing-migration",
        "pgwork.reminder",
    )
    assert holder["held_s"] >= 0
    # Released: status reads everything again, and names no one.
    again = pgwork("status", "--json", dsn=dsn)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["lock_holders"] == []


async def test_status_names_a_session_whose_row_lock_a_pgwork_session_waits_on(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A row lock stops the daemon as surely as a table lock (a flush waiting for a work row an
    operator's psql holds FOR UPDATE): `pgwork status` names the session the daemon waits on
    (pg_blocking_pids), not only holders of table locks. It exited 0 and named nobody."""
    await add(conn, "k")
    await materialise(dsn)
    async with (
        await psycopg.AsyncConnection.connect(
            psycopg.conninfo.make_conninfo(dsn, application_name="ops-psql")
        ) as holder,
        await db.connect(dsn) as daemon,
    ):
        await holder.execute("SELECT 1 FROM pgwork.renewal_work FOR UPDATE")
        pid = holder.info.backend_pid
        await daemon.execute("SET lock_timeout = '60s'")  # it waits while status runs
        waiting = await daemon.execute("SELECT pg_backend_pid()")
        daemon_pid = (await waiting.fetchone() or (0,))[0]
        async with anyio.create_task_group() as tg:

            async def flush_like() -> None:
                with contextlib.suppress(psycopg.Error):
                    await daemon.execute(
                        "UPDATE pgwork.renewal_work SET attempts = attempts WHERE true"
                    )

            tg.start_soon(flush_like)

            async def waits() -> bool:
                got = await rows(
                    conn, "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
                    (daemon_pid,),
                )  # fmt: skip
                return bool(got)

            await until(waits, what="the pgwork session to wait on the row lock")
            text = await anyio.to_thread.run_sync(lambda: pgwork("status", dsn=dsn))
            js = await anyio.to_thread.run_sync(lambda: pgwork("status", "--json", dsn=dsn))
            await holder.rollback()
    assert text.returncode == 4, text.stdout + text.stderr
    assert f"pid {pid}" in text.stdout and "ops-psql" in text.stdout, text.stdout
    assert f"pgwork session {daemon_pid} waits" in text.stdout, text.stdout
    (named,) = json.loads(js.stdout)["lock_holders"]
    assert (named["pid"], named["application_name"]) == (pid, "ops-psql")
    assert "pgwork.renewal_work" in named["relation"]


def test_status_with_nothing_kept_says_so(dsn: str) -> None:
    r = pgwork("status", dsn=dsn)
    assert r.returncode == 0, r.stderr
    assert "oldest kept -s" not in r.stdout
    assert "nothing kept" in r.stdout, r.stdout


@pytest.mark.parametrize("how", ["on PATH", "by its path", "python -m"])
def test_the_welcome_names_a_psql_command_that_exists(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pip-installed `pgwork run` once told the user to run `make psql` or
    `.venv/bin/pgwork psql`, neither of which exists outside a checkout: the welcome names the
    command this pgwork was started as."""
    from types import SimpleNamespace

    from pgwork.cli import run

    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    exe = bin_dir / "pgwork"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    if how == "on PATH":
        monkeypatch.setattr(sys, "argv", [str(exe), "run"])
        monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
        expected = "`pgwork psql`"
    elif how == "by its path":
        monkeypatch.setattr(sys, "argv", [str(exe), "run"])
        monkeypatch.setenv("PATH", "/usr/bin:/bin")
        expected = f"`{exe} psql`"
    else:
        monkeypatch.setattr(sys, "argv", [str(ROOT / "pgwork" / "__main__.py"), "run"])
        expected = f"`{sys.executable} -m pgwork psql`"
    server = SimpleNamespace(port=5432, data_dir=tmp_path / "data")
    run._print_welcome(SimpleNamespace(server=server))  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert expected in err, err
    assert "make psql" not in err and ".venv/bin/pgwork" not in err


def test_the_welcome_suggests_a_channel_the_daemon_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The welcome suggested an INSERT on the `log` channel even when the config had none (a
    foreign-key error on the first paste): it names a channel this daemon runs."""
    from types import SimpleNamespace

    from pgwork.cli import run
    from pgwork.config import load

    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('[channels.crm]\nkind = "webhook"\nurl = "http://127.0.0.1:9/hook"\n')
    server = SimpleNamespace(port=5432, data_dir=tmp_path / "data")
    run._print_welcome(SimpleNamespace(server=server), load(cfg_file, env={}))  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert "'crm', 'tenant@example.com'" in err and "'log'" not in err, err
    assert "the `crm` channel" in err, err


async def test_what_happened_to_a_reminder_every_occurrence_attempt_and_redrive(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The CLI could not say what happened to a reminder: `status` said "no work rows" after
    deliveries and `reminder_status` showed a series' next deadline only. Real deliveries to a
    real receiver: one reminder answered 503 then 200; one that fails for good, redriven."""
    from .helpers import config, running, webhook_channel
    from .receiver import Answer, Receiver

    def script(r: Any) -> Answer:
        if r.body["business_key"] == "gone-wrong":
            return Answer(status=400, body=b"no such tenant")
        return Answer(status=503, body=b"busy") if r.n == 1 else Answer()

    with Receiver(script) as receiver:
        await add(conn, "lease:42", channel="hook", source="leases", before="{1 second, 0}")
        await add(conn, "gone-wrong", channel="hook", source="leases")
        async with running(config(webhook_channel(receiver.url)), dsn):
            await until(
                lambda: _count(conn, "status IN ('delivered', 'dead')", 3), what="all finished"
            )
    r = pgwork("reminder", "leases", "lease:42", dsn=dsn)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("work ") == 2 and r.stdout.count(": delivered") == 2, r.stdout
    assert "retry" in r.stdout and "HTTP 503" not in r.stderr, r.stdout
    js = json.loads(pgwork("reminder", "leases", "lease:42", "--json", dsn=dsn).stdout)
    assert js["reminder"]["business_key"] == "lease:42"
    (first,) = [o for o in js["occurrences"] if o["occurrence"] == "00:00:00"]
    ledger = first["attempts_ledger"]
    assert [a["outcome"] for a in ledger] == ["retry", "delivered"], ledger
    assert ledger[0]["http_status"] == 503 and ledger[0]["retry_at"] is not None
    assert ledger[0]["took"] is not None and ledger[1]["http_status"] == 200

    (dead,) = await rows(conn, "SELECT id FROM pgwork.renewal_work WHERE status = 'dead'")
    assert pgwork("dlq", "redrive", str(dead["id"]), dsn=dsn).returncode == 0
    r = pgwork("reminder", "leases", "gone-wrong", dsn=dsn)
    assert "last redriven" in r.stdout and "HTTP 400" in r.stdout, r.stdout
    assert ": ready" in r.stdout, r.stdout

    # A deleted reminder: its rows remain and are shown; an unknown one is exit 1, one line.
    await conn.execute("DELETE FROM pgwork.reminder WHERE business_key = 'gone-wrong'")
    r = pgwork("reminder", "leases", "gone-wrong", dsn=dsn)
    assert r.returncode == 0 and "deleted" in r.stdout and ": cancelled" in r.stdout, r.stdout
    r = pgwork("reminder", "leases", "nosuch", dsn=dsn)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "nosuch" in r.stderr, r.stderr


async def test_what_happened_to_a_series_shows_its_next_deadline_and_retired_ones(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A series: its next occurrence (not yet made), a look-ahead row that is not due yet, and
    an occurrence whose row retention removed."""
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, channel, "
        "recipient) VALUES ('billing', 'rent', (now() AT TIME ZONE 'UTC')::date - 1 + time '09:00', "
        "'UTC', 'FREQ=DAILY', 'log', 'r@example.com')"
    )
    await materialise(dsn, lookahead=2 * 86400.0)
    await conn.execute(
        "INSERT INTO pgwork.retired (reminder_id, deadline, occurrence, status, operation_id, "
        "finished_at, deadline_local) SELECT id, '2020-01-01 09:00+00', '0', 'delivered', "
        "gen_random_uuid(), '2020-01-01 09:00:01+00', '2020-01-01 09:00' FROM pgwork.reminder"
    )
    js = json.loads(pgwork("reminder", "billing", "rent", "--json", dsn=dsn).stdout)
    assert js["upcoming"] and js["upcoming"][0]["status"] in ("ready", "scheduled")
    states = {o["state"] for o in js["occurrences"]}
    assert "ready, not yet due" in states, states
    assert [t["status"] for t in js["retired"]] == ["delivered"]
    text = pgwork("reminder", "billing", "rent", dsn=dsn).stdout
    assert "removed by retention" in text and "next deadline" in text, text


async def _count(conn: psycopg.AsyncConnection[Any], where: str, n: int) -> bool:
    got = await rows(conn, f"SELECT count(*) AS n FROM pgwork.renewal_work WHERE {where}")
    return bool(got[0]["n"] == n)


async def test_a_stale_channel_is_named_by_max_lag_and_can_be_retired(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Channels registered by an old config could not be removed, and a 410-paused channel
    nobody will resume kept `status --max-lag` failing for ever, without saying where."""
    await conn.execute("INSERT INTO pgwork.channel (name, kind) VALUES ('old-crm', 'webhook')")
    await add(conn, "k1", "now() - interval '2 hours'", channel="old-crm")
    await add(conn, "k2", "now() + interval '1 day'", channel="old-crm")
    await add(conn, "other", "now() + interval '1 day'", channel="log")
    await add(conn, "moved", "now() - interval '1 hour'", channel="old-crm")
    await materialise(dsn)
    # A reminder moved to another channel takes its unsent work along: its row here is closed.
    await conn.execute("UPDATE pgwork.reminder SET channel = 'log' WHERE business_key = 'moved'")
    await conn.execute(
        "SELECT pgwork.pause_channel('old-crm', 'HTTP 410 from https://old.example/hook', 'pgwork')"
    )
    r = pgwork("status", "--max-lag", "5m", dsn=dsn)
    assert r.returncode == 1 and "channel old-crm, PAUSED" in r.stderr, r.stderr
    assert "pgwork channel retire old-crm --cancel" in r.stderr, r.stderr

    # Refused while reminders name it; nothing changed.
    r = pgwork("channel", "retire", "old-crm", dsn=dsn)
    assert r.returncode == 1 and "2 reminder(s), 1 live work row(s)" in r.stderr, r.stderr
    assert len(await rows(conn, "SELECT 1 FROM pgwork.reminder WHERE channel = 'old-crm'")) == 2

    # The daemon's role may not delete reminders: a clear error, nothing changed.
    role = f"pgwork_t_daemon_{os.getpid()}"
    await conn.execute(f"DROP ROLE IF EXISTS {role}")
    await conn.execute(f"CREATE ROLE {role} LOGIN IN ROLE pgwork_daemon")
    try:
        as_daemon = psycopg.conninfo.make_conninfo(dsn, user=role)
        r = pgwork("channel", "retire", "old-crm", "--cancel", dsn=as_daemon)
        assert r.returncode == 2 and "schema's owner" in r.stderr, r.stderr
        assert len(await rows(conn, "SELECT 1 FROM pgwork.channel WHERE name = 'old-crm'")) == 1
    finally:
        await conn.execute(f"DROP OWNED BY {role}")
        await conn.execute(f"DROP ROLE {role}")

    r = pgwork("channel", "retire", "old-crm", "--cancel", dsn=dsn)
    assert r.returncode == 0 and "deleted its 2 reminder(s)" in r.stdout, r.stderr
    assert await rows(conn, "SELECT 1 FROM pgwork.channel WHERE name = 'old-crm'") == []
    live = await rows(
        conn, "SELECT status FROM pgwork.renewal_work WHERE channel = 'old-crm' ORDER BY status"
    )
    assert [x["status"] for x in live] == ["cancelled", "superseded"], live
    assert len(await rows(conn, "SELECT 1 FROM pgwork.reminder")) == 2  # the log channel's
    # The moved reminder's work is made again on its channel; once sent there, nothing is late.
    await materialise(dsn)
    moved = await rows(
        conn,
        "SELECT channel FROM pgwork.renewal_work WHERE business_key = 'moved' AND status = 'ready'",
    )
    assert [m["channel"] for m in moved] == ["log"], moved
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'delivered', finished_at = now() WHERE status = 'ready'"
    )
    await sync_queue(conn)
    assert pgwork("status", "--max-lag", "5m", dsn=dsn).returncode == 0
    r = pgwork("channel", "retire", "old-crm", dsn=dsn)
    assert r.returncode == 1 and "no channel named 'old-crm'" in r.stderr


def _run_embedded(cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PGWORK_"))}
    return subprocess.Popen(
        [sys.executable, "-m", "pgwork", "run"],
        cwd=cwd,
        env=e,
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )


def _wait_text(log: Path, text: str, p: subprocess.Popen[bytes], timeout: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert p.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def test_a_killed_embedded_run_leaves_its_server_to_the_next_run_which_stops_it(
    tmp_path: Path,
) -> None:
    """A SIGKILLed `pgwork run` left its embedded server running; the next run adopted it
    silently and did not stop it either. Now it says so, and stops it at its end."""
    import signal

    from pgwork.embedded import LocalServer

    server = LocalServer(tmp_path / ".pgwork" / "pgdata")
    first = _run_embedded(tmp_path, tmp_path / "first.log")
    second: subprocess.Popen[bytes] | None = None
    try:
        _wait_text(tmp_path / "first.log", "pgwork is running on the embedded Postgres", first)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        assert server.running_port() is not None  # what SIGKILL leaves behind

        second = _run_embedded(tmp_path, tmp_path / "second.log")
        _wait_text(tmp_path / "second.log", "pgwork is running on the embedded Postgres", second)
        said = (tmp_path / "second.log").read_text()
        assert f"left running by pgwork process {first.pid}, which is gone" in said, said
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0, (tmp_path / "second.log").read_text()
        # Off a terminal every line is JSON, the migration's and the welcome's too.
        for line in (tmp_path / "second.log").read_text().splitlines():
            assert json.loads(line)["event"], line
        assert server.running_port() is None, "the second run did not stop the server"
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
        server.stop("immediate")


def test_an_embedded_run_says_where_to_watch_it(tmp_path: Path) -> None:
    """The front door named no way to watch the daemon: `make run` served no page and the
    welcome named neither the page nor `/metrics`. With the page on (as `make run` turns it on),
    the welcome names both, on the addresses they are bound to, and both answer."""
    import re
    import signal
    import urllib.request

    from pgwork.embedded import LocalServer

    e = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PGWORK_"))}
    e.update(
        PGWORK_WEB_ENABLED="true",
        PGWORK_WEB_LISTEN="127.0.0.1:0",
        PGWORK_METRICS_LISTEN="127.0.0.1:0",
    )
    log = tmp_path / "run.log"
    p = subprocess.Popen(
        [sys.executable, "-m", "pgwork", "run"],
        cwd=tmp_path,
        env=e,
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )
    try:
        _wait_text(log, "Ctrl-C stops", p)
        said = log.read_text()
        page = re.search(r"web page: (http://127\.0\.0\.1:\d+/)", said)
        metrics = re.search(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", said)
        assert page and metrics, said
        with urllib.request.urlopen(page.group(1), timeout=10) as r:
            assert r.status == 200 and "Overview" in r.read().decode()
        with urllib.request.urlopen(metrics.group(1), timeout=10) as r:
            assert "pgwork_lag_seconds" in r.read().decode()
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, log.read_text()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        LocalServer(tmp_path / ".pgwork" / "pgdata").stop("immediate")
    makefile = (ROOT / "Makefile").read_text()
    assert "PGWORK_WEB_ENABLED" in makefile.split("\nrun:")[1].split("\n\n")[0]


def test_the_demo_shows_a_signed_delivery_a_retry_and_a_dead_letter(tmp_path: Path) -> None:
    """`make demo` (one command): an embedded server, a daemon, a local receiver that checks
    each signature, and three reminders whose outcomes are a delivery, a delivery after two
    retries, and a dead letter; `--once` stops when all three have one, and stops its server."""
    from pgwork.embedded import LocalServer

    e = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PGWORK_"))}
    try:
        r = subprocess.run(
            [sys.executable, "-m", "pgwork.demo", "--once", "--dir", str(tmp_path / "pg")],
            cwd=tmp_path,
            env={**e, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
        out = r.stdout
        assert out.count("signature verified") == 5, out  # 1 + 3 + 1 requests
        assert "outcome: ok:1 delivered after 1 attempt(s)" in out, out
        assert "flaky:1 attempt 2, signature verified" in out and "answered 500" in out, out
        assert "outcome: flaky:1 delivered after 3 attempt(s)" in out, out
        assert "outcome: broken:1 dead after 1 attempt(s)" in out, out
        assert "/dead" in out and "dlq redrive" in out, out
        # Issue 68, item 10: the daemon's log was hidden, and the command it said to run was
        # not on the PATH after `make`: the one it names runs, and the log shows.
        (cli,) = {line.split(" --config ")[0].strip() for line in out.splitlines()
                  if line.endswith(" dlq list")}  # fmt: skip
        ran = subprocess.run([*cli.split(), "--version"], cwd=tmp_path, env=e, capture_output=True)
        assert ran.returncode == 0, (cli, ran.stderr)
        assert "pgwork running" in r.stderr and "dead letter" in r.stderr, r.stderr[-3000:]
        assert LocalServer(tmp_path / "pg").running_port() is None, "the demo left its server"
    finally:
        LocalServer(tmp_path / "pg").stop("immediate")
    makefile = (ROOT / "Makefile").read_text()
    assert "pgwork.demo" in makefile.split("\ndemo:")[1].split("\n\n")[0]


def test_the_welcome_is_not_printed_above_an_error_that_stops_the_run(tmp_path: Path) -> None:
    """The embedded run's welcome ("pgwork is running…") was printed before a configuration
    error found at start stopped it; and a python channel's target that cannot be loaded was
    found only after an embedded server was created, started and migrated. It is found first."""
    cfg = tmp_path / "pgwork.toml"
    cfg.write_text('[channels.crm]\nkind = "python"\ntarget = "nosuch_module:deliver"\n')
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PGWORK_"))}
    r = subprocess.run(
        [sys.executable, "-m", "pgwork", "--config", str(cfg), "run"],
        cwd=tmp_path,
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "cannot import module 'nosuch_module'" in r.stderr, r.stderr
    assert "pgwork is running" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr  # the one line: nothing migrated, nothing started
    assert not (tmp_path / ".pgwork").exists()  # no server was created for it


async def test_migrate_as_a_role_that_does_not_own_the_schema_says_so(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """`pgwork migrate` as the daemon's role (the env file operations.md shows) or an app's
    answered "permission denied for table ..." (exit 3), even with nothing to migrate. It says in
    one line that it runs as the schema's owner (exit 2), and changes nothing."""
    for grant in ("pgwork_daemon", "pgwork_app"):
        role = f"pgwork_t_{grant}_{os.getpid()}"
        await conn.execute(f"DROP ROLE IF EXISTS {role}")
        await conn.execute(f"CREATE ROLE {role} LOGIN IN ROLE {grant}")
        try:
            r = pgwork("migrate", dsn=psycopg.conninfo.make_conninfo(dsn, user=role))
            assert r.returncode == 2, (grant, r.returncode, r.stderr)
            assert r.stderr.count("\n") == 1 and "schema's owner" in r.stderr, r.stderr
            assert role in r.stderr, r.stderr
        finally:
            await conn.execute(f"DROP OWNED BY {role}")
            await conn.execute(f"DROP ROLE {role}")
    got = await rows(conn, "SELECT migration_requester FROM pgwork.schema_version")
    assert got == [{"migration_requester": None}]


async def test_a_reminder_set_aside_for_a_zone_the_server_does_not_know_can_be_inspected(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The one reminder an operator needs to see: written around the triggers in a zone the
    server does not know, it is set aside by the materialiser. `pgwork reminder` answered
    `database error: time zone "Mars/Olympus" not recognized` (exit 3); it now shows the
    reminder as stored and why its next sends cannot be worked out (text and JSON)."""
    await add_in_an_unknown_zone(conn)
    r = pgwork("reminder", "mars", "base:1", dsn=dsn)
    assert r.returncode == 0, r.stderr
    assert "Mars/Olympus" in r.stdout and "cannot be worked out" in r.stdout, r.stdout
    js = json.loads(pgwork("reminder", "mars", "base:1", "--json", dsn=dsn).stdout)
    assert js["reminder"]["due_tz"] == "Mars/Olympus"
    assert js["upcoming"] == [] and 'time zone "Mars/Olympus"' in js["upcoming_error"], js


async def test_intervals_are_printed_as_postgresql_writes_them(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """`pgwork reminder` printed intervals as Python does (`remind_before {7 days, 0:00:00,
    0:00:00}` for '{7 days, 0}': three items for two), and its JSON `"took": "0:00:00.005"`.
    They are written as PostgreSQL writes an interval, each the same value as the database's
    own text for it."""
    from datetime import timedelta

    from pgwork.durations import interval_text

    for td in (
        timedelta(0),
        timedelta(days=7),
        timedelta(days=1, hours=2),
        timedelta(microseconds=5007),
        timedelta(hours=-3, minutes=-5),
        timedelta(days=-1, seconds=30),
        timedelta(days=400, seconds=59, microseconds=1),
    ):
        got = await rows(conn, "SELECT %s::interval::text AS t", (td,))
        assert interval_text(td) == got[0]["t"], td
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, remind_before, channel, "
        "recipient) VALUES ('s', 'k', now() + interval '30 days', '{7 days, 0}', 'log', 'r')"
    )
    r = pgwork("reminder", "s", "k", dsn=dsn)
    assert "remind_before {7 days, 00:00:00}" in r.stdout, r.stdout


async def test_dlq_list_and_retrying_name_a_channel_that_does_not_exist(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """`dlq list --channel nosuch` answered "no dead letters", exit 0, for a misspelt channel, as
    if all were well there (`channel pause nosuch` names it, exit 1). Both listings now say there
    is no such channel, exit 1; a channel that exists and has nothing says so, exit 0."""
    for cmd in ("list", "retrying"):
        r = pgwork("dlq", cmd, "--channel", "nosuch", dsn=dsn)
        assert r.returncode == 1, (cmd, r.stdout, r.stderr)
        assert "no channel named 'nosuch'" in r.stderr, r.stderr
        r = pgwork("dlq", cmd, "--channel", "test", dsn=dsn)
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)


def test_the_top_level_help_names_every_channel_command() -> None:
    """`pgwork --help` said the channel command lists, pauses or resumes: `retire` was found
    only by asking `pgwork channel --help`."""
    r = pgwork("--help", env={"COLUMNS": "200"})  # one line per command
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("channel "))
    for word in ("list", "pause", "resume", "retire"):
        assert word in line, line


async def test_a_reminder_s_next_sends_say_what_its_work_lines_say(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """`pgwork reminder` headed a series' next sends "next deadline (a one-off's only one)",
    and its table said `ready` for a send its own work line called `ready, not yet due`. A
    one-off's heading names its deadline, a series' its next one, and each next send is in the
    state its work row is in (`state`, beside the view's `status`, in --json)."""
    await add(conn, "once", "now() + interval '1 hour'", channel="log")
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, channel, "
        "recipient) VALUES ('test', 'rent', (now() AT TIME ZONE 'UTC')::date + 1 + time '09:00', "
        "'UTC', 'FREQ=DAILY', 'log', 'r')"
    )
    await materialise(dsn, lookahead=3 * 86400.0)
    once = pgwork("reminder", "test", "once", dsn=dsn).stdout
    assert "its deadline, each send:" in once and "only one" not in once, once
    js = json.loads(pgwork("reminder", "test", "once", "--json", dsn=dsn).stdout)
    ((sent,), (work,)) = js["upcoming"], js["occurrences"]
    assert sent["status"] == "ready" and sent["state"] == work["state"] == "ready, not yet due"
    table_line = next(x for x in once.splitlines() if "ready" in x and "work " not in x)
    assert "ready, not yet due" in table_line, once
    rent = pgwork("reminder", "test", "rent", dsn=dsn).stdout
    assert "next deadline of the series, each send:" in rent and "only one" not in rent, rent


def test_psql_connection_options_are_found_in_every_spelling_and_the_rest_kept_in_order() -> None:
    from pgwork.cli.run import connection_options

    asked, rest = connection_options(
        [
            "-XAtU",
            "billing",
            "-c",
            "SELECT 1",
            "-hdb.example",
            "--port=6432",
            "-v",
            "A=1",
            "-fq.sql",
        ]
    )
    assert asked == {"user": "billing", "host": "db.example", "port": "6432"}
    assert rest == ["-XAt", "-c", "SELECT 1", "-v", "A=1", "-f", "q.sql"]
    assert connection_options(["-cSELECT 1", "-d", "app2"]) == (
        {"dbname": "app2"},
        ["-c", "SELECT 1"],
    )


async def test_lag_is_told_per_source_and_max_lag_can_judge_one_source(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """One app's late series paged everyone: `status --max-lag` had one number for all sources.
    Each source's lag is now shown (its oldest due work row or due reminder with none yet), the
    failing check names the late sources, and `--source` judges one app's reminders only."""
    await add(conn, "sent-late", "now() - interval '1 minute'", source="crm", channel="log")
    await add(conn, "later", "now() + interval '1 day'", source="quiet", channel="log")
    await materialise(dsn)
    # Written after the pass: due two hours ago, no work row yet (no daemon running).
    await add(conn, "behind", "now() - interval '2 hours'", source="billing", channel="log")

    st = pgwork("status", "--json", dsn=dsn)
    assert st.returncode == 0, st.stderr
    by_source = {r["source"]: r for r in json.loads(st.stdout)["lag_by_source"]}
    assert set(by_source) == {"billing", "crm", "quiet"}
    assert by_source["billing"]["lag_seconds"] >= 7200
    assert by_source["billing"]["unmaterialised"] is True
    assert 60 <= by_source["crm"]["lag_seconds"] < 7200
    assert by_source["crm"]["unmaterialised"] is False
    assert by_source["quiet"]["lag_seconds"] == 0

    text = pgwork("status", dsn=dsn).stdout
    assert "late sources:" in text and "billing" in text and "quiet" not in text

    r = pgwork("status", "--max-lag", "5m", dsn=dsn)
    assert r.returncode == 1
    assert "source billing" in r.stderr and "crm" not in r.stderr, r.stderr
    assert pgwork("status", "--max-lag", "5m", "--source", "crm", dsn=dsn).returncode == 0
    assert pgwork("status", "--max-lag", "10s", "--source", "crm", dsn=dsn).returncode == 1
    r = pgwork("status", "--max-lag", "5m", "--source", "crm", "--source", "billing", dsn=dsn)
    assert r.returncode == 1 and "source billing" in r.stderr
    # A source with nothing due is on time.
    assert pgwork("status", "--max-lag", "1s", "--source", "quiet", dsn=dsn).returncode == 0
    # Issue 68, item 6: a source with no reminder at all (a misspelt name) exited 0, a health
    # check green for ever. It is the check's error now, naming the source.
    r = pgwork("status", "--max-lag", "5m", "--source", "crm", "--source", "nosuch", dsn=dsn)
    assert r.returncode == 2, r.stderr
    assert "--source nosuch: no reminder has this source" in r.stderr, r.stderr


async def test_status_and_the_overview_name_a_reminder_set_aside_until_it_is_made(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A reminder the materialiser set aside was seen only in a daemon's log and a gauge:
    `status` showed a growing "due but not materialised". The daemon that sets one aside now
    records it (who, since, tries, next try, the error); `status` and its JSON list it while it
    stays unmade, and a pass that makes it (the row fixed) forgets it."""
    from pgwork.duties import materialise as materialiser

    await add(conn, "fine", "now() - interval '1 minute'", source="mars", channel="log")
    await add_in_an_unknown_zone(conn)
    async with await db.connect(dsn) as c:
        for _ in range(2):  # a pass of another daemon fails on it too: one record, two tries
            res = await materialiser.run_once(
                c, lookahead=0, page_size=8, aside=materialiser.SetAside(), origin="d-1"
            )
            assert res is not None and res.set_aside == 1
    (row,) = await rows(conn, "SELECT * FROM pgwork.set_aside")
    assert (row["source"], row["business_key"], row["daemon_id"]) == ("mars", "base:1", "d-1")
    assert row["tries"] == 2 and row["next_try_at"] > row["tried_at"] >= row["since"]
    assert 'time zone "Mars/Olympus"' in row["error"], row

    doc = json.loads(pgwork("status", "--json", dsn=dsn).stdout)
    assert [(r["source"], r["business_key"]) for r in doc["set_aside"]] == [("mars", "base:1")]
    text = pgwork("status", dsn=dsn).stdout
    assert "SET ASIDE" in text and "base:1" in text and "Mars/Olympus" in text, text
    r = pgwork("reminder", "mars", "base:1", dsn=dsn)
    assert "set aside by d-1" in r.stdout, r.stdout

    # Fixed by its app: the next pass makes it and forgets it.
    await conn.execute("UPDATE pgwork.reminder SET due_tz = 'UTC' WHERE business_key = 'base:1'")
    async with await db.connect(dsn) as c:
        res = await materialiser.run_once(
            c, lookahead=0, page_size=8, aside=materialiser.SetAside(), origin="d-2"
        )
        assert res is not None and res.set_aside == 0
    assert await rows(conn, "SELECT * FROM pgwork.set_aside") == []
    assert json.loads(pgwork("status", "--json", dsn=dsn).stdout)["set_aside"] == []
    assert "SET ASIDE" not in pgwork("status", dsn=dsn).stdout


async def test_status_counts_rows_not_claimable_yet_as_waiting_not_ready(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """`status` counted a row made ahead of its due time (the look-ahead) and a retry in its
    backoff as `ready`, as if a worker could take them now. They are `waiting`; `ready` is what
    a claim could take now (the gauge `pgwork_work_rows` reads the same statement)."""
    await add(conn, "due", "now() - interval '1 minute'", channel="log")
    await add(conn, "ahead", "now() + interval '1 hour'", channel="log")
    await materialise(dsn, lookahead=7200)
    states = json.loads(pgwork("status", "--json", dsn=dsn).stdout)["work"]
    assert {(s["channel"], s["status"]): s["n"] for s in states} == {
        ("log", "ready"): 1,
        ("log", "waiting"): 1,
    }
    assert "waiting" in pgwork("status", dsn=dsn).stdout


async def test_a_reminder_waiting_on_a_paused_channel_says_so(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A row held by its paused channel (a receiver answered 410, or an operator paused it) was
    shown as `ready · 0 attempts`, as if nothing held it. `pgwork reminder` says the channel is
    paused, by whom and why, in the work line and the JSON."""
    await add(conn, "held", "now() - interval '1 minute'", channel="log")
    await materialise(dsn)
    r = pgwork("channel", "pause", "log", "--reason", "receiver answered 410", dsn=dsn)
    assert r.returncode == 0, r.stderr
    text = pgwork("reminder", "test", "held", dsn=dsn).stdout
    assert "ready, channel log PAUSED: receiver answered 410" in text, text
    (work,) = json.loads(pgwork("reminder", "test", "held", "--json", dsn=dsn).stdout)[
        "occurrences"
    ]
    assert work["state"].startswith("ready, channel log PAUSED"), work
    assert pgwork("channel", "resume", "log", dsn=dsn).returncode == 0
    assert "PAUSED" not in pgwork("reminder", "test", "held", dsn=dsn).stdout


async def test_a_reminder_held_by_an_apps_open_transaction_names_the_holder(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The materialiser skips a due reminder whose row an app's transaction holds (it must not
    wait on an app), and the only trace was a warning in one daemon's log after ten seconds.
    `pgwork reminder` names the session holding it (pid, role, application, since when), in
    text and JSON, and stops naming it once that transaction ends."""
    await add(conn, "held", "now() - interval '1 minute'", channel="log")
    app = await psycopg.AsyncConnection.connect(dsn, application_name="billing-app")
    try:
        await app.execute("BEGIN")
        await app.execute(
            "UPDATE pgwork.reminder SET payload = '{\"v\": 2}' WHERE business_key = 'held'"
        )
        pid = app.info.backend_pid
        assert (await materialise(dsn)).left_locked  # skipped, as designed
        text = pgwork("reminder", "test", "held", dsn=dsn).stdout
        assert f"row locked by pid {pid}" in text and "billing-app" in text, text
        assert "idle in transaction" in text, text
        (holder,) = json.loads(pgwork("reminder", "test", "held", "--json", dsn=dsn).stdout)[
            "locked_by"
        ]
        assert holder["pid"] == pid and holder["application_name"] == "billing-app", holder
        await app.execute("COMMIT")
    finally:
        await app.close()
    assert "locked" not in pgwork("reminder", "test", "held", dsn=dsn).stdout
    assert (
        json.loads(pgwork("reminder", "test", "held", "--json", dsn=dsn).stdout)["locked_by"] == []
    )


async def test_a_row_past_its_channels_expire_after_says_it_will_be_closed_unsent(
    dsn: str, conn: psycopg.AsyncConnection[Any], tmp_path: Path
) -> None:
    """A ready row older than its channel's `expire_after` is closed as `expired` by its next
    claim, never sent; `pgwork reminder` showed it as plain `ready`. It says so, with the instant
    it stopped being sendable, in text and JSON; a row within it says nothing of the kind."""
    await add(conn, "stale", "now() - interval '2 hours'", channel="log")
    await add(conn, "fresh", "now() - interval '10 minutes'", channel="log")
    await materialise(dsn)
    cfg = tmp_path / "c.toml"
    cfg.write_text('[channels.log]\nkind = "log"\nexpire_after = "1h"\n')
    text = pgwork("--config", str(cfg), "reminder", "test", "stale", dsn=dsn).stdout
    assert "past its channel's expire_after (1h)" in text, text
    assert "its next claim closes it as expired, not sent" in text, text
    (work,) = json.loads(
        pgwork("--config", str(cfg), "reminder", "test", "stale", "--json", dsn=dsn).stdout
    )["occurrences"]
    assert "past its channel's expire_after" in work["state"], work
    fresh = pgwork("--config", str(cfg), "reminder", "test", "fresh", dsn=dsn).stdout
    assert "expire_after" not in fresh, fresh
    # Without the channel's setting in this config, nothing is claimed about it.
    assert "expire_after" not in pgwork("reminder", "test", "stale", dsn=dsn).stdout


async def test_a_throttle_that_holds_nothing_back_is_told_as_recovering_not_throttled(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Once a throttle's hold has passed, the channel claims again under a reduced limit that
    each success raises; with little traffic the limit stays, and `channel list`, the
    `pgwork_channel_throttled` gauge (the same statement) and a waiting row said THROTTLED
    minutes after the last attempt, while rows were claimed at once. THROTTLED now means the
    throttle stops a claim now: held until its `Retry-After`, or its limit all taken; otherwise
    the channel is `running`, recovering, with its limit in the why."""
    for key in ("a", "b", "c"):
        await add(conn, key, "now() - interval '1 minute'")
    await materialise(dsn)
    await conn.execute(
        "UPDATE pgwork.channel SET not_before = now() - interval '5 minutes', throttle_limit = 3, "
        "throttle_from = 8, throttled_at = now() - interval '6 minutes', "
        "throttle_reason = 'HTTP 429 from the receiver' WHERE name = 'test'"
    )

    def listed() -> dict[str, Any]:
        rows: list[dict[str, Any]] = json.loads(pgwork("channel", "list", "--json", dsn=dsn).stdout)
        (row,) = [c for c in rows if c["name"] == "test"]
        return row

    row = listed()
    assert row["state"] == "running" and not row["throttled"], row
    assert "recovering" in row["why"] and "at most 3 claimed at once" in row["why"], row
    assert "THROTTLED" not in pgwork("reminder", "test", "c", dsn=dsn).stdout

    # Its limit all taken by live leases: a claim takes nothing now, so it is THROTTLED.
    await conn.execute("UPDATE pgwork.channel SET throttle_limit = 2 WHERE name = 'test'")
    assert len(await claim(dsn, limit=2)) == 2
    row = listed()
    assert row["state"] == "THROTTLED" and row["throttled"], row
    assert "2 of at most 2 claimed" in row["why"], row
    assert "THROTTLED" in pgwork("reminder", "test", "c", dsn=dsn).stdout

    # Held until its Retry-After: THROTTLED whatever the count.
    await conn.execute(
        "UPDATE pgwork.channel SET not_before = now() + interval '1 minute', "
        "throttle_limit = 5 WHERE name = 'test'"
    )
    row = listed()
    assert row["state"] == "THROTTLED" and "held" in row["why"], row


def test_a_build_is_named_by_its_files(tmp_path: Path) -> None:
    """Every build said `pgwork 0.1.0`, and the step-aside handshake and `migrate --wait` name
    daemons by it: old and new looked alike. The version carries a digest of the package's
    files: the same files give the same digest, one changed byte another."""
    import shutil

    copy = tmp_path / "pgwork"
    shutil.copytree(build.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert build.digest(copy) == build.digest()
    (copy / "__pycache__").mkdir(exist_ok=True)
    (copy / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"compiled")
    assert build.digest(copy) == build.digest()  # only the sources count
    wake = copy / "sql" / "code" / "work.sql"
    wake.write_text(wake.read_text() + "\n")
    assert build.digest(copy) != build.digest()
    assert build.version() == f"{__version__}+{build.digest()}"
