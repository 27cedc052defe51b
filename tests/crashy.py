"""A Python channel for process tests: POSTs each delivery to the test receiver, and kills its own
process (exit 3, no cleanup) the first time it meets the key ``crash``."""

from __future__ import annotations

import json
import os
import urllib.request

import anyio

from pgwork.channels import Delivery


def _post(d: Delivery) -> None:
    req = urllib.request.Request(
        os.environ["PGWORK_TEST_RECEIVER"],
        data=json.dumps(d.document()).encode(),
        headers={"Idempotency-Key": str(d.operation_id), "Content-Type": "application/json"},
    )
    urllib.request.urlopen(req, timeout=5).read()


async def deliver(d: Delivery) -> None:
    marker = anyio.Path(os.environ["PGWORK_TEST_MARKER"])
    if d.business_key == "crash" and not await marker.exists():
        await marker.write_text("crashed")
        await anyio.sleep(0.2)  # let other deliveries of the batch get in flight
        os._exit(3)
    await anyio.to_thread.run_sync(_post, d)
