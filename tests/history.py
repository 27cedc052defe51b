"""Older schemas, built from the repository's history: what a fresh install of version N made,
for the upgrade tests and ``bench/migrate_size.py``. They were kept as snapshots in tests/data
(29,000 lines, most of the tree's repeated code); git already keeps them.

Version N's install is the last commit at N: the parent of the commit that set
``SCHEMA_VERSION = N + 1`` (or the checkout itself, while that commit is not made yet). Its
``schema.sql``, then the files of its ``pgwork/sql/code/`` in its own ``CODE`` order (from
version 14 on), then its version: what that commit's ``pgwork migrate`` applied to an empty
database. Without the history (an archive, a shallow clone), the tests that need it skip.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_VERSION = re.compile(r"^SCHEMA_VERSION = (\d+)", re.MULTILINE)
_CODE = re.compile(r"^CODE = \(([^)]*)\)", re.MULTILINE)


class NoHistory(LookupError):
    """The repository's history is not here, or has no commit at that version."""


def _git(*args: str) -> str:
    r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise NoHistory(f"git {' '.join(args[:2])}: {r.stderr.strip()[:200]}")
    return r.stdout


@functools.cache
def _setters() -> dict[int, str]:
    """The commit that set each schema version."""
    found: dict[int, str] = {}
    log = _git("log", "--format=%H", "-G", "^SCHEMA_VERSION = ", "--", "pgwork/__init__.py")
    for commit in log.split():
        m = _VERSION.search(_git("show", f"{commit}:pgwork/__init__.py"))
        if m:
            found.setdefault(int(m.group(1)), commit)  # the newest first: the last setter
    return found


def commit_at(version: int) -> str:
    """The last commit at ``version``."""
    setters = _setters()
    if version not in setters:
        raise NoHistory(f"no commit set schema version {version} (a shallow clone?)")
    if version + 1 in setters:
        return f"{setters[version + 1]}^"
    return "HEAD"  # the next version is not committed yet


@functools.cache
def fresh_install(version: int) -> str:
    """The SQL a fresh install of ``version`` ran, as one script."""
    commit = commit_at(version)
    parts = [_git("show", f"{commit}:schema.sql")]
    code = _CODE.search(_git("show", f"{commit}:pgwork/queries.py"))
    if code:
        for name in re.findall(r'"(\w+)"', code.group(1)):
            parts.append(_git("show", f"{commit}:pgwork/sql/code/{name}.sql"))
    script = "".join(p if p.endswith("\n") else p + "\n" for p in parts)
    if "INSERT INTO pgwork.schema_version" not in parts[0]:
        script += f"INSERT INTO pgwork.schema_version (version) VALUES ({version});\n"
    return script


def old_schema(version: int) -> str:
    """``fresh_install(version)``, or the calling test skipped, saying why, without the history."""
    import pytest  # here, not at the top: bench.migrate_size imports this module for fresh_install

    try:
        return fresh_install(version)
    except NoHistory as e:
        pytest.skip(f"schema {version} is built from git history, which is not here: {e}")
