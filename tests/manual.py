"""The manual is tested: every shell, SQL, TOML, JSON, YAML and Python block of README.md and
docs/*.md runs in ``make test`` (collected by the root ``conftest.py``).

Sybil parses the Markdown and gives each block a pytest item (``README.md::line:49,column:1``);
the evaluators below are pgwork's. Why Sybil: tried on these files, pytest-markdown-docs collects
only the two Python fences and pytest-codeblocks the Python and shell ones, each shell block a
separate process with nothing set up; neither runs SQL, which is most of what the manual shows.
Sybil runs blocks in document order with one namespace per document and lets a language have
its own evaluator, and its ``<!-- skip: next "reason" -->`` mark names why a block cannot run
here (``tests/test_manual_marks.py`` counts the marks).

Each document gets its own PostgreSQL server (the embedded one, or ``PGWORK_TEST_PGBIN``'s),
started at its first block that needs one, with libpq's variables pointing at it (``PGHOST``,
``PGPORT``, ``PGUSER``: a superuser, as an operator pasting into ``psql``). Unless the document
sets its server up itself (``SETS_UP_ITS_OWN_SERVER``: the production set-up), the database
``manual`` is migrated by ``pgwork migrate`` and holds the channels the manual's examples name,
as a daemon's config would have registered them; ``PGWORK_DSN`` points at it.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sybil import Example, Sybil
from sybil.parsers.markdown import CodeBlockParser, SkipParser

from pgwork import config
from pgwork.embedded import LocalServer

from .helpers import FAST_SETTINGS

ROOT = Path(__file__).resolve().parent.parent

#: Documents whose blocks create their own roles and database and run ``pgwork migrate``
#: themselves: their server starts empty.
SETS_UP_ITS_OWN_SERVER = {"docs/operations.md"}

#: The channels the manual's examples schedule for (a daemon's config registers them).
CHANNELS = [("log", "log"), ("crm", "webhook"), ("email", "log"), ("webhook-crm", "webhook")]

BLOCK_TIMEOUT = 60.0


@dataclass
class Manual:
    """One document's server and the environment its blocks run in."""

    document: str
    workdir: Path
    server: LocalServer | None = None
    env: dict[str, str] = field(default_factory=dict)

    def ready(self) -> dict[str, str]:
        """Start the document's server (once) and return the environment for its blocks."""
        if self.server is not None:
            return self.env
        bin_dir = os.environ.get("PGWORK_TEST_PGBIN")
        self.server = LocalServer(
            self.workdir / "pgdata", Path(bin_dir) if bin_dir else None, settings=FAST_SETTINGS
        )
        port = self.server.start()
        bindir = Path(sys.executable).parent
        path = f"{bindir}:{self.server.psql_path().parent}:{os.environ.get('PATH', '')}"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("PG", "PGWORK_"))},
            "PATH": path,
            "PGHOST": "127.0.0.1",
            "PGPORT": str(port),
            "PGUSER": "postgres",
            "PGDATABASE": "postgres",
            "PSQLRC": "/dev/null",
        }
        if self.document not in SETS_UP_ITS_OWN_SERVER:
            self._run(["psql", "-X", "-q", "-c", "CREATE DATABASE manual"])
            self.env["PGDATABASE"] = "manual"
            self.env["PGWORK_DSN"] = "dbname=manual"
            self._run(["pgwork", "migrate"])
            values = ", ".join(f"('{n}', '{k}')" for n, k in CHANNELS)
            self._run(
                [
                    "psql",
                    "-X",
                    "-q",
                    "-c",
                    f"INSERT INTO pgwork.channel (name, kind) VALUES {values}",
                ]
            )
        return self.env

    def _run(self, argv: list[str], stdin: str | None = None) -> str:
        r = subprocess.run(
            argv,
            input=stdin,
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.workdir,
            timeout=BLOCK_TIMEOUT,
        )
        if r.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {r.returncode}\n--- stdout\n{r.stdout}--- stderr\n{r.stderr}"
            )
        return r.stdout

    def close(self) -> None:
        if self.server is not None:
            self.server.destroy()


@pytest.fixture(scope="module")
def manual(request: pytest.FixtureRequest) -> Iterator[Manual]:
    document = Path(str(request.node.path)).resolve().relative_to(ROOT).as_posix()
    workdir = Path(tempfile.mkdtemp(prefix="pgwork-manual-"))
    os.chmod(workdir, 0o755)
    m = Manual(document, workdir)
    try:
        yield m
    finally:
        m.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _manual(example: Example) -> Manual:
    m: Manual = example.namespace["manual"]
    return m


def run_sql(example: Example) -> None:
    """As pasted into psql: stop at the first error."""
    m = _manual(example)
    m.ready()
    m._run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-f", "-"], stdin=example.parsed)


def run_shell(example: Example) -> None:
    m = _manual(example)
    m.ready()
    m._run(["bash", "-euo", "pipefail", "-c", example.parsed])


def check_toml(example: Example) -> None:
    """A configuration example is one pgwork accepts (secrets may be unset: nothing is sent)."""
    path = _manual(example).workdir / "example.toml"
    path.write_text(example.parsed)
    try:
        config.load(path, env={}, secrets=False)
    except config.ConfigError as e:
        raise AssertionError(f"pgwork refuses this configuration: {e}") from None


def check_json(example: Example) -> None:
    json.loads(example.parsed)


def check_yaml(example: Example) -> None:
    """A Prometheus scrape configuration that promtool accepts."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (.ci/run installs it)")
    path = _manual(example).workdir / "prometheus.yml"
    path.write_text(example.parsed)
    r = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def check_python(example: Example) -> None:
    """A sketch around the reader's own code: it compiles, and what it imports exists."""
    tree = ast.parse(example.parsed)
    imports: list[ast.stmt] = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=imports, type_ignores=[]), "<manual>", "exec"), namespace)


def _parsers() -> list[Any]:
    return [
        SkipParser(),
        CodeBlockParser("sql", run_sql),
        CodeBlockParser("bash", run_shell),
        CodeBlockParser("toml", check_toml),
        CodeBlockParser("json", check_json),
        CodeBlockParser("yaml", check_yaml),
        CodeBlockParser("python", check_python),
    ]


def collector() -> Any:
    """The root conftest's ``pytest_collect_file``: README.md and docs/*.md."""
    readme = Sybil(
        _parsers(), path=str(ROOT), patterns=["README.md"], excludes=["*/*"], fixtures=["manual"]
    )
    docs = Sybil(_parsers(), path=str(ROOT / "docs"), patterns=["*.md"], fixtures=["manual"])
    return (readme + docs).pytest()
