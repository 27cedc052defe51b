"""A TCP proxy in front of Postgres that a test can cut and restore (an outage, a failover)."""

from __future__ import annotations

import contextlib
import socket
import threading


class Proxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        #: Chunks the clients have sent so far (about one per statement or pipeline).
        self.sent = 0
        #: Cut (as `cut`) when the clients send their ``cut_at``-th chunk, before it arrives.
        self.cut_at: int | None = None
        self.was_cut = threading.Event()

    def start(self) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(64)
        with self._lock:
            self._listener = ls
        self._thread = threading.Thread(target=self._accept, args=(ls,), daemon=True)
        self._thread.start()

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not ls:  # cut while this one was being set up
                    client.close()
                    server.close()
                    continue
                self._conns += [client, server]
            for a, b, up in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(a, b, up), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(65536):
                if up:
                    with self._lock:
                        self.sent += 1
                        hit = self.sent == self.cut_at
                        if hit:
                            self.was_cut.set()
                            conns = self._detach()
                    if hit:
                        self._break(conns)
                        return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def disarm(self) -> bool:
        """No cut at ``cut_at`` from now on; whether it happened already."""
        with self._lock:
            self.cut_at = None
            return self.was_cut.is_set()

    def cut(self) -> None:
        """Refuse new connections and break every open one."""
        with self._lock:
            conns = self._detach()
        self._break(conns)

    def _detach(self) -> list[socket.socket]:
        if self._listener is not None:
            with contextlib.suppress(OSError):  # wakes the accepting thread (Linux)
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        conns, self._conns = self._conns, []
        return conns

    @staticmethod
    def _break(conns: list[socket.socket]) -> None:
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def restore(self) -> None:
        self.start()

    def __enter__(self) -> Proxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cut()
