"""The process around the daemon: SIGTERM/SIGINT become stop requests, and systemd hears READY,
STATUS, WATCHDOG (fed only while every running pass makes progress) and STOPPING."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

import anyio

from .daemon import Daemon
from .systemd import Notifier

log = logging.getLogger("pgwork.service")


async def watchdog(daemon: Daemon, notifier: Notifier) -> None:
    """Feed the systemd watchdog at half its timeout, only while no pass is stuck; keep the
    STATUS= line current."""
    timeout = notifier.watchdog_timeout
    interval = timeout / 2 if timeout else 5.0
    told: set[str] = set()  # the stuck passes already named in this episode
    while True:
        notifier.status(daemon.summary)
        if timeout:
            stuck = daemon.sup.health.stuck(timeout)
            if not stuck:
                notifier.watchdog()
                told.clear()
            elif not {n for n, _ in stuck} <= told:
                # Said once an episode, and again whenever another pass joins the stuck ones,
                # so the log names every stuck pass, not only the first to stop.
                told |= {n for n, _ in stuck}
                log.error(
                    "not feeding the watchdog: %s",
                    ", ".join(f"{n} stuck for {s:.0f}s" for n, s in stuck),
                    extra={"stuck": [n for n, _ in stuck]},
                )
        await anyio.sleep(interval)


async def serve(
    daemon: Daemon,
    *,
    signals: bool = True,
    notifier: Notifier | None = None,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Run ``daemon`` until SIGTERM/SIGINT (or ``request_stop``) ends it, speaking sd_notify;
    ``on_ready`` is called once it is ready (every duty started), never before an error."""
    notifier = notifier or Notifier()
    try:
        async with anyio.create_task_group() as tg:
            if signals:

                async def on_signals() -> None:
                    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                        async for signum in sigs:
                            log.info("received %s", signal.Signals(signum).name)
                            notifier.stopping()
                            daemon.request_stop()

                tg.start_soon(on_signals)
            notifier.status("starting: connecting to the database")
            await tg.start(daemon.run)
            if daemon.ready.is_set():
                notifier.ready(f"running: daemon {daemon.daemon_id}")
                tg.start_soon(watchdog, daemon, notifier)
                if on_ready is not None:
                    on_ready()
            await daemon.finished.wait()
            notifier.stopping("stopped")
            tg.cancel_scope.cancel()
    finally:
        notifier.close()
