"""Closed-loop clients shared by the load-test scripts (run them from the repository root: `python loadtest/...`)."""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import statistics
import time
import urllib.request
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from kev_backend.dev.workloads import short6

COUNTER = itertools.count(1)


def percentile(values: list[float], q: float) -> float | None:
    """The value below which a share `q` of `values` lies (nearest rank); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ready() -> None:
    """Holds its worker a moment, so that every worker of the pool is started (its imports done) before the run's
    clock is set."""
    time.sleep(1.0)


def in_processes(
    work: Callable[..., Any], clients: int, procs: int, seed: int, *args: Any, during: tuple | None = None
) -> list[Any]:
    """`clients` spread over `procs` spawned processes (as evenly as they go), all starting together once every one is
    up: `work(share, seed + i, start_at, *args)` in process i (`start_at`: the wall clock every process shares), and
    each one's result, in order: several processes keep the clients' own Python work off what is measured. `during`
    (at, fn): fn() called `at` seconds into the run, from this process."""
    procs = max(1, min(procs, clients))
    shares = [clients // procs + (i < clients % procs) for i in range(procs)]
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for started in [pool.submit(_ready) for _ in range(procs)]:
            started.result()
        start_at = time.time() + 0.5
        futures = [pool.submit(work, share, seed + i, start_at, *args) for i, share in enumerate(shares)]
        if during is not None:
            at, fn = during
            time.sleep(max(0.0, start_at + at - time.time()))
            fn()
        return [future.result() for future in futures]


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


# Triton's per-request phases (statistics extension): each holds a count and the nanoseconds summed over requests.
PHASES = ("queue", "compute_input", "compute_infer", "compute_output")


def server_totals(grpc_url: str, model: str = "kev", metrics_url: str | None = None) -> dict[str, float]:
    """What the server has counted for the model so far: Triton's inferences, executions (batches) and per-phase
    totals, from its statistics over gRPC (the client a serving install has); with `metrics_url`, also the engine's
    own time (kev_engine_ms, one observation per batch)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    finally:
        client.close()
    # Protobuf's JSON leaves out zero counters and writes 64-bit ones as strings.
    totals = {
        "inferences": float(stats.get("inference_count", 0)),
        "executions": float(stats.get("execution_count", 0)),
    }
    for phase in PHASES:
        counted = stats.get("inference_stats", {}).get(phase, {})
        totals[f"{phase}_count"] = float(counted.get("count", 0))
        totals[f"{phase}_ns"] = float(counted.get("ns", 0))
    if metrics_url:
        with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10) as response:
            for line in response.read().decode().splitlines():
                name = line.split("{")[0]
                if name in ("kev_engine_ms_sum", "kev_engine_ms_count"):
                    totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def server_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Where a run's requests spent their time on the server, from two server_totals: the mean batch, each phase's
    mean per request (a batched request counts its whole batch's compute), and the engine's mean per batch. The
    execute phase (compute_infer) minus the engine's time is the Python backend's own work around the engine."""

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    out: dict[str, float | None] = {"requests": delta("inferences"), "batches": delta("executions")}
    out["mean_batch"] = out["requests"] / out["batches"] if out["batches"] else None
    for phase in PHASES:
        count = delta(f"{phase}_count")
        out[f"{phase}_ms"] = delta(f"{phase}_ns") / count / 1e6 if count else None
    engine_batches = delta("kev_engine_ms_count")
    out["engine_ms_per_batch"] = delta("kev_engine_ms_sum") / engine_batches if engine_batches else None
    return out


async def measured_loop(
    send: Callable[[str], Awaitable[object]], clients: int, seconds: float, grpc_url: str, metrics_url: str | None
) -> dict:
    """A closed loop against a running server after 2 s of warm-up, with the server's breakdown of that run (its
    statistics read over gRPC at `grpc_url`)."""
    await closed_loop(send, clients, 2.0)
    before = server_totals(grpc_url, metrics_url=metrics_url)
    result: dict = await closed_loop(send, clients, seconds)
    result["server"] = server_breakdown(before, server_totals(grpc_url, metrics_url=metrics_url))
    return result
