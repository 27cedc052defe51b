"""Typed access to every statement pgwork runs: one function per statement, keyword parameters,
rows as frozen dataclasses. Callers never pass a statement name or read an untyped dict, so mypy
checks every call and a renamed column fails at its first use, naming the field.

The statements live in ``pgwork/sql/queries/``, a file per room; each room's bindings are the
module of the same name here (a house rule: tests/test_schema.py::
test_every_statement_is_bound_in_its_own_room). ``store.NAME`` reaches any of them."""

from __future__ import annotations

from ._bind import *  # noqa: F403
from .daemons import *  # noqa: F403
from .delivery import *  # noqa: F403
from .gauges import *  # noqa: F403
from .inspect import *  # noqa: F403
from .materialise import *  # noqa: F403
from .retention import *  # noqa: F403
from .schema import *  # noqa: F403
from .server import *  # noqa: F403
from .trends import *  # noqa: F403
