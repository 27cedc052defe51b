"""Async HTTP clients compared for the webhook channel: requests/s and the client process's CPU
per request, posting pgwork's webhook document to ``bench/http_receiver.py`` (its own process)
with 32 requests in flight, each client on asyncio and on uvloop.

``python -m bench.clients [--n 20000] [--rounds 3] [--clients aiohttp,pyreqwest,rnet]``

Each (client, loop) runs in a fresh process, the combinations interleaved round by round, so a
slow minute on the machine touches every client alike. A client that is not installed is
skipped (aiohttp and pyreqwest are dependencies; ``pip install rnet`` to compare the third).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Awaitable, Callable

from .workloads import _posts_per_s

CONCURRENCY = 32
BODY = (
    b'{"operation_id":"6f1c8f0e-3b7a-4c52-9a57-0d3c1e2f4a5b","source":"bench","business_key":'
    b'"lease-000123","deadline":"2026-12-01T09:00:00+00:00","occurrence_seconds":0.0,'
    b'"due_at":"2026-12-01T09:00:00+00:00","channel":"hook","recipient":"r","attempt":1,'
    b'"payload":{"tenant":"t1","amount":12.5}}'
)
HEADERS = {
    "Content-Type": "application/json",
    "Idempotency-Key": "6f1c8f0e-3b7a-4c52-9a57-0d3c1e2f4a5b",
    "webhook-id": "6f1c8f0e-3b7a-4c52-9a57-0d3c1e2f4a5b",
    "webhook-timestamp": "1796115600",
    "webhook-signature": "v1,0123456789abcdef0123456789abcdef0123456789a=",
}


async def _drive(post: Callable[[], Awaitable[None]], n: int) -> float:
    """Seconds ``n`` posts take, CONCURRENCY at a time."""
    return n / await _posts_per_s(post, n, CONCURRENCY)


async def _aiohttp(url: str, n: int) -> float:
    import aiohttp

    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=CONCURRENCY), auto_decompress=False
    ) as session:

        async def post() -> None:
            async with session.post(url, data=BODY, headers=HEADERS, allow_redirects=False) as resp:
                await resp.content.read(65536)
                assert resp.status == 200

        await _drive(post, 100)
        return await _drive(post, n)


async def _pyreqwest(url: str, n: int) -> float:
    from pyreqwest.client import ClientBuilder  # type: ignore[import-not-found,unused-ignore]

    async with (
        ClientBuilder()
        .pool_max_idle_per_host(CONCURRENCY)
        .follow_redirects(False)
        .gzip(False)
        .deflate(False)
        .build() as client
    ):

        async def post() -> None:
            req = client.post(url).headers(HEADERS).body_bytes(BODY).build_streamed()
            async with req as resp:
                await resp.body_reader.read(65536)
                assert resp.status == 200

        await _drive(post, 100)
        return await _drive(post, n)


async def _rnet(url: str, n: int) -> float:
    import rnet  # type: ignore[import-not-found,unused-ignore]

    client = rnet.Client(allow_redirects=False)

    async def post() -> None:
        resp = await client.post(url, headers=HEADERS, body=BODY)
        await resp.bytes()
        assert resp.status == 200

    await _drive(post, 100)
    return await _drive(post, n)


CLIENTS = {"aiohttp": _aiohttp, "pyreqwest": _pyreqwest, "rnet": _rnet}


def _child(client: str, loop: str, url: str, n: int) -> None:
    """One measurement, in this process: prints {"per_s", "cpu_us"} as JSON."""
    import asyncio

    fn = CLIENTS[client]
    c0 = os.times()
    if loop == "uvloop":
        import uvloop

        elapsed = uvloop.run(fn(url, n))
    else:
        elapsed = asyncio.run(fn(url, n))
    c1 = os.times()
    # The warm-up's CPU is counted too (100 requests: under 1% of the run).
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    print(json.dumps({"per_s": n / elapsed, "cpu_us": cpu / (n + 100) * 1e6}))


def _installed(client: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(client) is not None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a.child[0], a.child[1], a.child[2], a.n)
        return
    from .workloads import start_receiver

    combos = [
        (c, loop) for c in a.clients.split(",") if _installed(c) for loop in ("asyncio", "uvloop")
    ]
    results: dict[tuple[str, str], list[dict[str, float]]] = {k: [] for k in combos}
    receiver, url = start_receiver()
    try:
        for _ in range(a.rounds):
            for client, loop in combos:
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "bench.clients",
                        "--n",
                        str(a.n),
                        "--child",
                        client,
                        loop,
                        url,
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                results[(client, loop)].append(json.loads(out.stdout))
    finally:
        receiver.terminate()
        receiver.wait(10)
    print(f"{'client':<10} {'loop':<8} {'requests/s (median)':>20} {'CPU µs/request':>15}  runs")
    for (client, loop), rs in results.items():
        per_s = statistics.median(r["per_s"] for r in rs)
        cpu = statistics.median(r["cpu_us"] for r in rs)
        runs = " ".join(f"{r['per_s']:,.0f}" for r in rs)
        print(f"{client:<10} {loop:<8} {per_s:>20,.0f} {cpu:>15.0f}  {runs}")


if __name__ == "__main__":
    main()
