"""Failover: a primary and a streaming standby built from the same PostgreSQL binaries as the
other tests, two daemon processes on a multi-host DSN (target_session_attrs=read-write), an app
inserting reminders all along; the primary is killed (immediate) and the standby promoted.
Synchronous replication: every reminder whose INSERT was acknowledged is delivered. Both modes:
no occurrence gets two different idempotency keys, and a repeated request carries the same key."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

from pgwork import db, migration
from pgwork.embedded import LocalServer

from .helpers import until
from .processes import hook, toml
from .receiver import Receiver

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SETTINGS = {
    "wal_level": "replica",
    "max_wal_senders": "5",
    "fsync": "off",
    "full_page_writes": "off",
    "max_connections": "100",
}


class Pair:
    """A primary and a streaming standby of it."""

    def __init__(self, root: Path, synchronous: bool, bin_dir: Path | None) -> None:
        settings = dict(SETTINGS)
        if synchronous:
            # pg_basebackup -R names the standby's connection "walreceiver".
            settings["synchronous_standby_names"] = "walreceiver"
        self.primary = LocalServer(root / "primary", bin_dir, settings=settings)
        self.standby = LocalServer(root / "standby", bin_dir, settings=dict(SETTINGS))

    def start(self) -> None:
        p = self.primary
        p.start()
        self.standby._prepare_dirs()
        r = p._run(
            "pg_basebackup",
            "-D",
            str(self.standby.data_dir),
            "-h",
            "127.0.0.1",
            "-p",
            str(p.port),
            "-U",
            "postgres",
            "-X",
            "stream",
            "-R",
        )
        assert r.returncode == 0, r.stderr
        self.standby.start()

    def dsn(self, dbname: str) -> str:
        return (
            f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} "
            f"user=postgres dbname={dbname} target_session_attrs=read-write"
        )

    def fail_over(self) -> None:
        self.primary.stop("immediate")
        r = self.standby._run("pg_ctl", "-D", str(self.standby.data_dir), "-w", "promote")
        assert r.returncode == 0, r.stderr

    def destroy(self) -> None:
        self.primary.destroy()
        self.standby.destroy()


@pytest.fixture
def pair_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="pgwork-failover-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("synchronous", [True, False], ids=["sync", "async"])
async def test_failover_loses_no_acknowledged_reminder(
    pair_root: Path, procs: Any, synchronous: bool
) -> None:
    import os

    pgbin = os.environ.get("PGWORK_TEST_PGBIN")
    pair = Pair(pair_root, synchronous, Path(pgbin) if pgbin else None)
    try:
        pair.start()
        admin = pair.primary.dsn()
        with psycopg.connect(admin, autocommit=True) as setup:
            setup.execute("CREATE DATABASE app")
        dsn = pair.dsn("app")
        async with await db.connect(dsn) as c:
            await migration.migrate(c)
        with Receiver() as receiver:
            cfg = toml(channel=hook(receiver.url, concurrency=4), lease="2s")
            for _ in range(2):
                procs(dsn, cfg)
            acked: list[str] = []
            acked_at: dict[str, float] = {}
            stop = threading.Event()

            def app() -> None:
                """An app inserting one reminder due now every 20 ms, reconnecting through
                the failover like any libpq client with a multi-host DSN."""
                n = 0
                conn: psycopg.Connection[Any] | None = None
                while not stop.is_set():
                    try:
                        if conn is None or conn.closed:
                            conn = psycopg.connect(dsn, autocommit=True, connect_timeout=2)
                        n += 1
                        conn.execute(
                            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, "
                            "recipient) VALUES ('app', %s, now(), 'hook', 'r')",
                            (f"k{n}",),
                        )
                        acked.append(f"k{n}")
                        acked_at[f"k{n}"] = time.time()
                    except psycopg.Error:
                        conn = None
                        time.sleep(0.1)
                    time.sleep(0.02)
                if conn is not None:
                    conn.close()

            writer = threading.Thread(target=app, daemon=True)
            writer.start()
            await anyio.sleep(3)
            before = len(acked)
            t0 = time.time()
            pair.fail_over()
            promoted = time.time()
            await anyio.sleep(6)
            stop.set()
            writer.join(10)
            assert len(acked) > before + 50, "the app did not write through the failover"
            wanted = set(acked)

            def delivered() -> set[str]:
                return {r.body["business_key"] for r in list(receiver.requests)}

            async def all_delivered() -> bool:
                return wanted <= delivered()

            with contextlib.suppress(AssertionError):  # judged below, by mode
                await until(all_delivered, timeout=60, what="every acknowledged reminder")
            got = delivered()
            # Deliveries of reminders written after the promotion: how soon the daemons and the
            # app work again on the new primary.
            after = [
                r.at - promoted
                for r in list(receiver.requests)
                if acked_at.get(r.body["business_key"], 0) > promoted
            ]
            keys: dict[str, set[str]] = {}
            for r in list(receiver.requests):
                keys.setdefault(r.body["business_key"], set()).add(r.key)
        missing = wanted - got
        print(
            f"failover ({'sync' if synchronous else 'async'}): {len(wanted)} acknowledged, "
            f"{len(missing)} not delivered; the first reminder written after the promotion was "
            f"delivered {min(after, default=-1):.2f}s after it (killed to promoted: "
            f"{promoted - t0:.2f}s)"
        )
        if synchronous:
            assert not missing, f"acknowledged but never delivered: {sorted(missing)[:10]}"
        else:
            # Asynchronous replication may lose what the primary acknowledged but had not yet
            # streamed; docs/operations.md (Failover) says which losses that allows. Anything that survived is
            # delivered.
            assert len(missing) <= len(wanted) // 10, f"{len(missing)} lost"
        # One occurrence, one key: a repeat (an outcome or a claim lost with the primary) is
        # the same request again.
        assert all(len(k) == 1 for k in keys.values())
        assert after and min(after) < 10, "nothing written after the failover was delivered"
    finally:
        pair.destroy()
