"""Closed-loop clients shared by the load-test scripts (run them from the repository root: `python loadtest/...`)."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Awaitable, Callable

from kev_backend.workloads import short6

COUNTER = itertools.count(1)


async def closed_loop(send: Callable[[str], Awaitable[object]], clients: int, seconds: float) -> dict[str, float]:
    """`clients` concurrent senders, each sending Kev's short6 on a new state as soon as its last one is answered."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        while time.perf_counter() < deadline:
            body = json.dumps(short6(next(COUNTER)))
            started = time.perf_counter()
            await send(body)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "rps": len(latencies) / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "requests": len(latencies),
    }
