"""Real daemon processes for tests: each runs `python -m pgwork run` with its own TOML config
and a JSON log, and is killed when the test ends, even when it fails (the ``procs`` fixture in
conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def toml(*, channel: str, lease: str = "2s", grace: str = "5s", extra: str = "") -> str:
    return f"""
[materialiser]
tick = "500ms"
lookahead = "0s"
[worker]
lease = "{lease}"
claim_batch = 20
[daemon]
shutdown_grace = "{grace}"
[metrics]
enabled = false
[log]
format = "json"
level = "debug"
{channel}
{extra}
"""


def hook(url: str, **kw: Any) -> str:
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in kw.items())
    return f'[channels.hook]\nkind = "webhook"\nurl = "{url}"\nbackoff_base = "50ms"\nbackoff_cap = "200ms"\n{extra}'


class DaemonProcess:
    def __init__(
        self, dsn: str, workdir: Path, config: str, name: str, env: dict[str, str] | None = None
    ) -> None:
        self.cfg = workdir / f"{name}.toml"
        self.cfg.write_text(config)
        self.log = workdir / f"{name}.log"
        self._out = self.log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pgwork", "--config", str(self.cfg), "run"],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env={**os.environ, "PGWORK_DSN": dsn, "PYTHONPATH": str(ROOT), **(env or {})},
        )

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def wait_ready(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(e.get("event") == "pgwork running" for e in self.lines()):
                return
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"daemon exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
                )
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready:\n{self.log.read_text()[-3000:]}")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 20) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._out.close()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Any]:
    started: list[DaemonProcess] = []

    def start(
        dsn: str, config: str, env: dict[str, str] | None = None, ready: bool = True
    ) -> DaemonProcess:
        p = DaemonProcess(dsn, tmp_path, config, f"d{len(started)}", env)
        started.append(p)
        if ready:
            p.wait_ready()
        return p

    yield start
    for p in started:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGCONT)
        p.kill()


async def session_with_pid(dsn: str, pid: int, tries: int = 20) -> Any:
    """A new session on ``dsn`` whose backend has pid ``pid`` (gone by now), as a wrap of the
    kernel's pids would give one: the kernel's last pid is set to the one before (root, Linux),
    and the server's next backend takes ``pid``. Returns the open connection (the caller closes
    it), or None where that cannot be done here (another process took the pid each time)."""
    import psycopg

    def set_last_pid() -> bool:
        try:
            Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        except OSError:
            return False
        return True

    for _ in range(tries):
        if not set_last_pid():
            return None
        c = await psycopg.AsyncConnection.connect(
            dsn, autocommit=True, application_name="an unrelated app"
        )
        if c.info.backend_pid == pid:
            return c
        await c.close()
    return None


def next_migrate(dsn: str) -> subprocess.Popen[bytes]:
    """A next-version `pgwork migrate` in a process of its own (one step: three seconds of
    sleep inside its transaction), for a test to kill (tests/properties/next_migrate.py)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.properties.next_migrate", dsn],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
