"""pgwork: business deadlines in Postgres become exactly one delivered reminder each."""

from __future__ import annotations

__version__ = "0.1.0"

#: The schema version this code expects and `pgwork migrate` writes (``pgwork.schema_version``):
#: written here only. The tables are ``schema.sql`` and ``sql/migrations/``; the code ``sql/code/``.
SCHEMA_VERSION = 28
