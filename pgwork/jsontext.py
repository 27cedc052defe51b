"""JSON text kept as stored: an app's payload is shown byte for byte, never through Python's
numbers (a payload's ``0.1000000000000000055511151231257827`` is not Python's ``0.1``)."""

from __future__ import annotations

import json
import secrets
from typing import Any


class JsonText(str):
    """A JSON value as the database wrote it (``jsonb::text``): shown as this text, and written
    into a JSON document as this value, verbatim."""


def dumps(doc: Any, **kw: Any) -> str:
    """``json.dumps`` of ``doc`` with every ``JsonText`` in it written as the JSON it holds."""
    spliced: dict[str, str] = {}
    mark = secrets.token_hex(8)

    def swap(v: Any) -> Any:
        if isinstance(v, JsonText):
            key = f"{mark}:{len(spliced)}"
            spliced[key] = str(v)
            return key
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(doc), **kw)
    for key, raw in spliced.items():
        text = text.replace(json.dumps(key), raw, 1)
    return text
