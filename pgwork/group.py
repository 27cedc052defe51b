"""``pgwork run --processes N``: N daemon processes on one host that behave as one service.

The parent runs no duty and holds no database connection. It starts N children (``pgwork run``
with the same configuration and the database it resolved), each told apart by its metrics port
(the configured one plus its index, unless a range or port 0 was configured), its daemon id
(the configured one plus its index) and, for the web page, only the first serving it. Each child
speaks sd_notify as a lone daemon does, to a socket of the parent's own, one per child; the
parent tells systemd READY when every child is, and feeds the watchdog while every child feeds
its own. A child that dies after it was ready is started again (backoff from one second to
thirty); one that dies before it was ready stops the group with its exit status (a
configuration error would fail every restart the same way). SIGTERM and SIGINT are passed to
every child: the first is their graceful stop, the second their immediate one, as for one
daemon. Each child runs in a process group of its own, so a terminal's Ctrl-C reaches the
parent alone and is passed on once. The parent exits when every child has: 0 if each exited 0.

Several daemons share a database by design (leases, SKIP LOCKED, the materialiser's
coordination), so nothing else changes: the group is several daemons that start and stop
together.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .config import Config, listen_ports
from .systemd import Notifier

log = logging.getLogger("pgwork.group")

#: Seconds before a dead child is started again, doubled up to RESTART_MAX while it keeps dying.
RESTART_FIRST = 1.0
RESTART_MAX = 30.0


def process_count(value: str) -> int:
    """``--processes``: a count from 1, or ``auto`` (the cores this process may run on)."""
    if value == "auto":
        return max(1, len(os.sched_getaffinity(0)))
    if value.isascii() and value.isdigit() and 1 <= int(value) <= 256:
        return int(value)
    raise ValueError(f"--processes: expected a count from 1 to 256 or 'auto' (got {value!r})")


def _die_with_parent() -> None:
    """In the child, before it runs pgwork: SIGTERM (its graceful stop) when the parent dies,
    however it dies (a SIGKILLed parent leaves no orphan daemons; under systemd, the unit's
    cgroup would be stopped anyway). Linux's PR_SET_PDEATHSIG; elsewhere nothing."""
    if sys.platform != "linux":
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def child_env(cfg: Config, dsn: str, index: int, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of child ``index``: the parent's, with the database resolved, and what
    must differ between daemons on one host (metrics port, daemon id, the web page)."""
    env = dict(base)
    env.pop("NOTIFY_SOCKET", None)
    env.pop("WATCHDOG_PID", None)
    env["PGWORK_DSN"] = dsn
    parsed = listen_ports(cfg.metrics_listen)
    if parsed is not None:
        host, ports = parsed
        if len(ports) == 1 and ports[0] != 0:  # one fixed port: the next ones for the others
            env["PGWORK_METRICS_LISTEN"] = f"{host}:{ports[0] + index}"
    if cfg.daemon_id:
        env["PGWORK_DAEMON_ID"] = f"{cfg.daemon_id}-{index}"
    if index > 0:
        env["PGWORK_WEB_ENABLED"] = "false"
    return env


@dataclass
class Child:
    index: int
    sock: socket.socket
    address: str
    proc: subprocess.Popen[bytes] | None = None
    ready: bool = False
    fed_at: float = 0.0  # when it last sent WATCHDOG=1 (monotonic)
    restart_at: float | None = None
    backoff: float = RESTART_FIRST
    exit_code: int | None = None


class Group:
    def __init__(
        self,
        cfg: Config,
        dsn: str,
        n: int,
        argv: Sequence[str],
        notifier: Notifier | None = None,
        env: Mapping[str, str] | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.cfg = cfg
        #: Called once every child is ready (the welcome of an embedded run).
        self.on_ready = on_ready
        self.dsn = dsn
        self.n = n
        #: The child's command line: ``pgwork [global options] run``.
        self.argv = list(argv)
        self.notifier = notifier or Notifier()
        self.env = dict(os.environ if env is None else env)
        self.children: list[Child] = []
        self.signals = 0
        self.announced = False
        self._dir = Path(tempfile.mkdtemp(prefix="pgwork-group-"))

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            for i in range(self.n):
                path = self._dir / f"child-{i}.sock"
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sock.bind(str(path))
                self.children.append(Child(i, sock, str(path)))
            for c in self.children:
                self._start(c)
            self.notifier.status(f"starting {self.n} processes")
            log.info("pgwork group started", extra={"processes": self.n})
            return self._loop()
        finally:
            for c in self.children:
                c.sock.close()
            for p in self._dir.iterdir():
                p.unlink()
            self._dir.rmdir()
            self.notifier.close()

    def _loop(self) -> int:
        timeout = self.notifier.watchdog_timeout
        feed_every = timeout / 2 if timeout else None
        fed = time.monotonic()
        failed: int | None = None
        forwarded = 0
        while True:
            if self.signals > forwarded:
                forwarded = self.signals
                self.notifier.stopping()
                for c in self.children:
                    if c.proc is not None and c.proc.poll() is None:
                        c.proc.send_signal(signal.SIGTERM)
            self._read_notifications(0.2)
            now = time.monotonic()
            for c in self.children:
                if c.proc is not None and (code := c.proc.poll()) is not None:
                    c.proc = None
                    c.exit_code = code
                    if self.signals or failed is not None:
                        continue
                    if not c.ready:
                        log.error(
                            "child %d exited with %d before it was ready; stopping the group",
                            c.index,
                            code,
                        )
                        failed = code or 1
                        self.signals += 1  # stop the others as a SIGTERM would
                        continue
                    log.error(
                        "child %d exited with %d; starting it again in %.0fs",
                        c.index,
                        code,
                        c.backoff,
                    )
                    c.ready = False
                    c.restart_at = now + c.backoff
                    c.backoff = min(c.backoff * 2, RESTART_MAX)
                if c.proc is None and c.restart_at is not None and now >= c.restart_at:
                    if not self.signals:
                        self._start(c)
            if all(c.proc is None for c in self.children) and (self.signals or failed is not None):
                break
            if not self.announced and all(c.ready for c in self.children):
                self.announced = True
                self.notifier.ready(f"running: {self.n} processes")
                log.info("pgwork group ready", extra={"processes": self.n})
                if self.on_ready is not None:
                    self.on_ready()
            if timeout and feed_every and now - fed >= feed_every and not self.signals:
                # Fed only while every child fed its own within the timeout.
                if self.announced and all(now - c.fed_at < timeout for c in self.children):
                    self.notifier.watchdog()
                fed = now
        self.notifier.stopping("stopped")
        if failed is not None:
            return failed
        # A child that had not yet set up its own handlers when the SIGTERM came ends by it:
        # that is a clean stop too (it had started nothing).
        clean = (0, -signal.SIGTERM)
        return 0 if all(c.exit_code in clean for c in self.children) else 1

    # -- children ---------------------------------------------------------------------------

    def _start(self, c: Child) -> None:
        env = child_env(self.cfg, self.dsn, c.index, self.env)
        env["NOTIFY_SOCKET"] = c.address
        # Each child in a process group of its own: a terminal's Ctrl-C (SIGINT to its
        # foreground group) reaches the parent only, which forwards one stop request. Had the
        # children had it too, the forwarded SIGTERM would have been their second request, the
        # immediate stop, and in-flight deliveries would have been released to be sent again.
        c.proc = subprocess.Popen(
            [sys.executable, "-m", "pgwork", *self.argv],
            env=env,
            preexec_fn=_die_with_parent,
            process_group=0,
        )
        c.restart_at = None
        c.ready = False
        c.fed_at = time.monotonic()
        log.info("child %d started", c.index, extra={"child": c.index, "child_pid": c.proc.pid})

    def _read_notifications(self, wait: float) -> None:
        socks = {c.sock: c for c in self.children}
        readable, _, _ = select.select(list(socks), [], [], wait)  # a signal: retried (PEP 475)
        for s in readable:
            c = socks[s]
            try:
                data = s.recv(4096)
            except OSError:
                continue
            for line in data.decode(errors="replace").splitlines():
                if line == "READY=1":
                    c.ready = True
                    c.backoff = RESTART_FIRST
                    c.fed_at = time.monotonic()
                elif line == "WATCHDOG=1":
                    c.fed_at = time.monotonic()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals += 1
