"""The manual's blocks (README.md, docs/*.md) are tests: see tests/manual.py."""

from __future__ import annotations

from tests.manual import collector, manual  # noqa: F401  (the per-document fixture)

pytest_collect_file = collector()
