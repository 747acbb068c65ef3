"""What the System One gateway adds over direct gRPC: p50 latency at 1 and 64 concurrent clients, and throughput,
closed loop, same requests (Kev's short6 on new states). Needs tritonserver and kev-gateway running:

    python loadtest/gateway_overhead.py --triton 127.0.0.1:8001 --gateway http://127.0.0.1:8009 [--seconds 10]

Prints a table and writes JSON (--out). On one machine the clients share its cores with both servers.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
from pathlib import Path

import aiohttp
from loops import closed_loop

from kev_backend.serve.client import AsyncKevClient


async def measure(args: argparse.Namespace) -> dict:
    results: dict = {}
    async with AsyncKevClient(args.triton, "grpc") as kev, aiohttp.ClientSession() as session:

        async def direct(body: str) -> None:
            await kev.score_raw(body)

        async def gateway(body: str) -> None:
            async with session.post(
                f"{args.gateway}/v1/systemone", data=body, headers={"content-type": "application/json"}
            ) as response:
                if response.status != 200:
                    raise RuntimeError(f"{response.status}: {await response.text()}")
                await response.read()

        for clients in (1, 64):
            for name, send in (("grpc", direct), ("gateway", gateway)):
                await closed_loop(send, clients, 1.0)  # warm-up
                results.setdefault(str(clients), {})[name] = await closed_loop(send, clients, args.seconds)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triton", default="127.0.0.1:8001")
    parser.add_argument("--gateway", default="http://127.0.0.1:8009")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    levels = asyncio.run(measure(args))
    summary = {
        clients: {
            "grpc": r["grpc"],
            "gateway": r["gateway"],
            "p50_added_ms": r["gateway"]["p50_ms"] - r["grpc"]["p50_ms"],
            "throughput_ratio": r["gateway"]["rps"] / r["grpc"]["rps"],
        }
        for clients, r in levels.items()
    }
    print(f"{'clients':>7} {'grpc p50':>9} {'gw p50':>8} {'added':>7} {'grpc r/s':>9} {'gw r/s':>8} {'ratio':>6}")
    for clients, r in summary.items():
        print(
            f"{clients:>7} {r['grpc']['p50_ms']:9.2f} {r['gateway']['p50_ms']:8.2f} {r['p50_added_ms']:7.2f} "
            f"{r['grpc']['rps']:9.1f} {r['gateway']['rps']:8.1f} {r['throughput_ratio']:6.2f}"
        )
    if args.out:
        record = {
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
            "workload": "short6 new",
            "levels": summary,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
