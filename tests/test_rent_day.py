"""Rent day (issue 27, the study's scale case): many monthly series due at one local instant,
three daemon processes, and the daemon making their occurrences killed with SIGKILL in the
middle of the crunch. Every occurrence is made before its instant, none for the next month,
and each is sent exactly once (the kill lands before any send is due, so no request was out).

Real processes, a real HTTP receiver, real time: the series' deadline is half a minute ahead."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

from .helpers import rows, until
from .processes import DaemonProcess, hook, toml
from .receiver import Receiver

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SERIES = 15_000
LOOKAHEAD = 8  # seconds: the crunch starts this long before the deadline


def _sockets(pid: int) -> set[int]:
    """The inodes of a process's sockets."""
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
        except OSError:
            continue
        if m:
            out.add(int(m.group(1)))
    return out


def _local_port_inodes() -> dict[int, int]:
    """Local TCP port -> socket inode, for this machine's IPv4 and IPv6 sockets."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            out[int(f[1].rsplit(":", 1)[1], 16)] = int(f[9])
    return out


async def _materialising(
    conn: psycopg.AsyncConnection[Any], daemons: list[DaemonProcess]
) -> DaemonProcess | None:
    """The daemon whose connection is running a materialiser page now, if one is."""
    found = await rows(
        conn,
        "SELECT client_port FROM pg_stat_activity WHERE state = 'active' "
        "AND query LIKE '%materialise_page%' AND pid <> pg_backend_pid()",
    )
    inodes = _local_port_inodes()
    for r in found:
        inode = inodes.get(r["client_port"])
        for d in daemons:
            if inode is not None and d.proc.poll() is None and inode in _sockets(d.proc.pid):
                return d
    return None


async def test_rent_day_three_daemons_one_killed_mid_crunch(
    dsn: str, conn: psycopg.AsyncConnection[Any], procs: Any
) -> None:
    with Receiver() as receiver:
        config = toml(channel=hook(receiver.url, concurrency=32)).replace(
            'lookahead = "0s"', f'lookahead = "{LOOKAHEAD}s"\npage_size = 500'
        )
        daemons = [procs(dsn, config) for _ in range(3)]
        # The deadline: 30 s ahead in Berlin, to the second; the rule takes its day of the
        # month and its time of day from it.
        first = (
            await rows(
                conn,
                "SELECT date_trunc('second', now() AT TIME ZONE 'Europe/Berlin') "
                "+ interval '30 seconds' AS t",
            )
        )[0]["t"]
        for start in range(0, SERIES, 1000):
            await conn.execute(
                "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, "
                "channel, recipient) SELECT 'rent', 'flat-' || g, %s, 'Europe/Berlin', "
                "'FREQ=MONTHLY', 'hook', 'r' FROM generate_series(%s::int, %s::int) g",
                (first, start + 1, min(start + 1000, SERIES)),
            )
        deadline = (
            await rows(conn, "SELECT pgwork.local_to_instant(%s, 'Europe/Berlin') AS t", (first,))
        )[0]["t"]
        made = (await rows(conn, "SELECT count(*) AS n FROM pgwork.renewal_work"))[0]["n"]
        assert made == 0, "occurrences were made before the look-ahead reached them"

        # The crunch: as soon as occurrences appear, kill the daemon making them.
        killed: DaemonProcess | None = None
        made_at_kill = 0
        with anyio.fail_after(LOOKAHEAD + 60):
            while killed is None:
                made = (await rows(conn, "SELECT count(*) AS n FROM pgwork.renewal_work"))[0]["n"]
                if made:
                    killed = await _materialising(conn, daemons)
                    if killed is not None:
                        killed.proc.send_signal(signal.SIGKILL)
                        killed.wait(10)
                        made_at_kill = (
                            await rows(conn, "SELECT count(*) AS n FROM pgwork.renewal_work")
                        )[0]["n"]
                await anyio.sleep(0.005)
        assert 0 < made_at_kill < SERIES, (made_at_kill, "the kill was not during the crunch")
        sent_at_kill = len(receiver.keys())

        async def all_delivered() -> bool:
            got = await rows(
                conn, "SELECT count(*) AS n FROM pgwork.renewal_work WHERE status = 'delivered'"
            )
            return bool(got[0]["n"] == SERIES)

        await until(all_delivered, timeout=180, what=f"{SERIES} delivered")
        keys = receiver.keys()

    assert sent_at_kill == 0  # nothing was due yet: no request was out when the daemon died
    made_late = await rows(
        conn,
        "SELECT count(*) AS n FROM pgwork.renewal_work WHERE created_at >= deadline "
        "OR deadline <> %s OR deadline_local <> %s",
        (deadline, first),
    )
    assert made_late[0]["n"] == 0  # each made before its instant, and none for next month
    ids = await rows(
        conn,
        "SELECT count(*) AS n, count(DISTINCT operation_id) AS keys, "
        "count(DISTINCT reminder_id) AS series FROM pgwork.renewal_work",
    )
    assert ids[0] == {"n": SERIES, "keys": SERIES, "series": SERIES}
    assert len(keys) == SERIES and set(keys.values()) == {1}  # each sent exactly once
    nxt = await rows(
        conn,
        "SELECT min(next_fire_at) AS lo FROM pgwork.reminder WHERE source = 'rent'",
    )
    # Each series moved on to next month (or a probe before it), past this deadline.
    assert nxt[0]["lo"] > deadline
    assert killed is not None and killed.proc.returncode == -signal.SIGKILL
