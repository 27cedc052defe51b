"""The `pgwork` command: run, migrate, psql, status, dlq, channel, cleanup, web. One module per
command (its printing included); ``common`` holds what they share, ``main`` the parser."""

from __future__ import annotations

from .main import build_parser, main

__all__ = ["build_parser", "main"]
