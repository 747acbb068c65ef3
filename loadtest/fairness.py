"""Short requests while long work keeps arriving: is any short request held behind more than one unit of long work?

    python loadtest/fairness.py --tokenizer BASE_DIR --out fairness.json [--grpc 127.0.0.1:8001] \\
        [--long state|permute] [--tokens 65536] [--clients 8] [--long-clients 1] [--seconds 60] [--unit-tokens 4096]

Three phases over gRPC, each against a running server:
1. quiet: `--clients` closed-loop short6 clients (new states) for `--seconds`: their p50 and p99;
2. alone: one short6 client alone (`solo`), then long requests one at a time beside it: each one's latency;
3. loaded: the short6 clients again while `--long-clients` closed-loop clients keep sending long requests.

Long requests are `state` (long5's five questions on a new state of exactly `--tokens` tokens, <state> included, as
the checkpoint's tokenizer counts: `--tokenizer` is its base directory) or `permute` (what the gateway sends for a
/permute of 64 orders of a 255-option question: one request of 64 questions on a new short state).

One work unit, the most a short request should wait behind long work, is measured: while each long request runs
alone, one client sends short6 requests back to back, and the longest of them less one client's p50 with nothing
else running (`solo`, a few seconds first) is the longest wait behind one unit of long work (`unit_ms`; on the CPU
the last chunk of a long state, which attends to all before it; on a GPU a long state's whole pass). The goal holds
when the loaded p99 is at most twice the quiet p99 plus one unit (`goal_ms`, `fair`). `mean_unit_ms` is a long
request's latency alone over its units, `--units` (default: a state's chunks of `--unit-tokens` and its row passes,
as the CPU reference path runs them; a GPU runs a long state or a /permute as one pass: `--units 1`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from loops import percentile

from kev_backend.dev.provenance import commit, gpu_name
from kev_backend.dev.workloads import short6, sized, state_counter
from kev_backend.protocol.encoding import KevTokenizer
from kev_backend.serve.client import AsyncKevClient, KevError

SOLO_S = 5.0  # one short6 client alone, before the long requests alone
COUNTER = itertools.count(30_000_000)  # states no other load test sends
OPTIONS = dict.fromkeys((f"option {i}" for i in range(255)), None)  # a 7.8 KB /permute body, as hostile clients send
CHOICE = {"type": "choice", "instructions": "Which team should take this ticket?", "criteria": OPTIONS}


def summary(latencies: list[float], failures: int) -> dict[str, Any]:
    p99 = percentile(latencies, 0.99)
    return {
        "requests": len(latencies),
        "failures": failures,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else None,
        "p99_ms": 1000 * p99 if p99 is not None else None,
        "max_ms": 1000 * max(latencies) if latencies else None,
    }


async def loop(
    kev: AsyncKevClient, make: Any, deadline: float, latencies: list[float], failures: list[str], apart: bool = False
) -> None:
    """One closed-loop client: a new request as soon as the last one is answered, until `deadline`. `apart`: its
    bodies are made on a thread (a long state is tokenized to size it: a tenth of a second or more, during which the
    event loop would not see the short clients' answers and would count the stall in their latency)."""
    while time.perf_counter() < deadline:
        body = await asyncio.to_thread(lambda: json.dumps(make())) if apart else json.dumps(make())
        started = time.perf_counter()
        try:
            reply = json.loads(await kev.score_raw(body))
            if "answers" not in reply:
                raise RuntimeError(f"no answers: {str(reply)[:200]}")
            latencies.append(time.perf_counter() - started)
        except (KevError, RuntimeError) as error:
            failures.append(repr(error)[:300])


async def long_alone(kev: AsyncKevClient, body: dict[str, Any], short: Any) -> tuple[float, list[float]]:
    """One long request with nothing else but one short6 client sending back to back until it is answered: its
    seconds, and the short requests' (each of which waits behind at most one unit of the long one's work)."""
    waits: list[float] = []
    finished = asyncio.Event()

    async def probe() -> None:
        while not finished.is_set():
            started = time.perf_counter()
            await kev.score_raw(json.dumps(short()))
            waits.append(time.perf_counter() - started)

    prober = asyncio.ensure_future(probe())
    started = time.perf_counter()
    await kev.score_raw(json.dumps(body))
    seconds = time.perf_counter() - started
    finished.set()
    await prober
    return seconds, waits


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    if args.long == "state":
        count = state_counter(KevTokenizer(args.tokenizer))
        tokens = count(sized(args.tokens, count, 0))

        def long_body() -> dict[str, Any]:
            return sized(args.tokens, count, next(COUNTER))

        units = args.units or math.ceil(tokens / args.unit_tokens) + 5  # and a row pass a question (long5's five)
    else:
        tokens = 0

        def long_body() -> dict[str, Any]:
            state = f"Ticket {next(COUNTER)}. My card was charged twice."
            return {"state": state, "questions": {str(i): CHOICE for i in range(64)}}

        units = args.units or 1

    def short() -> dict[str, Any]:
        return short6(next(COUNTER))

    record: dict[str, Any] = {"long": args.long, "state_tokens": tokens, "units_per_long": units}
    async with AsyncKevClient(args.grpc, "grpc", timeout_s=args.timeout) as kev:
        for _ in range(args.warm):  # warm-up: the first passes of each shape after start are not measured
            await kev.score_raw(json.dumps(long_body()))
            await kev.score_raw(json.dumps(short()))
        latencies: list[float] = []
        failures: list[str] = []
        deadline = time.perf_counter() + args.seconds
        await asyncio.gather(*(loop(kev, short, deadline, latencies, failures) for _ in range(args.clients)))
        record["quiet"] = summary(latencies, len(failures))
        print(f"quiet: {record['quiet']}", flush=True)

        # The client beside a lone long request is alone: its own latency with nothing ahead is one client's.
        solo: list[float] = []
        solo_failures: list[str] = []
        await loop(kev, short, time.perf_counter() + SOLO_S, solo, solo_failures)
        record["solo"] = summary(solo, len(solo_failures))
        alone, beside = [], []
        for _ in range(args.alone):
            seconds, waits = await long_alone(kev, long_body(), short)
            alone.append(seconds)
            beside.extend(waits)
        record["long_alone_ms"] = [1000 * s for s in alone]
        record["mean_unit_ms"] = 1000 * statistics.median(alone) / units
        record["beside_alone"] = summary(beside, 0)
        record["unit_ms"] = 1000 * max(beside) - record["solo"]["p50_ms"]
        print(f"long alone: {record['long_alone_ms']} ms; one unit {record['unit_ms']:.0f} ms", flush=True)

        latencies, failures, long_latencies, long_failures = [], [], [], []
        deadline = time.perf_counter() + args.seconds
        await asyncio.gather(
            *(loop(kev, short, deadline, latencies, failures) for _ in range(args.clients)),
            *(loop(kev, long_body, deadline, long_latencies, long_failures, True) for _ in range(args.long_clients)),
        )
        record["loaded"] = summary(latencies, len(failures))
        record["loaded_long"] = summary(long_latencies, len(long_failures))
        record["failures"] = (failures + long_failures)[:10]
        print(f"loaded: {record['loaded']}; long: {record['loaded_long']}", flush=True)
    record["goal_ms"] = 2 * record["quiet"]["p99_ms"] + record["unit_ms"]
    record["fair"] = not failures and record["loaded"]["p99_ms"] <= record["goal_ms"]
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, help="the checkpoint's base (tokenizer.json), for --long state")
    parser.add_argument("--grpc", default="127.0.0.1:8001")
    parser.add_argument("--long", choices=["state", "permute"], default="state")
    parser.add_argument("--tokens", type=int, default=65_536, help="each long state's tokens, <state> included")
    parser.add_argument("--unit-tokens", type=int, default=4_096, help="state tokens a unit of the server's work")
    parser.add_argument("--units", type=int, help="units of work a long request is (default: see above)")
    parser.add_argument("--clients", type=int, default=8, help="short6 clients")
    parser.add_argument("--long-clients", type=int, default=1, help="clients sending long requests")
    parser.add_argument("--seconds", type=float, default=60.0, help="each of the quiet and loaded phases")
    parser.add_argument("--alone", type=int, default=2, help="long requests timed alone")
    parser.add_argument("--warm", type=int, default=1, help="long and short requests sent first, not measured")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    parser.add_argument("--label", default="", help="a name for the run in the record (e.g. the code measured)")
    parser.add_argument("--commit", help="the commit the record names (default: git's HEAD)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.long == "state" and args.tokenizer is None:
        parser.error("--long state needs --tokenizer")
    record = {
        "gpu": gpu_name(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(args.commit),
        "label": args.label,
        "clients": args.clients,
        "long_clients": args.long_clients,
        "seconds": args.seconds,
        **asyncio.run(measure(args)),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("label", "gpu", "quiet", "loaded", "unit_ms", "goal_ms", "fair")}))


if __name__ == "__main__":
    main()
