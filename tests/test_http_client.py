"""The webhook channel's HTTP edge against receivers that misbehave at the byte level: every
guarantee the channel makes about what a receiver can do to the daemon, whichever HTTP client
is underneath (issue 26 changed it; these tests are what the change had to keep).

Each test runs a real TCP server (a thread with raw sockets, so it can send what no HTTP
server library would) and calls :meth:`WebhookChannel.deliver` as the channel worker does."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from pgwork.channels.types import Delivered, Delivery, Failed, Retry
from pgwork.channels.webhook import WebhookChannel, WebhookOptions
from pgwork.config import ChannelConfig

pytestmark = pytest.mark.anyio

OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"

Serve = Callable[[socket.socket, bytes], None]


def _read_request(conn: socket.socket) -> bytes:
    """The request's bytes (head and body, by Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


class RawServer:
    """Accepts connections on 127.0.0.1 and hands each, with its first request, to ``serve``.
    ``closed`` is set when a connection's peer went away (the client gave up on it)."""

    def __init__(self, serve: Serve, tls: tuple[Path, Path] | None = None) -> None:
        self.serve = serve
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.closed = threading.Event()
        self.requests: list[bytes] = []
        self.tls = None
        if tls is not None:
            import ssl

            self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.tls.load_cert_chain(str(tls[0]), str(tls[1]))
        self.thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://localhost:{self.port}/hook"

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                try:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                except OSError:
                    return  # the client refused our certificate
            request = _read_request(conn)
            self.requests.append(request)
            self.serve(conn, request)
        except OSError:
            self.closed.set()
        finally:
            conn.close()

    def __enter__(self) -> RawServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def _delivery() -> Delivery:
    now = datetime.now(UTC)
    return Delivery(
        work_id=1,
        operation_id=uuid.uuid4(),
        source="t",
        business_key="k",
        deadline=now,
        occurrence=timedelta(0),
        due_at=now,
        channel="hook",
        recipient="r",
        payload_json='{"n":1}',
        attempt=1,
    )


def _channel(url: str, **kw: Any) -> WebhookChannel:
    """``kw``: fields of WebhookOptions or of ChannelConfig, each given to the one that has it."""
    own = {f.name for f in fields(WebhookOptions)}
    options = WebhookOptions(url=url, **{k: v for k, v in kw.items() if k in own})
    common = {k: v for k, v in kw.items() if k not in own}
    return WebhookChannel(ChannelConfig(name="hook", kind="webhook", options=options, **common))


async def _deliver(ch: WebhookChannel, within: float = 10.0) -> Delivered | Retry | Failed | None:
    """One attempt, cancelled after ``within`` seconds as the channel worker cancels an attempt
    past ``attempt_timeout`` (None: it was cancelled)."""
    try:
        with anyio.move_on_after(within):
            return await ch.deliver(_delivery())
        return None
    finally:
        await ch.aclose()


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_a_redirect_is_answered_not_followed() -> None:
    followed: list[bytes] = []

    def serve(conn: socket.socket, request: bytes) -> None:
        if request.startswith(b"GET"):
            followed.append(request)
        conn.sendall(
            b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n"
        )

    with RawServer(serve) as srv:
        out = await _deliver(_channel(srv.url))
    assert isinstance(out, Failed) and out.http_status == 307
    assert len(srv.requests) == 1 and not followed


async def test_a_kept_alive_connection_carries_the_next_requests() -> None:
    """A receiver that keeps its connection open gets every request on it: the answer is read
    to its end (its Content-Length), and the connection goes back to the client's pool. Three
    deliveries, one connection."""
    connections: list[int] = []

    def serve(conn: socket.socket, request: bytes) -> None:
        connections.append(1)
        while request:
            conn.sendall(OK_HEAD + b'Content-Length: 11\r\n\r\n{"ok":true}')
            request = _read_request(conn)

    with RawServer(serve) as srv:
        ch = _channel(srv.url)
        try:
            outs = [await ch.deliver(_delivery()) for _ in range(3)]
        finally:
            await ch.aclose()
    assert [type(o) for o in outs] == [Delivered] * 3, outs
    assert all(o.receipt["body"] == {"ok": True} for o in outs if isinstance(o, Delivered))
    assert len(connections) == 1, f"{len(connections)} connections for 3 requests"


async def test_an_answer_that_arrives_in_pieces_is_read_whole() -> None:
    def serve(conn: socket.socket, request: bytes) -> None:
        conn.sendall(OK_HEAD + b'Content-Length: 19\r\n\r\n{"ok":tr')
        time.sleep(0.2)
        conn.sendall(b'ue,"n":123}')

    with RawServer(serve) as srv:
        out = await _deliver(_channel(srv.url))
    assert isinstance(out, Delivered), out
    assert out.receipt["body"] == {"ok": True, "n": 123}


async def test_a_huge_body_is_read_only_up_to_max_response_bytes() -> None:
    body = b'{"pad":"' + b"x" * (64 << 20) + b'"}'  # 64 MiB

    def serve(conn: socket.socket, request: bytes) -> None:
        conn.sendall(OK_HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode())
        conn.sendall(body)

    before = _rss_mb()
    with RawServer(serve) as srv:
        out = await _deliver(_channel(srv.url, max_response_bytes=4096))
    assert isinstance(out, Delivered)
    assert out.receipt["body"] == "(truncated)"
    assert _rss_mb() - before < 48, "the body was read past the cap"


async def test_an_endless_chunked_body_ends_at_the_cap() -> None:
    def serve(conn: socket.socket, request: bytes) -> None:
        conn.sendall(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"4000\r\n" + b"y" * 0x4000 + b"\r\n"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            conn.sendall(chunk)

    with RawServer(serve) as srv:
        t0 = time.monotonic()
        out = await _deliver(_channel(srv.url, max_response_bytes=100_000))
        took = time.monotonic() - t0
    assert isinstance(out, Delivered), out
    assert took < 5


async def test_a_compressed_body_is_not_inflated() -> None:
    import gzip

    bomb = gzip.compress(b"\0" * (64 << 20), 9)

    def serve(conn: socket.socket, request: bytes) -> None:
        head = OK_HEAD + f"Content-Encoding: gzip\r\nContent-Length: {len(bomb)}\r\n\r\n".encode()
        conn.sendall(head + bomb)

    before = _rss_mb()
    with RawServer(serve) as srv:
        out = await _deliver(_channel(srv.url))
    assert isinstance(out, Delivered)
    assert "gzip-encoded body not decoded" in out.receipt["body"]
    assert _rss_mb() - before < 48
    assert b"accept-encoding: identity" in srv.requests[0].lower()


async def test_headers_that_trickle_in_are_ended_by_the_attempt_timeout() -> None:
    def serve(conn: socket.socket, request: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        for _ in range(200):  # one header byte per 0.1 s: never silent for read_timeout
            conn.sendall(b"X")
            time.sleep(0.1)

    with RawServer(serve) as srv:
        t0 = time.monotonic()
        out = await _deliver(_channel(srv.url, read_timeout=1.0), within=2.0)
        took = time.monotonic() - t0
        closed = await anyio.to_thread.run_sync(srv.closed.wait, 5)
        assert closed, "the connection was left open after the attempt ended"
    # Ended by the attempt timeout (cancelled), or sooner by the client's own read timeout
    # (reqwest bounds the whole wait for the headers by it): never left to run on.
    assert out is None or (isinstance(out, Retry) and out.error_class == "Timeout"), out
    assert took < 3


async def test_a_dripping_body_is_cancelled_by_the_attempt_s_scope() -> None:
    """The worker ends an attempt past attempt_timeout by cancelling its scope: the client must
    let that scope see its own cancellation (pyreqwest raises a CancelledError of its own in
    place of the one it was given; unmended, the cancellation escaped the scope and ended the
    whole worker task)."""

    def serve(conn: socket.socket, request: bytes) -> None:
        conn.sendall(OK_HEAD + b"Content-Length: 100\r\n\r\n")
        for _ in range(100):  # a byte every 0.2 s: never silent for read_timeout
            conn.sendall(b"x")
            time.sleep(0.2)

    with RawServer(serve) as srv:
        t0 = time.monotonic()
        ch = _channel(srv.url, read_timeout=2.0, attempt_timeout=1.5)
        out = await _deliver(ch, within=0.5)
        took = time.monotonic() - t0
        # Closed by the attempt's deadline at the latest (the client's own copy of it).
        closed = await anyio.to_thread.run_sync(srv.closed.wait, 5)
        assert closed, "the connection was left open after the attempt ended"
    assert out is None and took < 1.5


async def test_a_cancelled_attempt_leaves_no_slot_behind() -> None:
    """A channel of concurrency 1 whose attempt was cancelled mid-answer still sends the next
    request (pyreqwest's max_connections kept the cancelled request's slot for good)."""
    answered = 0

    def serve(conn: socket.socket, request: bytes) -> None:
        nonlocal answered
        answered += 1
        if answered > 1:
            conn.sendall(OK_HEAD + b"Content-Length: 2\r\n\r\n{}")
            return
        conn.sendall(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(200):  # an endless body, a byte at a time
            conn.sendall(b"1\r\nx\r\n")
            time.sleep(0.1)

    with RawServer(serve) as srv:
        ch = _channel(srv.url, concurrency=1, attempt_timeout=30.0)
        try:
            with anyio.move_on_after(0.5):
                await ch.deliver(_delivery())
            with anyio.fail_after(5):
                out = await ch.deliver(_delivery())
        finally:
            await ch.aclose()
    assert isinstance(out, Delivered), out


async def test_a_silent_receiver_is_a_timeout_after_read_timeout() -> None:
    def serve(conn: socket.socket, request: bytes) -> None:
        time.sleep(5)

    with RawServer(serve) as srv:
        t0 = time.monotonic()
        out = await _deliver(_channel(srv.url, read_timeout=0.5))
        took = time.monotonic() - t0
    assert isinstance(out, Retry) and out.error_class == "Timeout", out
    assert took < 3


async def test_huge_headers_are_refused() -> None:
    def serve(conn: socket.socket, request: bytes) -> None:
        conn.sendall(OK_HEAD + b"X-Big: " + b"z" * (8 << 20) + b"\r\nContent-Length: 0\r\n\r\n")

    before = _rss_mb()
    with RawServer(serve) as srv:
        out = await _deliver(_channel(srv.url))
    assert isinstance(out, Retry) and out.error_class == "ProtocolError", out
    assert _rss_mb() - before < 48


async def test_an_unreachable_receiver_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    out = await _deliver(_channel(f"http://127.0.0.1:{port}/hook"))
    assert isinstance(out, Retry) and out.error_class == "ConnectError", out


async def test_a_receiver_that_answers_garbage_is_a_protocol_error() -> None:
    def serve(conn: socket.socket, request: bytes) -> None:
        conn.sendall(b"\x00\x01 this is not http\r\n\r\n")

    with RawServer(serve) as srv:
        out = await _deliver(_channel(srv.url))
    assert isinstance(out, Retry) and out.error_class == "ProtocolError", out


# -- TLS -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Path]]:
    """A private CA and a certificate for ``localhost`` it signed, made with the openssl tool:
    (the server's certificate, its key, the CA's certificate)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl tool is not installed (apt-get install openssl)")
    d = tmp_path_factory.mktemp("tls")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            "/CN=pgwork test CA", "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
            "-keyout", "key.pem", "-out", "leaf.csr")  # fmt: skip
    (d / "ext.cnf").write_text("subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\n")
    openssl("x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "ext.cnf", "-out", "cert.pem")  # fmt: skip
    yield d / "cert.pem", d / "key.pem", d / "ca.pem"


@contextmanager
def _ok_tls(certificate: tuple[Path, Path, Path]) -> Iterator[RawServer]:
    def serve(conn: socket.socket, request: bytes) -> None:
        conn.sendall(OK_HEAD + b"Content-Length: 2\r\n\r\n{}")

    with RawServer(serve, tls=certificate[:2]) as srv:
        yield srv


async def test_an_unknown_certificate_is_refused(certificate: tuple[Path, Path, Path]) -> None:
    with _ok_tls(certificate) as srv:
        out = await _deliver(_channel(srv.url))
    assert isinstance(out, Retry) and out.error_class == "TLSError", out


async def test_a_certificate_signed_by_the_configured_ca_is_trusted(
    certificate: tuple[Path, Path, Path],
) -> None:
    with _ok_tls(certificate) as srv:
        out = await _deliver(_channel(srv.url, ca_file=str(certificate[2])))
        assert isinstance(out, Delivered), out


async def test_verify_tls_off_accepts_any_certificate(certificate: tuple[Path, Path, Path]) -> None:
    with _ok_tls(certificate) as srv:
        out = await _deliver(_channel(srv.url, verify_tls=False))
        assert isinstance(out, Delivered), out
