"""The database crashes while a request is on its way to the receiver (issue 26): its own
server, killed with an immediate stop (every backend gone, nothing flushed that was not flushed
already) the moment the request arrives, then started again.

With ``database.synchronous_claims`` the claim behind the request survives the crash, so the
attempt ledger has a row for every request the receiver got. Without it a claim committed a
moment before the crash can vanish with it: the row is claimed again and sent again, under the
same idempotency key; the ledger then has fewer rows than the receiver saw requests (the
docs/how-it-works.md, "Durability", says so). Both: nothing lost, one key per occurrence."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgwork import db, migration
from pgwork.embedded import LocalServer

from .helpers import config, running, until, webhook_channel
from .receiver import Answer, Receiver, Request

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture
def server() -> Iterator[LocalServer]:
    root = Path(tempfile.mkdtemp(prefix="pgwork-crash-"))
    root.chmod(0o755)
    pgbin = os.environ.get("PGWORK_TEST_PGBIN")
    s = LocalServer(
        root / "data",
        Path(pgbin) if pgbin else None,
        # fsync off is safe for a process crash (what was written reaches the OS); the WAL
        # writer is slowed so an asynchronous commit stays in the server's memory until the
        # next synchronous one, as it can on a busy server.
        settings={"fsync": "off", "wal_writer_delay": "10s", "max_connections": "50"},
    )
    try:
        s.start()
        yield s
    finally:
        s.destroy()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize(
    ("synchronous", "limited"),
    [(True, False), (True, True), (False, False)],
    # A channel with a rate limit is claimed by claim_work alone; without one, the
    # materialiser's page claims the row it makes (one hop): both commit synchronously.
    ids=["synchronous-page", "synchronous-claim", "asynchronous"],
)
async def test_a_database_crash_while_a_request_is_out(
    server: LocalServer, synchronous: bool, limited: bool
) -> None:
    with psycopg.connect(server.dsn(), autocommit=True) as setup:
        setup.execute("CREATE DATABASE app")
    dsn = server.dsn("app")
    async with await db.connect(dsn) as c:
        await migration.migrate(c)
    crashed = threading.Event()

    def script(r: Request) -> Answer:
        if not crashed.is_set():
            crashed.set()
            port = server.port
            server.stop("immediate")
            server.start(port)
        return Answer()

    with Receiver(script) as receiver:
        hook = webhook_channel(
            receiver.url,
            read_timeout=60,
            attempt_timeout=90,
            rate_limit=1000.0 if limited else None,
            rate_burst=1000.0 if limited else None,
        )
        cfg = config(hook, connect_timeout=1.0, lease=3.0, synchronous_claims=synchronous)
        async with running(cfg, dsn):
            with psycopg.connect(dsn, autocommit=True) as app:
                app.execute(
                    "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, "
                    "recipient) VALUES ('app', 'k', now(), 'hook', 'r')"
                )

            async def delivered() -> bool:
                try:
                    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as a:
                        cur = await a.execute("SELECT status FROM pgwork.renewal_work")
                        row = await cur.fetchone()
                except psycopg.OperationalError:
                    return False  # the server is starting again
                return row is not None and row[0] == "delivered"

            await until(delivered, timeout=60, what="delivered after the crash")
    with psycopg.connect(dsn, autocommit=True) as check:
        ledger: list[Any] = check.execute(
            "SELECT lease, outcome FROM pgwork.attempt ORDER BY lease, started_at"
        ).fetchall()
    requests = receiver.requests
    assert crashed.is_set()
    assert len({r.key for r in requests}) == 1, "one occurrence, one idempotency key"
    sent = [x for x in ledger if x[1] in ("delivered", "retry", "failed")]
    if synchronous:
        # Every request the receiver got is in the ledger.
        assert len(sent) == len(requests), (ledger, len(requests))
    else:
        assert 1 <= len(sent) <= len(requests), (ledger, len(requests))
    assert ledger[-1][1] == "delivered"
