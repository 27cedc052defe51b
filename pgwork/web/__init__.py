"""`pgwork web`: a small read-mostly page for operators — overview, a channel's rows, one row with
its attempt ledger, a reminder's story, the dead letters — and a few actions (redrive, pause,
resume), each needing the configured ``web.token``.

Safe by default: it binds to 127.0.0.1; every value is HTML-escaped and a
Content-Security-Policy forbids scripts outright; business keys and recipients follow
``log.redact``. Server-rendered HTML, no JavaScript, nothing fetched from elsewhere.

The package: ``app`` (routes, the handlers, ``serve``), ``auth`` (sign-in and CSRF), ``views``
(what each page shows, built from ``store`` calls), ``html`` (drawing a view), ``chart`` (a
channel's trend as inline SVG)."""

from __future__ import annotations

from .app import WebApp, serve

__all__ = ["WebApp", "serve"]
