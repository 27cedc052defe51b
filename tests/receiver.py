"""A real HTTP receiver on 127.0.0.1 for webhook tests: records every request by idempotency
key and answers as the test scripts it (status codes, Retry-After, slowness, dropped connections,
garbage, or holding the answer until the test releases it)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Headers(dict[str, str]):
    """A request's headers by name, case-insensitive as HTTP says (names are kept lower-cased:
    pgwork's client sends them so, as HTTP/2 requires)."""

    def __init__(self, items: Any = ()) -> None:
        super().__init__((k.lower(), v) for k, v in dict(items).items())

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(name.lower())

    def get(self, name: str, default: Any = None) -> Any:
        return super().get(name.lower(), default)


@dataclass
class Request:
    key: str
    body: dict[str, Any]
    headers: Headers
    at: float
    n: int  # 1 for the first request with this key
    raw: bytes = b""  # the body as sent


@dataclass(frozen=True)
class Answer:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b'{"ok": true}'
    delay: float = 0.0  # seconds before answering
    drop: bool = False  # read the request, then close the connection without answering
    garbage: bool = False  # answer bytes that are not HTTP
    hold: threading.Event | None = None  # wait for the test to release the answer
    drip: float = 0.0  # send the headers, then the body one byte per `drip` seconds


Script = Callable[[Request], Answer]


class Receiver:
    def __init__(self, script: Script | None = None) -> None:
        self.script: Script = script or (lambda r: Answer())
        self.requests: list[Request] = []
        #: Requests per idempotency key so far (a flood's requests are counted in O(1) each).
        self._seen: dict[str, int] = {}
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # The headers and the body are two writes: with Nagle's algorithm the second
            # waited for the client's delayed ACK, 40 ms a request (95 requests a second at a
            # concurrency of 4, which made a flood a test of this receiver).
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(length)
                key = self.headers.get("Idempotency-Key", "")
                with receiver.lock:
                    n = receiver._seen[key] = receiver._seen.get(key, 0) + 1
                    req = Request(key, json.loads(raw), Headers(self.headers), time.time(), n, raw)
                    receiver.requests.append(req)
                    receiver.arrived.notify_all()
                ans = receiver.script(req)
                if ans.hold is not None:
                    ans.hold.wait(30)
                if ans.delay:
                    time.sleep(ans.delay)
                if ans.drop:
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if ans.garbage:
                    self.wfile.write(b"\x00\x01 this is not http\r\n\r\n")
                    self.close_connection = True
                    return
                self.send_response(ans.status)
                for k, v in ans.headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(ans.body)))
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                if ans.drip:
                    for i in range(len(ans.body)):
                        self.wfile.write(ans.body[i : i + 1])
                        self.wfile.flush()
                        time.sleep(ans.drip)
                    return
                self.wfile.write(ans.body)

        class Server(ThreadingHTTPServer):
            # Many daemons connect at once: with the default backlog (5) a dropped SYN is
            # retried a second later, and a request sent now arrives a second late.
            request_queue_size = 128

            def handle_error(self, request: Any, client_address: Any) -> None:
                # A client that went away (killed daemon, timeout) is part of these tests.
                return

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def keys(self) -> dict[str, int]:
        """Requests per idempotency key."""
        with self.lock:
            out: dict[str, int] = {}
            for r in self.requests:
                out[r.key] = out.get(r.key, 0) + 1
            return out

    def wait_for(self, count: int, timeout: float = 20) -> list[Request]:
        """Block until at least ``count`` requests arrived; returns them."""
        deadline = time.monotonic() + timeout
        with self.arrived:
            while len(self.requests) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"receiver got {len(self.requests)} requests, expected {count}"
                    )
                self.arrived.wait(left)
            return list(self.requests)
