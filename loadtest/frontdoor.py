"""The front door against the engine: short6 on new states through Triton's gRPC and through the System One gateway,
one client alone and closed loops of many, set beside the engine's in-process figures for the same requests (a
`python -m kev_backend.dev.bench --quick --clients 64,128` JSON). Needs the server running (with its gateway for
--gateway, which also needs aiohttp: the test set has it).

    python loadtest/frontdoor.py --grpc 127.0.0.1:8001 [--gateway http://127.0.0.1:8009] [--inprocess BENCH.json]
        [--clients 64,128] [--procs 4] [--seconds 5] [--admin-key-file KEY] --out FRONTDOOR.json

One client: --alone requests one after another from this process, each timed at the client from before its JSON is
written to its answer decoded (the client's own time included; over gRPC with the asyncio client and again with the
blocking one; with --admin-key-file once more with Triton's trace on, its time by phase: loadtest/tracing.py), with
the server's breakdown of those requests, against the bench's `wall_new_ms` (the same request through the pipeline
Triton's model uses, JSON in and out, in the engine's process). Many: the clients spread over --procs processes (so
that the clients' own Python work is not what is measured), all starting together; after --warm seconds,
requests/s is what is answered within the next --seconds (the clients running through both). Writes
served_over_inprocess and one_client_overhead_ms, and for the gateway gateway_over_grpc and
gateway_one_client_added_ms; the server's own breakdown of each level (Triton's statistics: queue, execute and the
engine's time; the busiest threads of tritonserver and its stubs, by their share of a core, where they run on this
machine) beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loops import in_processes, percentile, server_breakdown, server_totals
from tracing import TritonTrace, phases

from kev_backend.dev.provenance import commit, gpu_name
from kev_backend.dev.workloads import short6
from kev_backend.serve.client import AsyncKevClient, KevClient
from kev_backend.serve.supervisor import procs

# Each client process numbers its new states from its seed x 10**7; a measurement's processes take seeds apart from
# every other's, so no run sends a state another sent (its answer would be a bank hit).
SEED_STRIDE = 1000


class Door:
    """One way in: "grpc" (Triton's gRPC, the Python client) or "gateway" (System One over HTTP)."""

    def __init__(self, kind: str, url: str) -> None:
        self.kind, self.url = kind, url

    async def __aenter__(self) -> Door:
        if self.kind == "grpc":
            self.client = AsyncKevClient(self.url, "grpc", timeout_s=120.0)
        else:  # aiohttp comes with the test set (Triton's HTTP client); the bench set has the gRPC client only
            import aiohttp

            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120.0))
        return self

    async def __aexit__(self, *_: object) -> None:
        if self.kind == "grpc":
            await self.client.close()
        else:
            await self.session.close()

    async def send(self, body: dict) -> bytes:
        """The answer's JSON."""
        if self.kind == "grpc":
            return await self.client.score_raw(json.dumps(body))
        async with self.session.post(
            f"{self.url}/v1/systemone", data=json.dumps(body), headers={"content-type": "application/json"}
        ) as response:
            if response.status != 200:
                raise RuntimeError(f"{response.status}: {await response.text()}")
            return await response.read()


async def alone(door: Door, requests: int, seed: int) -> list[tuple[int, int, float]]:
    """`requests` sent one after another (after 5 unmeasured): each one's start and end (time.monotonic_ns) and the
    engine's time in its answer (latency_ms)."""
    numbers = iter(range(seed * 10**7, (seed + 1) * 10**7))
    calls = []
    async with door:
        for i in range(requests + 5):
            started = time.monotonic_ns()
            answer = await door.send(short6(next(numbers)))
            if i >= 5:
                calls.append((started, time.monotonic_ns(), json.loads(answer)["latency_ms"]))
    return calls


def median_ms(calls: list[tuple[int, int, float]]) -> float:
    return statistics.median(end - start for start, end, _ in calls) / 1e6


def alone_blocking(url: str, requests: int, seed: int) -> float:
    """As `alone`, with the blocking gRPC client (KevClient: no event loop between the call and its answer)."""
    numbers = iter(range(seed * 10**7, (seed + 1) * 10**7))
    times = []
    with KevClient(url) as kev:
        for i in range(requests + 5):
            body = short6(next(numbers))
            started = time.perf_counter()
            kev.score(body)
            if i >= 5:
                times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


async def _clients(
    kind: str, url: str, clients: int, warm: float, seconds: float, seed: int, start_at: float
) -> list[float]:
    """The latencies of the requests answered within the window of `seconds` that follows `warm` seconds of the same
    clients already running (so the window sees the load's steady state, not its start)."""
    numbers = iter(range(seed * 10**7, (seed + 1) * 10**7))
    latencies: list[float] = []
    await asyncio.sleep(max(0.0, start_at - time.time()))
    window = start_at + warm
    deadline = window + seconds
    async with Door(kind, url) as door:

        async def client() -> None:
            while time.time() < deadline:
                body = short6(next(numbers))
                started = time.time()
                await door.send(body)
                if window <= (ended := time.time()) <= deadline:
                    latencies.append(ended - started)

        await asyncio.gather(*(client() for _ in range(clients)))
    return latencies


def _process(clients: int, seed: int, start_at: float, kind: str, url: str, warm: float, seconds: float) -> list[float]:
    return asyncio.run(_clients(kind, url, clients, warm, seconds, seed, start_at))


def closed_loop(
    kind: str, url: str, clients: int, seconds: float, procs: int, seed: int, warm: float, at_window: Callable[[], None]
) -> dict[str, float]:
    """`clients` closed-loop clients over `procs` processes, all starting together: after `warm` seconds (when
    `at_window` is called, from this process), requests/s answered within the next `seconds`, their p50 and p99. The
    clients run through both without a pause: a slow model's batches are in their steady state when the window opens
    (started afresh, the window would lose up to a batch of answers at each end)."""
    runs = in_processes(_process, clients, procs, seed, kind, url, warm, seconds, during=(warm, at_window))
    latencies = sorted(latency for run in runs for latency in run)
    return {
        "rps": len(latencies) / seconds,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * (percentile(latencies, 0.99) or 0.0),
        "requests": len(latencies),
    }


def serving(grpc: str) -> list[int]:
    """The tritonserver whose gRPC port is `grpc`'s (by its command line) and its Python stubs; every tritonserver
    and stub on the machine where none says its port (another server on the host is left out when one does)."""
    port = grpc.rsplit(":", 1)[-1]
    servers, stubs = [], []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or (stat := procs.proc_stat(int(entry))) is None:
            continue
        if stat[0] == "tritonserver":
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            servers.append((int(entry), f"--grpc-port={port}".encode() in argv))
        elif stat[0] == procs.STUB_COMM:
            stubs.append((int(entry), stat[2]))
    ours = [pid for pid, matches in servers if matches] or [pid for pid, _ in servers]
    return ours + [pid for pid, parent in stubs if parent in ours]


def thread_seconds(grpc: str) -> dict[str, float]:
    """CPU seconds so far of each thread of the tritonserver behind `grpc` and its Python stubs, by "COMM PID/THREAD
    TID" (/proc's names)."""
    out = {}
    for pid in serving(grpc):
        if (stat := procs.proc_stat(pid)) is None:
            continue
        for tid, (name, seconds) in procs.thread_cpu_seconds(pid).items():
            out[f"{stat[0]} {pid}/{name} {tid}"] = seconds
    return out


def busiest(before: dict[str, float], after: dict[str, float], seconds: float, top: int = 8) -> dict[str, float]:
    """The `top` server threads by their share of one core over the run."""
    shares = {name: (after[name] - before.get(name, 0.0)) / seconds for name in after}
    return dict(sorted(shares.items(), key=lambda item: -item[1])[:top])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    doors = {"grpc": args.grpc, **({"gateway": args.gateway} if args.gateway else {})}
    seeds = iter(range(1, 10**6, SEED_STRIDE))
    record: dict[str, Any] = {}

    def totals() -> dict[str, float]:
        return server_totals(args.grpc, metrics_url=args.metrics)

    for kind, url in doors.items():
        before = totals()
        calls = asyncio.run(alone(Door(kind, url), args.alone, next(seeds)))
        one = {"one_client_p50_ms": median_ms(calls), "one_client_server": server_breakdown(before, totals())}
        if kind == "grpc":
            one["one_client_blocking_p50_ms"] = alone_blocking(url, args.alone, next(seeds))
        if args.admin_key_file:  # the same again, traced: where its time goes, phase by phase (through the gateway,
            # its own time is in to_triton and to_client)
            with TritonTrace(args.grpc, args.admin_key_file).traced() as traces:
                calls = asyncio.run(alone(Door(kind, url), args.alone, next(seeds)))
            one["one_client_phases_ms"] = phases(calls, traces)
        record[kind] = {**one, "levels": {}}
        print(f"{kind}: one client {one}", flush=True)
        for clients in args.clients:
            before: dict[str, float] = {}
            threads: dict[str, float] = {}

            def window_opens(before: dict[str, float] = before, threads: dict[str, float] = threads) -> None:
                before.update(totals())
                threads.update(thread_seconds(args.grpc))

            level = closed_loop(kind, url, clients, args.seconds, args.procs, next(seeds), args.warm, window_opens)
            level["server"] = server_breakdown(before, totals())
            level["server"]["busiest_threads"] = busiest(threads, thread_seconds(args.grpc), args.seconds)
            record[kind]["levels"][str(clients)] = level
            print(f"{kind}: {clients} clients {level}", flush=True)
    return record


def compare(record: dict[str, Any], inprocess: dict[str, Any] | None) -> dict[str, Any]:
    """The ratios the front door is held to."""
    grpc = record["grpc"]
    out: dict[str, Any] = {}
    if inprocess is not None:
        short = inprocess["workloads"]["short6"]
        out["inprocess"] = {"one_request_wall_ms": short["wall_new_ms"], "model_new_ms": short["new_ms"],
                            "rps": short["rps"]}  # fmt: skip
        out["one_client_overhead_ms"] = grpc["one_client_p50_ms"] - short["wall_new_ms"]
        out["served_over_inprocess"] = {
            n: level["rps"] / short["rps"][n] for n, level in grpc["levels"].items() if n in short["rps"]
        }
    if "gateway" in record:
        gateway = record["gateway"]
        out["gateway_one_client_added_ms"] = gateway["one_client_p50_ms"] - grpc["one_client_p50_ms"]
        out["gateway_over_grpc"] = {
            n: level["rps"] / grpc["levels"][n]["rps"] for n, level in gateway["levels"].items() if n in grpc["levels"]
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc", default="127.0.0.1:8001")
    parser.add_argument("--metrics", help="Triton's metrics address, e.g. 127.0.0.1:8002 (the engine's time a batch)")
    parser.add_argument("--gateway", help="the gateway's URL, e.g. http://127.0.0.1:8009 (default: gRPC only)")
    parser.add_argument("--inprocess", type=Path, help="the bench's JSON for the same model on the same GPU")
    parser.add_argument("--clients", type=lambda text: [int(n) for n in text.split(",")], default=[64, 128])
    parser.add_argument("--procs", type=int, default=4, help="client processes for the closed loops")
    parser.add_argument("--alone", type=int, default=200, help="requests of the one client")
    parser.add_argument("--seconds", type=float, default=5.0, help="each closed-loop level's measured window")
    parser.add_argument(
        "--warm", type=float, default=2.0, help="seconds each level's clients run before its window (default 2)"
    )
    parser.add_argument(
        "--admin-key-file",
        type=Path,
        help="Triton's admin key (kev-serve's TRITON_ADMIN_KEY_FILE): each door's one client again with Triton's"
        " trace on, its time by phase (loadtest/tracing.py; the server started with a trace file)",
    )
    parser.add_argument("--model", help="what the server serves, for the record (e.g. kev-0.8b-shapes)")
    parser.add_argument("--commit", help="the commit the record names (default: git's HEAD)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    inprocess = json.loads(args.inprocess.read_text()) if args.inprocess else None
    record = {
        "gpu": gpu_name(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(args.commit),
        "model": args.model or (inprocess or {}).get("model"),
        "workload": "short6 new",
        "procs": args.procs,
        **measure(args),
    }
    record |= compare(record, inprocess)
    summary = {key: record[key] for key in record if key.endswith(("_ms", "_over_inprocess", "_over_grpc"))}
    print(json.dumps(summary), flush=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
