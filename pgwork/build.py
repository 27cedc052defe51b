"""Which build of pgwork this is: the release number and a digest of the package's own files.

Every build of a checkout said ``pgwork 0.1.0``, and the step-aside handshake and ``migrate
--wait`` name the daemons by that: after a rolling upgrade the old and the new looked alike. The
digest tells them apart (it changes with any ``.py`` or ``.sql`` file of the package)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from . import __version__

PACKAGE = Path(__file__).resolve().parent


def digest(root: Path = PACKAGE) -> str:
    """Eight hex digits over the relative path and bytes of every ``.py`` and ``.sql`` file
    under ``root``, in path order."""
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".sql") and p.is_file()):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(f.read_bytes() + b"\0")
    return h.hexdigest()[:8]


@functools.cache
def version() -> str:
    """``0.1.0+1a2b3c4d``: the release, and the build's digest as a local version label."""
    return f"{__version__}+{digest()}"
