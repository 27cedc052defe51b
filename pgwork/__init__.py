"""pgwork: business deadlines in Postgres become exactly one delivered reminder each."""

from __future__ import annotations

__version__ = "0.1.0"

#: The schema version this code expects (``pgwork.schema_version``); see ``schema.sql``.
SCHEMA_VERSION = 14
