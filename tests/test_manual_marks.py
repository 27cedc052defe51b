"""The manual's blocks run in ``make test`` (tests/manual.py); this keeps the exceptions few and
named, and no block's language silently unrun."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

#: Fences the runner executes or checks (tests/manual.py), and those that are not code: a
#: diagram, a sample of output (no language).
RUN = {"sql", "bash", "toml", "json", "yaml", "python"}
NOT_CODE = {"", "mermaid", "text"}

#: Blocks that cannot run here, each marked with its reason; keep this small.
MAX_MARKS = 8


def test_every_block_is_run_or_is_not_code() -> None:
    unknown = [
        f"{page.relative_to(ROOT)}:{n}: ```{lang}"
        for page in PAGES
        for n, lang in _fences(page)
        if lang not in RUN | NOT_CODE
    ]
    assert not unknown, "give these a language tests/manual.py runs, or say they are text"


def test_blocks_that_cannot_run_are_few_and_say_why() -> None:
    marks = [
        (page.relative_to(ROOT), m.group(1))
        for page in PAGES
        for m in re.finditer(r"<!--\s*skip:\s*(.*?)\s*-->", page.read_text(), re.DOTALL)
    ]
    assert marks, "the count below would not be checking anything"
    for page, arguments in marks:
        assert re.fullmatch(r'next "[^"]{10,}"', arguments), (
            f"{page}: {arguments!r} gives no reason"
        )
    assert len(marks) <= MAX_MARKS, marks


def _fences(page: Path) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    inside = False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        m = re.match(r"^```(\S*)", line)
        if m is None:
            continue
        if not inside:
            out.append((n, m.group(1)))
        inside = not inside
    return out
