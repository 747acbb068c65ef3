"""Triton's front doors against the engine in-process: short6 on new states, closed loop, N clients.

    python loadtest/closedloop.py inprocess --checkpoint DIR [--graphs] --out inprocess.json
    python loadtest/closedloop.py triton --grpc 127.0.0.1:8001 [--http 127.0.0.1:8000] --inprocess inprocess.json \\
        --out bench/results/<name>.json

`--inprocess` also takes a bench JSON (python -m kev_backend.dev.bench): its short6 figures at the same client count.

`inprocess` answers from an Engine in this process, batched as Triton's dynamic batcher batches (kev_backend.dev.bench
.throughput). `triton` drives a running tritonserver over gRPC, and over HTTP when --http names its port (Triton's
HTTP client comes with the test set, not the bench set), with async tritonclient and writes the JSON with its
`triton` block: grpc_rps, http_rps (when measured), inprocess_rps, grpc_p50_overhead_ms (gRPC p50 minus in-process p50)
and the same with one client (grpc_p50_overhead_1c_ms); each Triton run also records the server's breakdown (mean
batch, queue and execute time per request, the engine's time per batch: Triton's statistics and metrics).
Run the two one after the other, not at once: both use the GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
from pathlib import Path

from loops import measured_loop

from kev_backend.dev.provenance import commit
from kev_backend.serve.client import AsyncKevClient


def inprocess(args: argparse.Namespace) -> dict:
    import torch

    from kev_backend.dev import bench
    from kev_backend.dev.workloads import short6
    from kev_backend.engine.engine import Engine, EngineOptions

    engine = Engine.from_checkpoint(args.checkpoint, EngineOptions(graphs=args.graphs))
    bench.throughput(engine, short6, args.clients, 2.0)  # warm-up: batch shapes, first launches
    result = bench.throughput(engine, short6, args.clients, args.seconds)
    alone = bench.throughput(engine, short6, 1, args.seconds)
    return {
        "clients": args.clients,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "backend": engine.backend,
        "graphs": args.graphs,
        **result,
        "p50_1c_ms": alone["p50_ms"],
    }


def inprocess_reference(record: dict, clients: int) -> dict:
    """The in-process figures Triton is compared with: a record of `closedloop.py inprocess` as it is, or a bench
    JSON's (python -m kev_backend.dev.bench) short6 requests/s and p50 at `clients`."""
    if "workloads" not in record:
        return record
    short6 = record["workloads"]["short6"]
    return {
        "clients": clients,
        "gpu": record["gpu"],
        "backend": record["backend"],
        "graphs": record["graphs"],
        "rps": short6["rps"][str(clients)],
        "p50_ms": short6["p50_ms"][str(clients)],
        "p50_1c_ms": short6["p50_ms"].get("1"),
        "source": f"bench {record['commit']}",
    }


async def through_triton(args: argparse.Namespace) -> dict:
    """gRPC and (with --http) HTTP at `clients`, then gRPC with one client (what the front door adds to one
    request's latency); each run with the server's own breakdown of where its requests spent their time."""
    results = {}
    runs = [("grpc", "grpc", args.grpc, args.clients), ("grpc_1c", "grpc", args.grpc, 1)]
    if args.http:
        runs.insert(1, ("http", "http", args.http, args.clients))
    for label, protocol, url, clients in runs:
        async with AsyncKevClient(url, protocol) as kev:

            async def send(body: str, kev: AsyncKevClient = kev) -> None:
                await kev.score_raw(body)

            results[label] = await measured_loop(send, clients, args.seconds, args.grpc, args.metrics)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    one = sub.add_parser("inprocess")
    one.add_argument("--checkpoint", required=True)
    one.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True, help="CUDA graphs (GPU)")
    two = sub.add_parser("triton")
    two.add_argument("--grpc", default="127.0.0.1:8001")
    two.add_argument("--http", help="Triton's HTTP address, to measure HTTP too (e.g. 127.0.0.1:8000)")
    two.add_argument("--metrics", default="127.0.0.1:8002", help="Triton's metrics port (the engine's time)")
    two.add_argument("--inprocess", type=Path, required=True, help="the JSON `inprocess` (or the bench) wrote")
    two.add_argument("--extra", type=Path, action="append", default=[], help="JSON objects merged in (e.g. start)")
    two.add_argument("--commit", help="the commit the record names (default: git's HEAD)")
    for p in (one, two):
        p.add_argument("--clients", type=int, default=64)
        p.add_argument("--seconds", type=float, default=15.0)
        p.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.mode == "inprocess":
        record = inprocess(args)
        print(json.dumps(record))
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        return
    local = inprocess_reference(json.loads(args.inprocess.read_text()), args.clients)
    remote = asyncio.run(through_triton(args))
    record = {
        "gpu": local["gpu"],
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(args.commit),
        "workload": f"short6 new, {args.clients} closed-loop clients, {args.seconds:g} s",
        "triton": {
            "grpc_rps": remote["grpc"]["rps"],
            "http_rps": remote["http"]["rps"] if "http" in remote else None,
            "inprocess_rps": local["rps"],
            "grpc_p50_overhead_ms": remote["grpc"]["p50_ms"] - local["p50_ms"],
            "grpc_p50_overhead_1c_ms": (
                remote["grpc_1c"]["p50_ms"] - local["p50_1c_ms"] if local.get("p50_1c_ms") is not None else None
            ),
            "grpc_share": remote["grpc"]["rps"] / local["rps"],
            "http_share": remote["http"]["rps"] / local["rps"] if "http" in remote else None,
        },
        "inprocess": local,
        "grpc": remote["grpc"],
        "http": remote.get("http"),
        "grpc_1c": remote["grpc_1c"],
    }
    for extra in args.extra:
        record.update(json.loads(extra.read_text()))
    print(json.dumps(record["triton"]))
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
