"""Open-loop load on Kev on Triton: Poisson arrivals at set rates over async gRPC.

Each request is sent at its scheduled arrival time whether or not earlier ones were answered, so a saturated
server shows up as growing latency rather than as a slower client (the closed-loop trap). Latency is measured from
the scheduled arrival. Per rate: achieved rate, p50/p95/p99 latency, the mean time requests spent in Triton's
queue (from its statistics), and errors; plus a PNG of latency against offered load.

    python loadtest/openloop.py --rates 10,20,40,80 --seconds 20 --shape short6 --out bench/results/openloop
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import time
from pathlib import Path
from typing import Any

from loops import percentile, server_breakdown, server_totals

from kev_backend.dev.workloads import Traffic
from kev_backend.serve.client import AsyncKevClient, KevError


async def one_rate(kev: AsyncKevClient, traffic: Traffic, rate: float, seconds: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        arrivals.append(t)
    bodies = [json.dumps(traffic.next()) for _ in arrivals]
    latencies: list[float] = []
    errors: dict[str, int] = {}
    start = time.perf_counter() + 0.05

    async def send(at: float, body: str) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        try:
            await kev.score_raw(body)
            latencies.append(time.perf_counter() - (start + at))
        except KevError as error:
            errors[error.kind] = errors.get(error.kind, 0) + 1

    await asyncio.gather(*(send(at, body) for at, body in zip(arrivals, bodies)))
    elapsed = time.perf_counter() - start
    ms = [1000 * x for x in latencies]
    return {
        "offered_rps": rate,
        "sent": len(arrivals),
        "achieved_rps": len(latencies) / elapsed,
        "p50_ms": percentile(ms, 0.50),
        "p95_ms": percentile(ms, 0.95),
        "p99_ms": percentile(ms, 0.99),
        "errors": errors,
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    async with AsyncKevClient(args.triton_grpc, "grpc", args.model, timeout_s=args.timeout) as kev:
        traffic = Traffic(args.shape, args.repeat, seed=args.seed)
        for i, rate in enumerate(args.rates):
            before = server_totals(args.triton_grpc, args.model)
            result = await one_rate(kev, traffic, rate, args.seconds, args.seed + i)
            result["queue_ms"] = server_breakdown(before, server_totals(args.triton_grpc, args.model))["queue_ms"]
            results.append(result)
            print(json.dumps(result), flush=True)
    return results


def plot(results: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    offered = [r["offered_rps"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, style in (("p50_ms", "o-"), ("p95_ms", "s--"), ("p99_ms", "^:")):
        ax.plot(offered, [r[key] for r in results], style, label=key.replace("_ms", ""))
    ax.set_xlabel("offered load (requests/s, Poisson)")
    ax.set_ylabel("latency from scheduled arrival (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triton-grpc", default="127.0.0.1:8001")
    parser.add_argument("--model", default="kev")
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[10.0, 20.0, 40.0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--shape", choices=Traffic.SHAPES, default="short6")
    parser.add_argument("--repeat", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", type=Path, default=Path("openloop"), help="writes OUT.json and OUT.png")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "shape": args.shape,
        "repeat": args.repeat,
        "seconds": args.seconds,
        "rates": results,
    }
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    plot(results, f"Kev on Triton, {args.shape} (repeat {args.repeat})", args.out.with_suffix(".png"))
    print(f"written: {args.out.with_suffix('.json')} and .png")


if __name__ == "__main__":
    main()
