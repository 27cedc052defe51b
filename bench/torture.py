"""The nemesis for as long as it is told: random schedules against real daemons, a real
receiver and a real PostgreSQL (tests/properties/), one after another, with a report.

    python -m bench.torture --minutes 60                 # random seeds for an hour
    python -m bench.torture --seed 1234                  # one schedule again
    python -m bench.torture --seed 1234 --shrink         # ... and shrink it if it fails
    python -m bench.torture --minutes 60 --pgbin /usr/lib/postgresql/15/bin

Each run's figures go to ``--out`` (JSON lines, default bench/results/torture-<time>.jsonl); the
summary at the end says how many schedules ran, faults were injected, edits were made and
violations were found, and the worst lateness of another app's reminder beside a flood, with
the seed that produced it. A failing seed is printed with its schedule (shrunk with
``--shrink``), as the Python of a regular test."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from tests.properties.driver import nemesis_server, run, shrink
from tests.properties.schedule import generate
from tests.properties.world import describe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.torture", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=0.0, help="run random seeds this long")
    p.add_argument("--seed", type=int, action="append", help="run this seed (repeatable)")
    p.add_argument("--family", choices=("load", "faults"), help="only schedules of this family")
    p.add_argument("--small", action="store_true", help="floods up to 20,000 (a quick run)")
    p.add_argument("--shrink", action="store_true", help="shrink a failing schedule")
    p.add_argument("--pgbin", type=Path, help="PostgreSQL's bin directory (default: embedded)")
    p.add_argument("--out", type=Path, help="JSON lines of every run")
    a = p.parse_args(argv)
    out = a.out or Path("bench/results") / time.strftime("torture-%Y%m%d-%H%M%S.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    seeds = list(a.seed or [])
    rnd = random.Random()
    until = time.monotonic() + a.minutes * 60
    runs: list[dict[str, Any]] = []
    failed: list[int] = []
    with nemesis_server(a.pgbin) as server, out.open("a") as sink:
        version = server.server_version()
        while seeds or time.monotonic() < until:
            seed = seeds.pop(0) if seeds else rnd.randrange(2**31)
            schedule = generate(seed, a.family, big=not a.small)
            rec = run(schedule, server)
            row = describe(rec) | {"postgres": version}
            runs.append(row)
            sink.write(json.dumps(row, default=str) + "\n")
            sink.flush()
            tag = "FAIL" if rec.violations else "ok"
            late = row["worst_probe_lateness_s"]
            print(
                f"{tag:4} seed {seed} {schedule.family:6} {row['seconds']:5.1f}s "
                f"edits {row['edits']} faults {len(row['faults'])} requests {row['requests']}"
                + (f" worst probe {late:.2f}s" if late is not None else ""),
                flush=True,
            )
            if rec.violations:
                failed.append(seed)
                for v in rec.violations:
                    print("   ", v[:1500], flush=True)
                print("    notes:", "; ".join(rec.notes), flush=True)
                small = schedule
                if a.shrink:
                    small = shrink(schedule, server, say=lambda s: print("   ", s, flush=True))
                print(f"    schedule of seed {seed}:\n    {small.code()}", flush=True)
    _summary(runs, failed, out)
    return 1 if failed else 0


def _summary(runs: list[dict[str, Any]], failed: list[int], out: Path) -> None:
    late = [r for r in runs if r["worst_probe_lateness_s"] is not None]
    worst = max(late, key=lambda r: r["worst_probe_lateness_s"], default=None)
    print(
        f"\n{len(runs)} schedules ({sum(r['family'] == 'load' for r in runs)} load, "
        f"{sum(r['family'] == 'faults' for r in runs)} faults), "
        f"{sum(len(r['faults']) for r in runs)} faults injected, "
        f"{sum(r['edits'] for r in runs)} edits made "
        f"({sum(r['edits_at_their_point'] for r in runs)} at their point of a send's life), "
        f"{sum(len(r['violations']) for r in runs)} violations"
        + (f" (seeds {', '.join(map(str, failed))})" if failed else "")
    )
    if worst is not None:
        print(
            f"worst lateness of another app's reminder: {worst['worst_probe_lateness_s']:.2f}s "
            f"(seed {worst['seed']}, {worst['knobs']})"
        )
    print(f"runs: {out}")


if __name__ == "__main__":
    sys.exit(main())
