"""Closed-loop load on a running Kev Triton server: N gRPC clients, each sending its next request when the last
one answers, for a fixed time. Prints requests/s and latency percentiles.

    python loadtest/closed_loop.py --url 127.0.0.1:8001 --clients 32 --seconds 10 [--same-state]

Locust users and open-loop (Poisson) drivers build on the same request shapes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferInput

SUPPORT_QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Does this ticket need a reply today?"},
    "team": {
        "type": "choice",
        "instructions": "Which team should handle it?",
        "criteria": {"billing": "payments, refunds, invoices", "technical": "bugs and outages", "sales": None},
    },
    "tone": {"type": "score", "instructions": "Customer sentiment", "criteria": ["angry", "neutral", "happy"]},
}


def ticket(i: int, same_state: bool) -> bytes:
    prefix = "" if same_state else f"Ticket {i}. "
    state = prefix + "My card was charged twice for the same order. Please refund one of the payments."
    return json.dumps({"state": state, "questions": SUPPORT_QUESTIONS}).encode()


async def client_loop(
    client: grpcaio.InferenceServerClient,
    model: str,
    deadline: float,
    same_state: bool,
    latencies: list[float],
    errors: list[str],
    offset: int,
) -> None:
    i = offset
    while time.perf_counter() < deadline:
        inp = InferInput("REQUEST", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[ticket(i, same_state)]], dtype=np.object_))
        started = time.perf_counter()
        try:
            await client.infer(model, [inp])
            latencies.append(time.perf_counter() - started)
        except Exception as error:  # counted and reported, the run goes on
            errors.append(str(error))
        i += 1_000_003  # distinct states per client


async def run(args: argparse.Namespace) -> None:
    client = grpcaio.InferenceServerClient(args.url)
    latencies: list[float] = []
    errors: list[str] = []
    deadline = time.perf_counter() + args.seconds
    started = time.perf_counter()
    try:
        await asyncio.gather(
            *(
                client_loop(client, args.model, deadline, args.same_state, latencies, errors, c)
                for c in range(args.clients)
            )
        )
    finally:
        await client.close()
    elapsed = time.perf_counter() - started
    ms = sorted(x * 1000 for x in latencies)
    pct = {p: ms[min(len(ms) - 1, int(p / 100 * len(ms)))] for p in (50, 95, 99)} if ms else {}
    print(
        json.dumps(
            {
                "clients": args.clients,
                "requests": len(ms),
                "errors": len(errors),
                "rps": round(len(ms) / elapsed, 1),
                "p50_ms": pct.get(50),
                "p95_ms": pct.get(95),
                "p99_ms": pct.get(99),
                "mean_ms": round(statistics.fmean(ms), 2) if ms else None,
            }
        )
    )
    if errors:
        print("first error:", errors[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--model", default="kev")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--same-state", action="store_true", help="every request on the same state (bank hits)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
