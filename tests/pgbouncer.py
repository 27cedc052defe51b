"""A real PgBouncer in transaction-pooling mode in front of the test server (Debian's
``pgbouncer`` package; `.ci/run` installs it). Tests that need it skip, saying why, where it is
not installed."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgwork.embedded import SERVER_USER, _ensure_user, _free_port

BINARY = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


class PgBouncer:
    """``pool_mode = transaction``, every database of the upstream server, trust auth."""

    def __init__(self, upstream_dsn: str, workdir: Path) -> None:
        up = conninfo_to_dict(upstream_dsn)
        self.user = str(up.get("user") or "postgres")
        self.port = _free_port()
        self.dir = workdir
        (workdir / "users.txt").write_text(f'"{self.user}" ""\n')
        (workdir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={up.get('host', '127.0.0.1')} port={up.get('port', 5432)}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {workdir / 'users.txt'}\n"
            "pool_mode = transaction\n"
            "max_client_conn = 1000\n"
            # Fewer server connections than pgwork has clients: they are shared, as in production.
            "default_pool_size = 4\n"
            f"logfile = {workdir / 'pgbouncer.log'}\n"
            f"pidfile = {workdir / 'pgbouncer.pid'}\n"
            # psycopg sends none of these; listed so that a libpq default never trips it.
            "ignore_startup_parameters = extra_float_digits\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # PgBouncer refuses to run as root: it runs as the embedded server's user.
        args = [BINARY]
        if os.geteuid() == 0:
            _ensure_user()
            os.chmod(self.dir, 0o777)
            for f in self.dir.iterdir():
                os.chmod(f, 0o666)
            args += ["-u", SERVER_USER]
        self.proc = subprocess.Popen(
            [*args, str(self.dir / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited: {self.log()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"pgbouncer did not listen: {self.log()[-2000:]}")

    def log(self) -> str:
        path = self.dir / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def dsn(self, direct_dsn: str) -> str:
        """``direct_dsn``'s database and user, through this PgBouncer."""
        return make_conninfo(direct_dsn, host="127.0.0.1", port=str(self.port))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture(scope="session")
def pgbouncer(admin_dsn: str) -> Iterator[PgBouncer]:
    if not os.path.exists(BINARY):
        pytest.skip("pgbouncer is not installed (Debian package pgbouncer; .ci/run installs it)")
    tmp = Path(tempfile.mkdtemp(prefix="pgwork-pgbouncer-"))
    bouncer = PgBouncer(admin_dsn, tmp)
    try:
        bouncer.start()
        yield bouncer
    finally:
        bouncer.stop()
        shutil.rmtree(tmp, ignore_errors=True)
