"""A real headless Chromium for the web page's tests, driven over the DevTools protocol (a
websocket; aiohttp's client is all it needs). Debian's `chromium` is installed by `.ci/run`;
where it is missing the tests that need it are skipped with that reason."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One headless Chromium process with one page; ``close()`` ends the process."""

    def __init__(self) -> None:
        assert CHROMIUM is not None
        self._dir = tempfile.mkdtemp(prefix="pgwork-chromium-")
        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                "--headless=new",
                "--no-sandbox",  # tests run as root
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                "--disable-background-networking",
                "--window-size=1280,900",
                "--remote-debugging-port=0",
                f"--user-data-dir={self._dir}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stderr is not None
        deadline = time.monotonic() + 30
        self.port = 0
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if m:
                self.port = int(m.group(1))
                break
            if not line and self.proc.poll() is not None:
                break
        if not self.port:
            self.close()
            raise RuntimeError("chromium did not start its DevTools endpoint")
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._next = 0
        self._events: list[dict[str, Any]] = []

    async def open(self) -> None:
        self._session = aiohttp.ClientSession()
        async with self._session.get(f"http://127.0.0.1:{self.port}/json/list") as r:
            targets = await r.json()
        page = next(t for t in targets if t["type"] == "page")
        self._ws = await self._session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        await self.send("Page.enable")
        await self.send("Runtime.enable")

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        assert self._ws is not None
        self._next += 1
        mid = self._next
        await self._ws.send_str(json.dumps({"id": mid, "method": method, "params": params}))
        while True:
            msg = json.loads((await self._ws.receive(timeout=30)).data)
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))
            self._events.append(msg)

    async def _load_event(self, timeout: float = 20) -> None:
        assert self._ws is not None
        deadline = time.monotonic() + timeout
        while True:
            for i, e in enumerate(self._events):
                if e.get("method") == "Page.loadEventFired":
                    del self._events[: i + 1]
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the page did not load")
            msg = json.loads((await self._ws.receive(timeout=left)).data)
            self._events.append(msg)

    async def goto(self, url: str) -> None:
        self._events.clear()
        await self.send("Page.navigate", url=url)
        await self._load_event()

    async def eval(self, expression: str) -> Any:
        got = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in got:
            raise RuntimeError(f"{expression}: {got['exceptionDetails']}")
        return got["result"].get("value")

    async def submit(self, selector: str) -> None:
        """Submit the form ``selector`` names (as a click on its button would) and wait for
        the page that answers."""
        self._events.clear()
        await self.eval(f"document.querySelector({json.dumps(selector)}).requestSubmit()")
        await self._load_event()

    async def text(self) -> str:
        return str(await self.eval("document.body.innerText"))

    async def screenshot(self, path: Path) -> None:
        got = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(got["data"]))  # noqa: ASYNC240

    async def aclose(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        shutil.rmtree(self._dir, ignore_errors=True)
