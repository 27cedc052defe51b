"""What the webhook channel costs the daemon beyond its HTTP client (issue 41):
``python -m bench.channel_cost``.

One process on uvloop (as the daemon runs), one local receiver (``bench/http_receiver.py``, its
own process), the channel's own client, 32 requests in flight. Two ways of posting take turns,
in a shuffled order each round, so a slow minute on the machine touches both alike:

- ``bare``: the client alone, posting a constant document with constant headers and reading
  the answer with one read: the floor any channel on this client pays;
- ``deliver``: ``WebhookChannel.deliver`` of one delivery, as the claim loop calls it (the
  document, the headers, the request with its deadline, the answer read under the cap, the
  outcome).

Per request: this process's CPU (user and system, the client's runtime thread included), the
median over rounds, and what ``deliver`` spends beyond ``bare``. Prints one JSON line. To compare
two trees, copy this file into the other tree's ``bench/`` and run it in each, alternately::

    python -m bench.channel_cost [--rounds 12] [--n 3000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from pgwork.channels.types import Delivered, Delivery
from pgwork.channels.webhook import WebhookChannel

from .workloads import _posts_per_s, start_receiver, webhook_channel

CONCURRENCY = 32


async def measure(url: str, rounds: int, n: int) -> dict[str, Any]:
    channel = WebhookChannel(webhook_channel(url, CONCURRENCY))
    client = channel._open()
    now = datetime.now(UTC)
    delivery = Delivery(
        operation_id=uuid.uuid4(),
        source="bench",
        business_key="lease-000123",
        deadline=now,
        occurrence=timedelta(0),
        due_at=now,
        channel="hook",
        work_id=1,
        recipient="r",
        payload_json='{"tenant":"t1","amount":12.5}',
        attempt=1,
    )
    body = delivery.document_json().encode()
    headers = channel.headers(delivery, body)

    async def bare() -> None:
        request = client.post(url).headers(headers).body_bytes(body).build_streamed()
        async with request as resp:
            await resp.body_reader.read(65536)
            assert resp.status == 200

    async def deliver() -> None:
        got = await channel.deliver(delivery)
        assert isinstance(got, Delivered), got

    ways: dict[str, Callable[[], Awaitable[None]]] = {"bare": bare, "deliver": deliver}
    cpu: dict[str, list[float]] = {k: [] for k in ways}
    try:
        for post in ways.values():  # warm: connections made, code paths run
            await _posts_per_s(post, 200, CONCURRENCY)
        for _ in range(rounds):
            for name in random.sample(list(ways), len(ways)):
                c0 = time.process_time()
                await _posts_per_s(ways[name], n, CONCURRENCY)
                cpu[name].append((time.process_time() - c0) / n * 1e6)
    finally:
        await channel.aclose()
    med = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "rounds": rounds,
        "requests_per_round": n,
        "bare_cpu_us": round(med["bare"], 1),
        "deliver_cpu_us": round(med["deliver"], 1),
        "channel_excess_us": round(med["deliver"] - med["bare"], 1),
        "runs": {k: [round(x, 1) for x in v] for k, v in cpu.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--n", type=int, default=3000, help="requests per way and round")
    args = ap.parse_args()
    import uvloop

    receiver, url = start_receiver()
    try:
        result = uvloop.run(measure(url, args.rounds, args.n))
    finally:
        receiver.terminate()
        receiver.wait(10)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
