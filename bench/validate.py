"""Check that a bench run produced well-formed results (CI runs this after `make bench-smoke`).
It asserts that the harness works, never a speed: ``python -m bench.validate DIR_OR_FILE``."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from .run import ORDER


def validate(path: Path) -> list[str]:
    doc = json.loads(path.read_text())
    problems = []
    for key in ("when", "postgres", "settings", "cores", "pgwork", "sizes"):
        if key not in doc.get("meta", {}):
            problems.append(f"meta.{key} missing")
    settings = doc.get("meta", {}).get("settings", {})
    if settings.get("fsync") != "on" or settings.get("synchronous_commit") != "on":
        problems.append("not measured at durable settings (fsync and synchronous_commit on)")
    seen = {r["workload"] for r in doc.get("results", [])}
    for name in ORDER:
        if name not in seen:
            problems.append(f"workload {name} produced no result")
    for r in doc.get("results", []):
        for k, v in r.items():
            if isinstance(v, float) and not math.isfinite(v):
                problems.append(f"{r['workload']}.{k} is {v}")
    if not doc.get("summary"):
        problems.append("no summary table")
    return problems


def main() -> int:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "results"
    files = sorted(target.glob("*.json")) if target.is_dir() else [target]
    if not files:
        print(f"no results in {target}")
        return 1
    problems = validate(files[-1])
    for p in problems:
        print(f"{files[-1].name}: {p}")
    print(f"{files[-1].name}: {'well-formed' if not problems else 'MALFORMED'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
