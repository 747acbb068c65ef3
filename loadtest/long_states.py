"""Long new states through a running server over gRPC: one at a time, then several at once.

    python loadtest/long_states.py --tokenizer BASE_DIR --out long-states.json [--grpc 127.0.0.1:8001] \\
        [--tokens 16384] [--concurrent 8] [--alone 5] [--rounds 3]

Each request is long5's five questions on a new state of exactly `--tokens` tokens, <state> included, as the
checkpoint's tokenizer (`--tokenizer`: its base directory, holding tokenizer.json) encodes it (kev_backend.dev.
workloads.sized). After one untimed request: `--alone` requests one after another (median latency), then `--rounds`
rounds of `--concurrent` different new states sent at once (each round's wall time from the first send to the last
answer). Throughput is state tokens per second: tokens ÷ median latency alone, concurrent × tokens ÷ median round
wall time together; the server's breakdown of the concurrent rounds (mean batch, queue and execute time) beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

from loops import server_breakdown, server_totals

from kev_backend.dev.provenance import commit, gpu_name
from kev_backend.dev.workloads import sized, state_counter
from kev_backend.protocol.encoding import KevTokenizer
from kev_backend.serve.client import AsyncKevClient

COUNTER = itertools.count(20_000_000)  # states no other load test sends


async def timed(kev: AsyncKevClient, body: dict[str, Any]) -> float:
    """Seconds to the answer of one request; a refusal or a fault raises (KevError), or an answer without answers."""
    started = time.perf_counter()
    reply = json.loads(await kev.score_raw(json.dumps(body)))
    if "answers" not in reply:
        raise RuntimeError(f"no answers: {str(reply)[:300]}")
    return time.perf_counter() - started


async def alone(kev: AsyncKevClient, bodies: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    seconds = [await timed(kev, body) for body in bodies]
    median = statistics.median(seconds)
    return {
        "requests": len(seconds),
        "ms": [1000 * s for s in seconds],
        "median_ms": 1000 * median,
        "state_tokens_per_s": tokens / median,
    }


async def together(kev: AsyncKevClient, rounds: list[list[dict[str, Any]]], tokens: int) -> dict[str, Any]:
    walls, latencies = [], []
    for bodies in rounds:
        started = time.perf_counter()
        latencies.append([1000 * s for s in await asyncio.gather(*(timed(kev, body) for body in bodies))])
        walls.append(time.perf_counter() - started)
    wall = statistics.median(walls)
    return {
        "states": len(rounds[0]),
        "rounds": len(rounds),
        "wall_ms": [1000 * w for w in walls],
        "latencies_ms": latencies,
        "median_wall_ms": 1000 * wall,
        "state_tokens_per_s": len(rounds[0]) * tokens / wall,
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    count = state_counter(KevTokenizer(args.tokenizer))  # the checkpoint's own tokenizer, as the engine's

    def new() -> dict[str, Any]:
        return sized(args.tokens, count, next(COUNTER))

    tokens = count(new())
    async with AsyncKevClient(args.grpc, "grpc", timeout_s=args.timeout) as kev:
        await timed(kev, new())  # first long pass after start: nothing of it is measured
        one = await alone(kev, [new() for _ in range(args.alone)], tokens)
        print(f"alone: {one['median_ms']:.1f} ms, {one['state_tokens_per_s']:.0f} state tokens/s", flush=True)
        before = server_totals(args.grpc)
        rounds = [[new() for _ in range(args.concurrent)] for _ in range(args.rounds)]
        many = await together(kev, rounds, tokens)
        many["server"] = server_breakdown(before, server_totals(args.grpc))
        print(
            f"{args.concurrent} at once: {many['median_wall_ms']:.1f} ms, {many['state_tokens_per_s']:.0f} state "
            f"tokens/s (mean batch {many['server']['mean_batch']})",
            flush=True,
        )
    return {
        "state_tokens": tokens,
        "questions": 5,
        "alone": one,
        "concurrent": many,
        "speedup": many["state_tokens_per_s"] / one["state_tokens_per_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="the checkpoint's base (tokenizer.json)")
    parser.add_argument("--grpc", default="127.0.0.1:8001")
    parser.add_argument("--tokens", type=int, default=16_384, help="each state's tokens, <state> included")
    parser.add_argument("--concurrent", type=int, default=8, help="new states sent at once")
    parser.add_argument("--alone", type=int, default=5, help="requests one at a time")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --concurrent states")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take")
    parser.add_argument("--commit", help="the commit the record names (default: git's HEAD)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    record = {
        "gpu": gpu_name(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(args.commit),
        **asyncio.run(measure(args)),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k not in ("alone", "concurrent")}), flush=True)


if __name__ == "__main__":
    main()
