"""systemd integration: the sd_notify protocol (READY, STATUS, WATCHDOG, STOPPING) over the
datagram socket named by ``NOTIFY_SOCKET``. Without that variable every call is a no-op."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("pgwork.systemd")


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        # An abstract socket is written with a leading '@'.
        self.address: str | None = ("\0" + addr[1:] if addr.startswith("@") else addr) or None
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        self.watchdog_timeout: float | None = None
        if usec and usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_timeout = int(usec) / 1e6
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        if self.address is None:
            return False
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            # Never blocks: a receiver that does not read (its queue holds 10 datagrams by
            # default on Linux) must not stop the process that notifies it.
            self._sock.sendto("\n".join(fields).encode(), socket.MSG_DONTWAIT, self.address)
        except BlockingIOError:
            log.warning("sd_notify dropped %s: the notify socket's queue is full", fields[0])
            return False
        except OSError as e:
            log.warning("sd_notify failed: %s", e)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self, status: str = "stopping") -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
