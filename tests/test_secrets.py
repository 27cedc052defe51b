"""Secrets never leak (issue 9, items 12-16): planted passwords and header values are looked for
in every log line, CLI output, stored error text and process command line pgwork produces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from pgwork.config import ConfigError, load

from .helpers import add, rows, settled, until
from .processes import DaemonProcess, hook, toml
from .receiver import Answer, Receiver, Request
from .test_cli import ROOT, pgwork

pytestmark = pytest.mark.anyio

PASSWORD = "PlantedPw-6f2e"
TOKEN = "PlantedTok-9c1d"
#: A webhook signing secret (base64 of "PlantedSigningKey-4b7a-32-bytes!").
SIGNING = "whsec_UGxhbnRlZFNpZ25pbmdLZXktNGI3YS0zMi1ieXRlcyE="


def _planted_dsn(dsn: str) -> str:
    d = conninfo_to_dict(dsn)  # the test server trusts local connections: any password works
    return f"postgresql://postgres:{PASSWORD}@{d['host']}:{d['port']}/{d['dbname']}"


def _leaks(text: str) -> list[str]:
    return [s for s in (PASSWORD, TOKEN, SIGNING, SIGNING[6:]) if s in text]


# -- item 12: a DSN that cannot parse ----------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        f"postgresql://app:{PASSWORD}%zz@127.0.0.1:1/db",  # invalid percent-encoding
        f"host=127.0.0.1 password=x {PASSWORD}",  # libpq: missing "=" after "<the password>"
    ],
)
@pytest.mark.parametrize("cmd", ["status", "run"])
def test_an_unparsable_dsn_is_a_config_error_that_never_shows_it(bad: str, cmd: str) -> None:
    t0 = time.monotonic()
    r = pgwork(cmd, dsn=bad)
    assert r.returncode == 2, r.stderr
    assert time.monotonic() - t0 < 30  # the daemon does not retry a DSN that can never parse
    assert r.stderr.startswith("pgwork: configuration error: database.dsn (from PGWORK_DSN)")
    assert _leaks(r.stdout + r.stderr) == []


# -- item 13: header values ---------------------------------------------------------------------


@pytest.mark.parametrize("value", [f"Bearer {TOKEN}\n", f"Bearer {TOKEN}\r\nX-Evil: 1", "Bé"])
def test_header_values_with_line_breaks_or_non_ascii_are_refused_by_name(
    tmp_path: Path, value: str
) -> None:
    p = tmp_path / "c.toml"
    p.write_text(
        '[channels.hook]\nkind = "webhook"\nurl = "http://127.0.0.1:1/"\n'
        'headers = { Authorization = "env:HOOK_TOKEN" }\n'
    )
    with pytest.raises(ConfigError) as info:
        load(p, env={"HOOK_TOKEN": value})
    assert "channels.hook.headers.Authorization" in str(info.value)
    assert _leaks(str(info.value)) == []


# -- items 14, 15, 16 and the sweep --------------------------------------------------------------


def _echo(r: Request) -> Answer:
    """A receiver that echoes the request's headers back in its error bodies."""
    echoed = json.dumps(r.headers).encode()
    if r.key and r.body["business_key"] == "echo-400":
        return Answer(status=400, body=b"rejected; you sent " + echoed)
    if r.body["business_key"] == "echo-500" and r.n == 1:
        return Answer(status=500, body=b"oops; you sent " + echoed)
    return Answer(status=200, body=b'{"seen": ' + echoed + b"}")


@pytest.mark.slow
async def test_no_planted_secret_appears_anywhere(
    dsn: str, conn: psycopg.AsyncConnection[Any], tmp_path: Path
) -> None:
    planted = _planted_dsn(dsn)
    with Receiver(_echo) as receiver:
        channel = (
            hook(receiver.url)
            + 'headers = { Authorization = "env:HOOK_TOKEN" }\n'
            + 'signing_secret = "env:HOOK_SIGNING"\n[channels.log]\nkind = "log"\n'
        )
        config = toml(channel=channel, extra='[log]\nredact = "hash"\n').replace(
            '[log]\nformat = "json"\nlevel = "debug"\n', ""
        )
        env = {
            "HOOK_TOKEN": f"Bearer {TOKEN}",
            "HOOK_SIGNING": SIGNING,
            "PGWORK_LOG_FORMAT": "json",
            "PGWORK_LOG_LEVEL": "debug",
        }
        d = DaemonProcess(planted, tmp_path, config, "secrets", env=env)
        try:
            await anyio.to_thread.run_sync(d.wait_ready)
            for key in ("echo-400", "echo-500", "plain"):
                await add(conn, key, channel="hook")
            await add(conn, "tenant:jane", channel="log", recipient="jane@example.com")
            await until(lambda: settled(conn, 4), timeout=30, what="four rows settled")
            requests = receiver.requests
            assert any(TOKEN in json.dumps(r.headers) for r in requests)  # it was really sent
            assert all("webhook-signature" in r.headers for r in requests)
            cfg_path = tmp_path / "secrets.toml"
            cli_env = {**env, "PGWORK_CONFIG": str(cfg_path)}
            outputs = []
            for args in (("status",), ("dlq", "list"), ("dlq", "show", await _dead_id(conn))):
                r = await anyio.to_thread.run_sync(_cli, args, planted, cli_env)
                assert r.returncode == 0, r.stderr
                outputs.append(r.stdout + r.stderr)
            cmdlines = await anyio.to_thread.run_sync(lambda: _psql_cmdlines(planted, cli_env))
            d.signal(signal.SIGTERM)
            assert await anyio.to_thread.run_sync(d.wait) == 0
        finally:
            d.kill()
    log_text = d.log.read_text()
    # log.redact = hash covers the log channel's own message text too.
    assert "REMINDER" in log_text
    assert "tenant:jane" not in log_text and "jane@example.com" not in log_text
    stored = await rows(
        conn,
        "SELECT coalesce(a.error, '') || coalesce(a.receipt::text, '') || "
        "coalesce(w.last_error, '') || coalesce(w.dead_reason, '') AS t "
        "FROM pgwork.attempt a JOIN pgwork.renewal_work w ON w.id = a.work_id",
    )
    assert any("you sent" in s["t"] for s in stored)  # the echo was stored, masked
    assert cmdlines and all(PASSWORD not in c for c in cmdlines)
    for where, text in [
        ("daemon log", log_text),
        ("stored rows", " ".join(s["t"] for s in stored)),
        *[(f"CLI output {i}", o) for i, o in enumerate(outputs)],
    ]:
        assert _leaks(text) == [], where


async def _dead_id(conn: psycopg.AsyncConnection[Any]) -> str:
    (r,) = await rows(conn, "SELECT id FROM pgwork.renewal_work WHERE status = 'dead'")
    return str(r["id"])


def _cli(args: tuple[str, ...], dsn: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return pgwork(*args, dsn=dsn, env=env)


def _psql_cmdlines(planted: str, env: dict[str, str]) -> list[str]:
    """Run `pgwork psql` and read the command lines of the processes it starts."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PGWORK_"))}
    e.update(env, PGWORK_DSN=planted)
    p = subprocess.Popen(
        [sys.executable, "-m", "pgwork", "psql", "-c", "SELECT pg_sleep(2)"],
        env=e,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and p.poll() is None:
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if "pg_sleep" in cmd and cmd.split()[0].endswith("psql"):  # psql itself
                    seen.append(cmd)
            if seen:
                break
            time.sleep(0.05)
        assert p.wait(20) == 0
    finally:
        if p.poll() is None:
            p.kill()
    return seen
