"""The benchmark harness's own measuring parts, where a wrong reading would pass unnoticed as a
figure (bench/README.md quotes them)."""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg

from bench.run import postmaster_of


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return int(data[data.rfind(b")") + 2 :].split()[1])


def test_the_postmaster_is_found_on_every_call(admin_dsn: str) -> None:
    """The CPU split meters the postmaster's children; without its pid, Postgres's share reads
    as 0.0 cores. The pid comes from a backend's parent, read while that backend lives: read
    after the connection closed, the backend had sometimes exited, and on a busy machine (the
    bench's, and this test's: a busy process per core) most runs of 200 calls got a None."""
    with psycopg.connect(admin_dsn) as c:
        row = c.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        postmaster = _parent_of(row[0])
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        found = [postmaster_of(admin_dsn) for _ in range(200)]
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert found == [postmaster] * 200
