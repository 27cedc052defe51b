"""``make demo`` (``python -m pgwork.demo``): pgwork delivering to a webhook receiver on this
machine, in one command. An embedded Postgres (data in ``.pgwork/demo``), a daemon with its web
page and metrics, a receiver that verifies each request's signature as an app would, and three
reminders: one the receiver takes at once, one it fails twice before taking (retries with
backoff), one it refuses for good (a dead letter, to see and redrive). ``--once`` stops when the
three have their outcome (the test of this demo); without it, it runs until Ctrl-C.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import secrets
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import psycopg
from aiohttp import web

from . import config as config_mod
from . import db, logs
from .channels.webhook import signing_key

#: The three reminders, by business key, and what the receiver answers each (attempt by attempt).
STORY = {
    "ok:1": "answered 200 at once",
    "flaky:1": "answered 500 twice, then 200: retried with backoff",
    "broken:1": "answered 400: refused for good, a dead letter",
}

CONFIG = """\
# The demo's daemon: one webhook channel to the receiver this demo runs.
[database]
embedded_dir = "{data}"

[channels.demo-hook]
kind = "webhook"
url = "{url}"
signing_secret = "env:PGWORK_DEMO_SECRET"
max_attempts = 3
backoff_base = "1s"
backoff_cap = "2s"

[web]
enabled = true
listen = "127.0.0.1:0"

[metrics]
listen = "127.0.0.1:0"
"""


def say(text: str) -> None:
    print(text, flush=True)


class Receiver:
    """A webhook receiver as an app writes one: verify the signature (Standard Webhooks: HMAC
    over ``id.timestamp.body``), then answer by the reminder's business key."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.tries: Counter[str] = Counter()

    def verified(self, request: web.Request, body: bytes) -> bool:
        msg = f"{request.headers['webhook-id']}.{request.headers['webhook-timestamp']}.".encode()
        want = base64.b64encode(hmac.new(self.key, msg + body, hashlib.sha256).digest()).decode()
        sent = request.headers.get("webhook-signature", "").split()
        return any(hmac.compare_digest(s.removeprefix("v1,"), want) for s in sent)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if not self.verified(request, body):
            say("receiver: a request with a wrong signature: refused (401)")
            return web.Response(status=401)
        key = json.loads(body)["business_key"]
        self.tries[key] += 1
        n = self.tries[key]
        status = (
            400 if key.startswith("broken") else 500 if key.startswith("flaky") and n < 3 else 200
        )
        say(
            f"receiver: {key} attempt {n}, signature verified, idempotency key "
            f"{request.headers['Idempotency-Key']}: answered {status}"
        )
        return web.Response(status=status)


async def _serve_receiver(receiver: Receiver) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/hook"


async def _outcomes(conn: psycopg.AsyncConnection[Any]) -> dict[str, str]:
    cur = await conn.execute(
        "SELECT w.business_key, w.status, w.attempts FROM pgwork.renewal_work w "
        "WHERE w.source = 'demo'"
    )
    return {k: f"{s} after {a} attempt(s)" for k, s, a in await cur.fetchall()}


async def _story(daemon: Any, dsn: str, once: bool, token: str, cfg_file: Path) -> None:
    """Schedule the three reminders once the daemon is ready; tell each outcome."""
    await daemon.ready.wait()
    say(f"\nthe web page: http://{daemon.web_at}/   metrics: http://{daemon.metrics_at}/metrics")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("DELETE FROM pgwork.reminder WHERE source = 'demo'")
        for key in STORY:
            await conn.execute(
                "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
                "VALUES ('demo', %s, now(), 'demo-hook', 'tenant@example.com')",
                (key,),
            )
        say(
            "scheduled three reminders due now: "
            + ", ".join(f"{k} ({v})" for k, v in STORY.items())
        )
        told: dict[str, str] = {}
        while len(told) < len(STORY):
            await anyio.sleep(0.5)
            for key, outcome in sorted((await _outcomes(conn)).items()):
                if told.get(key) != outcome and not outcome.startswith("ready"):
                    told[key] = outcome
                    say(f"outcome: {key} {outcome}")
    cli = pgwork_command()
    say(
        f"\nThe dead letter is on http://{daemon.web_at}/dead, every attempt in its row's "
        f"ledger. Sign in there with the token {token} to redrive it (the daemon's log, below "
        f"this, says who did); or, while this runs, in another terminal:\n"
        f"  {cli} --config {cfg_file} dlq list\n"
        f"  {cli} --config {cfg_file} dlq redrive ID"
    )
    if once:
        daemon.request_stop()
    else:
        say("Ctrl-C stops.")


def pgwork_command() -> str:
    """How to run pgwork from a shell here: ``pgwork`` when it is on the PATH; else the one
    installed beside this Python (``.venv/bin/pgwork`` after ``make``), as a path that works
    from here."""
    if shutil.which("pgwork"):
        return "pgwork"
    beside = Path(sys.executable).parent / "pgwork"
    if beside.exists():
        try:
            return str(beside.relative_to(Path.cwd()))
        except ValueError:
            return str(beside)
    return f"{sys.executable} -m pgwork"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pgwork.demo", description=__doc__)
    p.add_argument("--dir", default=".pgwork/demo", help="the embedded server's data directory")
    p.add_argument("--once", action="store_true", help="stop once the three have an outcome")
    args = p.parse_args(argv)

    from .cli.common import Database, migrate_schema
    from .daemon import Daemon
    from .service import serve

    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    token = secrets.token_hex(12)
    receiver = Receiver(signing_key(secret))
    data = Path(args.dir).resolve()
    data.mkdir(parents=True, exist_ok=True)

    # The daemon's log, as `pgwork run` shows it in a terminal: what it did and who did what on
    # the web page (a redrive's line names who).
    logs.setup("text", "info")

    async def run() -> None:
        runner, url = await _serve_receiver(receiver)
        try:
            cfg_file = data.parent / "demo.toml"
            cfg_file.write_text(CONFIG.format(data=data, url=url))
            say(f"the receiver: {url}; the daemon's config: {cfg_file}")
            cfg = config_mod.load(
                cfg_file, env={"PGWORK_DEMO_SECRET": secret, "PGWORK_WEB_TOKEN": token}
            )
            # Both run their own event loop (as `pgwork run` calls them): in a thread of theirs.
            database = await anyio.to_thread.run_sync(lambda: Database(cfg, create=True))
            try:
                say(await anyio.to_thread.run_sync(migrate_schema, database.dsn))
                daemon = Daemon(cfg, database.dsn)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_story, daemon, database.dsn, args.once, token, cfg_file)
                    await serve(daemon)
                    tg.cancel_scope.cancel()
            finally:
                database.close()
        finally:
            await runner.cleanup()

    try:
        anyio.run(run)
    except (config_mod.ConfigError, db.SchemaError) as e:
        print(f"pgwork demo: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
