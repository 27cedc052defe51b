"""`pgwork web`: the web page on its own."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import anyio

from .. import db, logs
from ..config import Config
from ..secrets import Secrets
from .common import (
    Database,
    with_conn,
)


def cmd_web(args: argparse.Namespace, cfg: Config) -> int:
    """Serve the operator's page until SIGINT or SIGTERM."""
    import signal

    from .. import web

    if args.listen:
        from ..config import check_listen

        check_listen("--listen", args.listen)
        cfg = replace(cfg, web_listen=args.listen)
    logs.add_secrets(Secrets.from_config(cfg))
    database = Database(cfg)

    async def main() -> None:
        pool = db.make_pool(database.dsn, 2, cfg.connect_timeout, pooled=database.pooled)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with pool, anyio.create_task_group() as tg:
                at = await tg.start(web.serve, pool, cfg)
                actions = "actions need web.token" if cfg.web_token else "read-only (no web.token)"
                print(f"pgwork web on http://{at}/ ({actions}); Ctrl-C stops", file=sys.stderr)
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    break

    try:
        with_conn(database.dsn, db.check_schema, database.pooled)  # a clear error, exit 3 or 2
        anyio.run(main)
    finally:
        database.close()
    return 0
