"""Running schedules one after another on one nemesis server, and shrinking a failing one."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio

from .schedule import Schedule, shrinks
from .world import NemesisServer, Record, World


@contextmanager
def nemesis_server(pgbin: Path | None = None) -> Iterator[NemesisServer]:
    """A server of the nemesis' own, removed afterwards whatever happened."""
    root = Path(tempfile.mkdtemp(prefix="pgwork-nemesis-"))
    server = NemesisServer(root, pgbin)
    try:
        server.start()
        yield server
    finally:
        server.destroy()
        shutil.rmtree(root, ignore_errors=True)


def run(schedule: Schedule, server: NemesisServer) -> Record:
    """One schedule, start to end (its daemons' logs in a directory removed afterwards unless
    it failed: then the record's notes name it)."""
    work = Path(tempfile.mkdtemp(prefix=f"pgwork-nemesis-{schedule.seed}-"))
    rec = anyio.run(World(schedule, server, work).run)
    if rec.violations:
        rec.notes.append(f"daemon logs in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return rec


def shrink(
    failing: Schedule,
    server: NemesisServer,
    *,
    budget: float = 600.0,
    tries: int = 2,
    say: Callable[[str], None] = lambda _: None,
) -> Schedule:
    """A smaller schedule that still fails: each candidate of ``shrinks`` is run (up to
    ``tries`` times: a timing may need another go) and the first that fails is kept and shrunk
    again, until none fails or ``budget`` seconds are spent. Each run is seconds of real
    processes, which is why this is a greedy walk and not Hypothesis' shrinker."""
    best = failing
    deadline = time.monotonic() + budget
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for candidate in shrinks(best):
            if time.monotonic() >= deadline:
                break
            for _ in range(tries):
                if run(candidate, server).violations:
                    best = candidate
                    improved = True
                    say(f"shrunk to {len(best.steps)} steps")
                    break
            if improved:
                break
    return best
