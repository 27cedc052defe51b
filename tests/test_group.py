"""``pgwork run --processes N`` (issue 26): real processes — a parent and its children, a burst
spread over them, a child killed with SIGKILL and started again, the group stopped with one
SIGTERM, and sd_notify spoken for the group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

from pgwork.config import load
from pgwork.group import child_env, process_count

from .helpers import rows, until
from .processes import ROOT, hook, toml
from .receiver import Answer, Receiver
from .test_operations import NotifySocket

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

CHANNEL = '[channels.log]\nkind = "log"\nconcurrency = 4'


class GroupProcess:
    """``pgwork run --processes N`` in its own session (killed whole when the test ends)."""

    def __init__(
        self,
        dsn: str,
        tmp: Path,
        n: int,
        env: dict[str, str] | None = None,
        channel: str = CHANNEL,
        grace: str = "5s",
    ) -> None:
        cfg = tmp / "group.toml"
        cfg.write_text(toml(channel=channel, grace=grace))
        self.log = tmp / "group.log"
        self._out = self.log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pgwork", "--config", str(cfg), "run", "--processes", str(n)],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            cwd=tmp,
            env={**os.environ, "PGWORK_DSN": dsn, "PYTHONPATH": str(ROOT), **(env or {})},
            start_new_session=True,
        )

    def children(self) -> set[int]:
        """Pids whose parent is the group's parent."""
        out = set()
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    stat = Path(f"/proc/{name}/stat").read_bytes()
                except OSError:
                    continue
                if int(stat[stat.rfind(b")") + 2 :].split()[1]) == self.proc.pid:
                    out.add(int(name))
        return out

    def stop(self) -> None:
        # The children run in process groups of their own: each is killed by its pid.
        for pid in self.children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._out.close()


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Any]:
    started: list[GroupProcess] = []

    def start(dsn: str, n: int, env: dict[str, str] | None = None, **kw: Any) -> GroupProcess:
        g = GroupProcess(dsn, tmp_path, n, env, **kw)
        started.append(g)
        return g

    yield start
    for g in started:
        g.stop()


async def _daemons(conn: psycopg.AsyncConnection[Any]) -> set[int]:
    return {r["pid"] for r in await rows(conn, "SELECT pid FROM pgwork.daemon")}


async def _burst(conn: psycopg.AsyncConnection[Any], prefix: str, n: int) -> None:
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT 'app', %s || g, now(), 'log', 'r' FROM generate_series(1, %s) g",
        (prefix, n),
    )


async def _delivered(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    (r,) = await rows(
        conn, "SELECT count(*) AS n FROM pgwork.renewal_work WHERE status = 'delivered'"
    )
    return bool(r["n"] == n)


async def test_a_group_starts_shares_a_burst_restarts_a_killed_child_and_stops_as_one(
    dsn: str, conn: psycopg.AsyncConnection[Any], tmp_path: Path, group: Any
) -> None:
    ns = NotifySocket(tmp_path / "notify.sock")
    try:
        g = group(dsn, 2, {"NOTIFY_SOCKET": str(ns.path), "WATCHDOG_USEC": "2000000"})
        first = [x for _, x in await anyio.to_thread.run_sync(ns.pump, 6.0)]
        assert "READY=1" in first, first
        kids = g.children()
        assert len(kids) == 2
        await until(lambda: _has(conn, kids), what="both children registered as daemons")
        assert first.count("READY=1") == 1
        assert "WATCHDOG=1" in first[first.index("READY=1") :]

        # A burst is shared: both children deliver some of it.
        await _burst(conn, "a", 400)
        await until(lambda: _delivered(conn, 400), timeout=30, what="the burst delivered")
        by = await rows(conn, "SELECT DISTINCT pid FROM pgwork.attempt")
        assert {r["pid"] for r in by} == kids

        # A child killed with SIGKILL is started again; the group keeps delivering.
        victim = min(kids)
        os.kill(victim, signal.SIGKILL)
        await until(
            lambda: _children_are(g, lambda now: len(now) == 2 and victim not in now),
            timeout=15,
            what="the killed child started again",
        )
        await until(lambda: _has(conn, g.children()), what="the new child registered")
        await _burst(conn, "b", 50)
        await until(lambda: _delivered(conn, 450), timeout=30, what="delivered after the restart")

        # One SIGTERM stops the group: every child, then the parent, exit 0.
        now = g.children()
        await anyio.to_thread.run_sync(ns.pump, 0.3)  # read what queued meanwhile
        g.proc.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: g.proc.wait(30)) == 0
        assert not _alive(now)
        end = [x for _, x in await anyio.to_thread.run_sync(ns.pump, 0.5)]
        assert "STOPPING=1" in end
    finally:
        ns.close()


def _alive(pids: set[int]) -> bool:
    return any(os.path.exists(f"/proc/{p}") for p in pids)


async def _has(conn: psycopg.AsyncConnection[Any], pids: set[int]) -> bool:
    return pids <= await _daemons(conn)


async def _children_are(g: GroupProcess, check: Any) -> bool:
    return bool(check(g.children()))


async def test_children_stop_when_the_parent_is_killed(
    dsn: str, conn: psycopg.AsyncConnection[Any], group: Any
) -> None:
    g = group(dsn, 2)
    await until(lambda: _children_are(g, lambda now: len(now) == 2), what="two children")
    kids = g.children()
    await until(lambda: _has(conn, kids), what="both children registered as daemons")
    g.proc.kill()  # SIGKILL: the parent cannot pass anything on
    g.proc.wait(10)
    await until(lambda: _gone(kids), timeout=15, what="the children stopped after their parent")


async def _gone(pids: set[int]) -> bool:
    return not _alive(pids)


async def test_ctrl_c_in_a_terminal_is_one_graceful_stop_for_the_whole_group(
    dsn: str, conn: psycopg.AsyncConnection[Any], group: Any
) -> None:
    """A terminal's Ctrl-C sends SIGINT to its foreground process group. The group's children
    must not get it as well as the parent's forwarded SIGTERM (two stop requests: the immediate
    stop, which released in-flight deliveries to be sent again): four webhooks in flight, the
    receiver answering after 3 s, all four finish within the grace and are sent once."""
    with Receiver(lambda r: Answer(delay=3.0)) as receiver:
        g = group(dsn, 2, channel=hook(receiver.url, concurrency=4), grace="20s")
        await until(lambda: _children_are(g, lambda now: len(now) == 2), what="two children")
        await until(lambda: _has(conn, g.children()), what="both children registered as daemons")
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "SELECT 'app', 'k' || g, now(), 'hook', 'r' FROM generate_series(1, 4) g"
        )

        async def in_flight() -> bool:
            return len(receiver.requests) == 4

        await until(in_flight, what="four requests in flight")
        os.killpg(g.proc.pid, signal.SIGINT)  # what the terminal does
        assert await anyio.to_thread.run_sync(lambda: g.proc.wait(30)) == 0
    outcomes = await rows(conn, "SELECT outcome, count(*) AS n FROM pgwork.attempt GROUP BY 1")
    assert {r["outcome"]: r["n"] for r in outcomes} == {"delivered": 4}
    assert sorted(r.n for r in receiver.requests) == [1, 1, 1, 1]


async def test_a_child_that_cannot_start_stops_the_group(
    dsn: str, tmp_path: Path, group: Any
) -> None:
    """A child that exits before it is ready (here: its metrics port is taken) is not started
    again and again: the group stops with its exit status."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        g = group(
            dsn,
            2,
            {"PGWORK_METRICS_ENABLED": "true", "PGWORK_METRICS_LISTEN": f"127.0.0.1:{port - 1}"},
        )
        # Child 0 takes port-1 (if free), child 1 the busy port: it cannot serve its metrics.
        code = await anyio.to_thread.run_sync(lambda: g.proc.wait(30))
    assert code != 0
    assert "before it was ready; stopping the group" in g.log.read_text()
    await until(lambda: _children_are(g, lambda now: not now), timeout=5, what="no child left")


def test_children_are_told_apart(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('[metrics]\nlisten = "0.0.0.0:9500"\n[daemon]\nid = "web1"\n')
    cfg = load(cfg_file)
    env = [child_env(cfg, "dbname=x", i, {"NOTIFY_SOCKET": "/run/n", "A": "1"}) for i in (0, 1)]
    assert [e["PGWORK_METRICS_LISTEN"] for e in env] == ["0.0.0.0:9500", "0.0.0.0:9501"]
    assert [e["PGWORK_DAEMON_ID"] for e in env] == ["web1-0", "web1-1"]
    assert "PGWORK_WEB_ENABLED" not in env[0] and env[1]["PGWORK_WEB_ENABLED"] == "false"
    assert all(e["PGWORK_DSN"] == "dbname=x" and e["A"] == "1" for e in env)
    assert all("NOTIFY_SOCKET" not in e for e in env)
    cfg_file.write_text('[metrics]\nlisten = "127.0.0.1:9500-9510"\n')
    assert "PGWORK_METRICS_LISTEN" not in child_env(load(cfg_file), "x", 1, {})
    assert process_count("3") == 3 and process_count("auto") >= 1
    for bad in ("0", "-1", "x", "257", "²"):
        with pytest.raises(ValueError, match="--processes"):
            process_count(bad)


def test_the_default_ports_never_collide(tmp_path: Path) -> None:
    """With web.enabled, `pgwork run --processes 2` gave child 1 metrics on 9465, the web page's
    default, and the group exited blaming web.listen (so did `pgwork web` beside a group). The
    web page's default lies outside every child's metrics port, for any number of children."""
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text("[web]\nenabled = true\n")
    cfg = load(cfg_file)
    web_port = int(cfg.web_listen.rsplit(":", 1)[1])
    metrics = {
        int(child_env(cfg, "x", i, {})["PGWORK_METRICS_LISTEN"].rsplit(":", 1)[1])
        for i in range(256)
    }
    assert web_port not in metrics, (web_port, min(metrics))
