"""Operating pgwork: the Prometheus endpoint, systemd notify/watchdog, structured logs."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from psycopg.conninfo import conninfo_to_dict

from pgwork.channels import Delivery, Failed, Retry
from pgwork.daemon import Daemon

from . import sink
from .helpers import add, config, count, rows, running, until
from .processes import DaemonProcess, toml

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("clean_sink")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, Any]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, Any] = {"_types": {}}
    for fam in text_string_to_metric_families(text):
        out["_types"][fam.name] = fam.type
        for s in fam.samples:
            out[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
    return out


def sample(m: dict[str, Any], name: str, **labels: str) -> float | None:
    return m.get(name + json.dumps(labels, sort_keys=True))


async def test_metrics_endpoint_after_known_events(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    async def script(d: Delivery) -> Retry | Failed | None:
        if d.business_key == "bad":
            return Failed(error="no such recipient")
        if d.business_key == "flaky" and d.attempt <= 2:
            return Retry(error="busy", delay=0.05)
        return None

    sink.DEFAULT.append(script)
    port = _free_port()
    cfg = config(metrics_enabled=True, metrics_listen=f"127.0.0.1:{port}", metrics_interval=0.1)
    async with running(cfg, dsn) as daemon:
        await until(lambda: _listening(daemon), what="listener up")
        for key in ("ok1", "ok2", "flaky", "bad"):
            await add(conn, key)
        await add(
            conn, "waiting", "now() - interval '1 minute'", channel="hook"
        )  # nobody serves 'hook'
        await until(lambda: _settled(conn), what="3 delivered and 1 dead")
        await anyio.sleep(0.4)  # two refreshes of the database-derived gauges
        m = await anyio.to_thread.run_sync(scrape, port)

    types = m["_types"]
    assert types["pgwork_attempts"] == "counter" and types["pgwork_lateness_seconds"] == "histogram"
    assert types["pgwork_lag_seconds"] == "gauge"
    assert sample(m, "pgwork_attempts_total", channel="test", outcome="delivered") == 3
    assert sample(m, "pgwork_attempts_total", channel="test", outcome="retry") == 2
    assert sample(m, "pgwork_attempts_total", channel="test", outcome="failed") == 1
    assert sample(m, "pgwork_lateness_seconds_count", channel="test") == 3
    assert sample(m, "pgwork_delivery_duration_seconds_count", channel="test") == 6
    assert sample(m, "pgwork_materialised_rows_total") == 5
    assert sample(m, "pgwork_dead_letters") == 1
    db_states = {
        (r["channel"], r["status"]): r["n"]
        for r in await rows(
            conn, "SELECT channel, status, count(*) AS n FROM pgwork.renewal_work GROUP BY 1, 2"
        )
    }
    for (channel, status), n in db_states.items():
        # Live rows and dead letters are exported; delivered ones are counted by pgwork_attempts.
        expected = n if status in ("ready", "claimed", "dead") else None
        assert sample(m, "pgwork_work_rows", channel=channel, status=status) == expected
    assert sample(m, "pgwork_gauge_refresh_seconds") is not None
    assert (sample(m, "pgwork_lag_seconds") or 0) >= 60  # the 'hook' row has waited a minute
    assert (sample(m, "pgwork_source_lag_seconds", source="test", paused="false") or 0) >= 60
    assert sample(m, "pgwork_listener_up") == 1
    assert abs((sample(m, "pgwork_materialiser_cutoff_timestamp_seconds") or 0) - time.time()) < 30
    assert sample(m, "pgwork_table_dead_tuples", table="renewal_work") is not None
    assert sample(m, "pgwork_xmin_horizon_age_seconds") is not None
    assert sample(m, "pgwork_wakeups_total", duty="materialiser", cause="notify") is not None
    assert (
        sample(m, "pgwork_duty_failures_total", duty="materialiser") is None
    )  # no failure, no series


async def _listening(d: Daemon) -> bool:
    return d.metrics.registry.get_sample_value("pgwork_listener_up") == 1


async def _settled(conn: psycopg.AsyncConnection[Any]) -> bool:
    return (
        await count(conn, "status = 'delivered'") == 3 and await count(conn, "status = 'dead'") == 1
    )


async def test_metrics_listen_error_names_the_option(dsn: str) -> None:
    from pgwork.config import ConfigError

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        d = Daemon(config(metrics_enabled=True, metrics_listen=f"127.0.0.1:{port}"), dsn)
        with pytest.raises(ExceptionGroup) as info:
            async with anyio.create_task_group() as tg:
                await tg.start(d.run)
    assert "metrics.listen: cannot serve" in str(info.value.exceptions[0])
    assert isinstance(info.value.exceptions[0], ConfigError)


# -- systemd ---------------------------------------------------------------------------------


class NotifySocket:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, str]] = []

    def pump(self, seconds: float) -> list[tuple[float, str]]:
        end = time.monotonic() + seconds
        got = []
        while time.monotonic() < end:
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            for line in data.splitlines():
                got.append((time.monotonic(), line))
        self.messages += got
        return got

    def close(self) -> None:
        self.sock.close()


@pytest.mark.slow
async def test_sd_notify_ready_watchdog_stuck_loop_and_stopping(
    dsn: str, conn: psycopg.AsyncConnection[Any], tmp_path: Path
) -> None:
    ns = NotifySocket(tmp_path / "notify.sock")
    d = DaemonProcess(
        dsn,
        tmp_path,
        toml(channel='[channels.log]\nkind = "log"'),
        "sd",
        env={"NOTIFY_SOCKET": str(ns.path), "WATCHDOG_USEC": "1000000"},
    )
    try:
        first = await anyio.to_thread.run_sync(ns.pump, 4.0)
        lines = [x for _, x in first]
        assert lines[0].startswith("STATUS=starting")
        assert "READY=1" in lines and lines.index("READY=1") < lines.index("WATCHDOG=1")
        assert lines.count("WATCHDOG=1") >= 4  # every half second
        # Make the materialiser's pass hang: the reminders are locked by a long transaction.
        async with await psycopg.AsyncConnection.connect(dsn) as locker:
            await locker.execute("LOCK TABLE pgwork.reminder IN ACCESS EXCLUSIVE MODE")
            await anyio.to_thread.run_sync(ns.pump, 1.5)  # the next tick's pass gets stuck
            stuck = await anyio.to_thread.run_sync(ns.pump, 2.0)
            await locker.rollback()
        assert [x for _, x in stuck if x == "WATCHDOG=1"] == []
        resumed = await anyio.to_thread.run_sync(ns.pump, 2.0)
        assert "WATCHDOG=1" in [x for _, x in resumed]
        complaints = [e["event"] for e in d.lines() if "watchdog" in e.get("event", "")]
        assert any("materialiser stuck" in e for e in complaints), complaints
        assert any(x.startswith("STATUS=running:") for _, x in ns.messages)
        d.signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(d.wait) == 0
        end = [x for _, x in await anyio.to_thread.run_sync(ns.pump, 0.5)]
        assert "STOPPING=1" in end
    finally:
        d.kill()
        ns.close()


# -- logs ------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_json_logs_with_correlation_fields_redaction_and_no_secrets(
    dsn: str, conn: psycopg.AsyncConnection[Any], tmp_path: Path
) -> None:
    from .receiver import Receiver

    d = conninfo_to_dict(dsn)
    secret_dsn = f"postgresql://postgres:sekrit-pw@{d['host']}:{d['port']}/{d['dbname']}"  # trust auth ignores it
    with Receiver() as receiver:
        channel = (
            f'[channels.hook]\nkind = "webhook"\nurl = "{receiver.url}"\n'
            'headers = { Authorization = "env:HOOK_TOKEN" }\n'
        )
        p = DaemonProcess(
            secret_dsn,
            tmp_path,
            toml(channel=channel, extra='[log]\nredact = "hash"\n').replace(
                '[log]\nformat = "json"\nlevel = "debug"\n', ""
            ),
            "logs",
            env={
                "HOOK_TOKEN": "Bearer tok-sekrit",
                "PGWORK_LOG_FORMAT": "json",
                "PGWORK_LOG_LEVEL": "debug",
            },
        )
        try:
            p.wait_ready()
            await add(conn, "tenant:jane", channel="hook", recipient="jane@example.com")
            await until(lambda: _one_delivered(conn), what="delivered")
            p.signal(signal.SIGTERM)
            assert await anyio.to_thread.run_sync(p.wait) == 0
        finally:
            p.kill()
        assert receiver.requests[0].headers["Authorization"] == "Bearer tok-sekrit"
    raw = p.log.read_text()
    assert "sekrit" not in raw
    assert "jane" not in raw  # business key and recipient hashed
    events = [json.loads(line) for line in raw.splitlines() if line.strip()]  # every line is JSON
    (attempt,) = [e for e in events if e["event"] == "attempt delivered"]
    assert {
        "work_id",
        "operation_id",
        "source",
        "channel",
        "attempt",
        "outcome",
        "duration_ms",
    } <= set(attempt)
    assert attempt["business_key"].startswith("h:") and attempt["outcome"] == "delivered"
    assert all({"ts", "level", "logger", "event"} <= set(e) for e in events)


async def _one_delivered(conn: psycopg.AsyncConnection[Any]) -> bool:
    return await count(conn, "status = 'delivered'") == 1


async def test_unreachable_database_log_hides_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    d = Daemon(config(connect_timeout=1.0), "postgresql://app:sekrit-pw@127.0.0.1:1/db")
    async with anyio.create_task_group() as tg:
        tg.start_soon(d.run)
        await until(lambda: _logged(caplog), what="an unreachable-database line")
        d.request_stop()
    from pgwork.logs import JsonFormatter, TextFormatter

    text = "\n".join(JsonFormatter().format(r) + TextFormatter().format(r) for r in caplog.records)
    assert "app@127.0.0.1:1/db" in text and "sekrit" not in text
    assert os.environ.get("PGWORK_DSN") is None or "sekrit" not in os.environ["PGWORK_DSN"]


async def _logged(caplog: pytest.LogCaptureFixture) -> bool:
    return any("database unreachable" in r.getMessage() for r in caplog.records)


def test_a_notify_socket_nobody_reads_never_blocks(tmp_path: Path) -> None:
    """A receiver that does not read fills its queue (10 datagrams by default on Linux): later
    notifications are dropped with a warning, not waited on (a blocking send once stopped a
    process group's parent, whose loop is what notices its children exit)."""
    import threading

    from pgwork.systemd import Notifier

    path = tmp_path / "deaf.sock"
    deaf = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    deaf.bind(str(path))
    n = Notifier({"NOTIFY_SOCKET": str(path)})
    results: list[bool] = []
    t = threading.Thread(target=lambda: results.extend(n.watchdog() for _ in range(50)))
    try:
        t.start()
        t.join(5)
        assert not t.is_alive(), "a notification blocked"
        assert results[0] and not results[-1]
    finally:
        deaf.close()  # a blocked sender gets an error and ends
        t.join(5)
        n.close()
