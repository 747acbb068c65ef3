"""A server just started with `make serve`, measured as its user meets it: seconds from the command to Triton's
readiness and to the first answer, then short6 on new states over gRPC, one client (latency) and N closed-loop
clients (throughput). Needs only the serving install (the gRPC client).

    python loadtest/served.py --started EPOCH_SECONDS --out served.json [--grpc HOST:PORT] [--clients 64]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
import urllib.request
from pathlib import Path

from loops import closed_loop

from kev_backend.dev.provenance import commit, gpu_name
from kev_backend.dev.workloads import short6
from kev_backend.serve.client import AsyncKevClient, KevClient, KevError

COUNTER = itertools.count(10_000_000)  # states no warm-up or other run sent


def ready(http: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


def first_answer(grpc: str, http: str, started: float, limit_s: float) -> tuple[float, float]:
    """Seconds from `started` to Triton's readiness and to the first short6 answered."""
    ready_s = None
    while time.time() - started < limit_s:
        if ready_s is None and ready(http):
            ready_s = time.time() - started
        if ready_s is not None:
            try:
                with KevClient(grpc) as kev:
                    kev.score(short6(next(COUNTER)))
                return ready_s, time.time() - started
            except KevError:
                pass
        time.sleep(0.2)
    raise SystemExit(f"no answer within {limit_s:g} s of the command")


async def measure(grpc: str, clients: int, seconds: float) -> dict[str, float]:
    async with AsyncKevClient(grpc, "grpc") as kev:
        alone = []
        for _ in range(20):
            begun = time.perf_counter()
            await kev.score_raw(json.dumps(short6(next(COUNTER))))
            alone.append(time.perf_counter() - begun)

        async def send(body: str) -> None:
            await kev.score_raw(body)

        await closed_loop(send, clients, 2.0)  # batch shapes and first launches at this load
        loaded = await closed_loop(send, clients, seconds)
    loaded = {f"short6_{clients}c_{name}": value for name, value in loaded.items()}
    return {"short6_1c_p50_ms": 1000 * statistics.median(alone), **loaded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--started", type=float, required=True, help="when the command was typed (time.time())")
    parser.add_argument("--grpc", default="127.0.0.1:8001")
    parser.add_argument("--http", default="127.0.0.1:8000")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--limit", type=float, default=900.0, help="seconds to wait for the first answer")
    parser.add_argument("--commit", help="the commit the record names (default: git's HEAD)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    ready_s, first_s = first_answer(args.grpc, args.http, args.started, args.limit)
    print(f"ready after {ready_s:.1f} s, first answer after {first_s:.1f} s", flush=True)
    record = {
        "gpu": gpu_name(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(args.commit),
        "ready_s": ready_s,
        "first_answer_s": first_s,
        **asyncio.run(measure(args.grpc, args.clients, args.seconds)),
    }
    print(json.dumps(record), flush=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
