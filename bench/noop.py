"""No-op Python channel for benchmarks: records when it was called (for latency workloads)."""

from __future__ import annotations

import time

from pgwork.channels import Delivery

#: operation_id -> time.time() of the call (latency and lateness workloads read it)
CALLED: dict[str, float] = {}
RECORD = False


async def deliver(d: Delivery) -> None:
    if RECORD:
        CALLED[str(d.operation_id)] = time.time()
