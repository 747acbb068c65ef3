"""Slow and idle clients against the System One gateway: ordinary clients' latency before and while attackers hold
idle sockets and send bodies slowly. Needs tritonserver and kev-gateway running:

    python loadtest/slowclients.py --url http://127.0.0.1:8009 --idle 20000 --slow 1000 --processes 4 \
        --baseline-s 15 --attack-s 75 --out bench/results/DATE-slowclients.json

Ordinary clients (--clients threads) send one-question /v1/systemone requests, each on a new connection, back to
back. Attackers run in --processes processes (each raises its descriptor limit to its hard limit, and binds its own
loopback source address so their ports do not crowd the ordinary clients'):
- idle: --idle connections that send nothing; when the gateway closes one, it is opened again after
  0.5 to 1.5 times --reconnect-s (at random, so they do not come back in step);
- slow: --slow requests whose head is sent whole and whose body then comes a byte every --trickle-s seconds, or
  (--stall share of them) stops after a few bytes; each reopened after its answer or its close.
Writes JSON: the ordinary clients' p50/p99 and failures at baseline and under attack, what the attackers saw (their
connections, the statuses their slow bodies got), and the gateway's connection events over the attack.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import http.client
import json
import multiprocessing
import platform
import random
import resource
import statistics
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from loops import percentile

from kev_backend.serve.client import prometheus

EVENTS = "kev_gateway_connection_events_total"  # the gateway's counter of its front's refusals and closes
SLOW_BODY_BYTES = 1000  # what a slow request's Content-Length promises


# --- ordinary clients -------------------------------------------------------------------------------------------------


def ordinary_body(i: int) -> bytes:
    state = f"my card was charged twice for order {i % 8}, please refund one payment"
    question = {"type": "noul", "instructions": "is this urgent ?"}
    return json.dumps({"state": state, "questions": {"urgent": question}}).encode()


def one_request(host: str, port: int, key: str | None, i: int) -> tuple[bool, float, str]:
    """(answered, seconds, what failed) of one request on a new connection."""
    headers = {"content-type": "application/json", "connection": "close"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    started = time.perf_counter()
    connection = http.client.HTTPConnection(host, port, timeout=60)
    try:
        connection.request("POST", "/v1/systemone", ordinary_body(i), headers)
        response = connection.getresponse()
        body = response.read()
        ok = response.status == 200 and b'"answers"' in body
        return ok, time.perf_counter() - started, "" if ok else f"{response.status}: {body[:120]!r}"
    except OSError as error:
        return False, time.perf_counter() - started, f"{type(error).__name__}: {error}"
    finally:
        connection.close()


def ordinary_clients(url: str, key: str | None, seconds: float, clients: int) -> dict[str, Any]:
    """Back-to-back requests from `clients` threads for `seconds`: latencies of those answered, and failures."""
    parts = urlsplit(url)
    latencies: list[float] = []
    failures: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    lock = threading.Lock()

    def run(worker: int) -> None:
        i = worker
        while time.monotonic() < deadline:
            ok, elapsed, why = one_request(parts.hostname or "127.0.0.1", parts.port or 80, key, i)
            with lock:
                if ok:
                    latencies.append(elapsed)
                else:
                    failures[why[:80]] += 1
            i += clients

    threads = [threading.Thread(target=run, args=(w,)) for w in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ms = [x * 1000 for x in latencies]
    return {
        "requests": len(latencies) + sum(failures.values()),
        "answered": len(latencies),
        "failures": sum(failures.values()),
        "failure_kinds": dict(failures.most_common(10)),
        "p50_ms": round(statistics.median(ms), 2) if ms else None,
        "p99_ms": round(percentile(ms, 0.99), 2) if ms else None,
        "max_ms": round(max(ms), 2) if ms else None,
    }


# --- attackers --------------------------------------------------------------------------------------------------------


class Tally:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def add(self, what: str) -> None:
        self.counts[what] += 1


async def connect(host: str, port: int, source: str, gate: asyncio.Semaphore):
    async with gate:  # a bounded number of connects at once: the listen backlog is finite
        return await asyncio.open_connection(host, port, local_addr=(source, 0))


async def idle_socket(host: str, port: int, source: str, gate, stop: asyncio.Event, tally: Tally, reconnect_s: float):
    """A connection that sends nothing, reopened after the gateway closes it."""
    while not stop.is_set():
        try:
            reader, writer = await connect(host, port, source, gate)
        except OSError as error:
            tally.add(f"idle connect failed: {type(error).__name__}")
            await asyncio.sleep(reconnect_s * random.uniform(0.5, 1.5))
            continue
        tally.add("idle connected")
        closed, stopped = asyncio.ensure_future(reader.read(65536)), asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([closed, stopped], return_when=asyncio.FIRST_COMPLETED)
            if closed.done() and not closed.exception():
                tally.add("idle closed by the gateway")
            elif closed.done():
                tally.add("idle reset by the gateway")
        finally:
            closed.cancel()
            stopped.cancel()
            writer.close()
        await asyncio.sleep(reconnect_s * random.uniform(0.5, 1.5))  # clients that do not reconnect in step


async def slow_body(
    host: str, port: int, source: str, gate, stop: asyncio.Event, tally: Tally, key: str | None, stall: bool, trickle_s
):
    """A request whose body comes a byte every `trickle_s` (or stops after a few bytes), reopened after it ends."""
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST /v1/systemone HTTP/1.1\r\nhost: kev\r\ncontent-type: application/json\r\n{auth}"
        f"content-length: {SLOW_BODY_BYTES}\r\n\r\n"
    ).encode()
    while not stop.is_set():
        try:
            reader, writer = await connect(host, port, source, gate)
        except OSError as error:
            tally.add(f"slow connect failed: {type(error).__name__}")
            await asyncio.sleep(1)
            continue
        tally.add("slow connected")
        answer, stopped = asyncio.ensure_future(reader.read(4096)), asyncio.ensure_future(stop.wait())
        try:
            writer.write(head + b'{"state": ')
            sent = 10
            while not answer.done() and not stop.is_set() and sent < SLOW_BODY_BYTES - 1:
                if not stall:
                    writer.write(b" ")
                    sent += 1
                await asyncio.wait([answer, stopped], timeout=trickle_s)
            if answer.done() and answer.exception() is None:
                data = answer.result()
                status = data[9:12].decode(errors="replace") if data.startswith(b"HTTP/1.1 ") else "closed"
                tally.add(f"slow answered {status}")
            elif answer.done():
                tally.add("slow reset")
        except OSError:
            tally.add("slow reset")
        finally:
            answer.cancel()
            stopped.cancel()
            writer.close()


def attacker(
    url: str, key: str | None, source: str, idle: int, slow: int, stall: float, trickle_s: float, reconnect_s: float,
    ready, stop_flag, results,
) -> None:  # fmt: skip
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80

    async def run() -> dict[str, int]:
        stop, tally, gate = asyncio.Event(), Tally(), asyncio.Semaphore(256)
        stalled = int(slow * stall)
        tasks = [
            asyncio.ensure_future(idle_socket(host, port, source, gate, stop, tally, reconnect_s)) for _ in range(idle)
        ]
        tasks += [
            asyncio.ensure_future(slow_body(host, port, source, gate, stop, tally, key, i < stalled, trickle_s))
            for i in range(slow)
        ]
        while tally.counts["idle connected"] + tally.counts["slow connected"] < idle + slow:
            await asyncio.sleep(0.2)
        ready.set()
        while not stop_flag.is_set():
            await asyncio.sleep(0.2)
        stop.set()
        await asyncio.wait(tasks, timeout=10)
        return dict(tally.counts)

    results.put(asyncio.run(run()))


# --- the gateway's own counts -----------------------------------------------------------------------------------------


def gateway_metrics(url: str) -> list[prometheus.Sample]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("GET", "/metrics")
        return prometheus.parse(connection.getresponse().read().decode())
    finally:
        connection.close()


def connections(url: str) -> float:
    return prometheus.total(gateway_metrics(url), "kev_gateway_connections")


def events(before: list[prometheus.Sample], after: list[prometheus.Sample]) -> dict[str, float]:
    """Each connection event's count between two scrapes."""

    def counts(samples: list[prometheus.Sample]) -> dict[str, float]:
        return {labels["event"]: value for name, labels, value in samples if name == EVENTS and "event" in labels}

    old = counts(before)
    return {event: value - old.get(event, 0.0) for event, value in counts(after).items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    baseline = ordinary_clients(args.url, args.key, args.baseline_s, args.clients)
    print(f"baseline: {baseline}", flush=True)
    before = gateway_metrics(args.url)
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    readies, processes = [], []
    for p in range(args.processes):
        share_idle = args.idle // args.processes + (1 if p < args.idle % args.processes else 0)
        share_slow = args.slow // args.processes + (1 if p < args.slow % args.processes else 0)
        ready = context.Event()
        source = f"127.0.{1 + p // 250}.{2 + p % 250}"
        process = context.Process(
            target=attacker,
            args=(args.url, args.key, source, share_idle, share_slow, args.stall, args.trickle_s, args.reconnect_s),
            kwargs={"ready": ready, "stop_flag": stop, "results": results},
        )
        process.start()
        readies.append(ready)
        processes.append(process)
    opened = time.monotonic()
    for ready in readies:
        ready.wait(timeout=args.open_timeout_s)
    opening_s = time.monotonic() - opened
    print(f"attackers connected in {opening_s:.1f} s", flush=True)
    peak = {"connections": 0.0}
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(2.0):
            try:
                peak["connections"] = max(peak["connections"], connections(args.url))
            except OSError:
                pass

    sampler = threading.Thread(target=sample)
    sampler.start()
    attack = ordinary_clients(args.url, args.key, args.attack_s, args.clients)
    sampling.set()
    sampler.join()
    print(f"under attack: {attack}", flush=True)
    after = gateway_metrics(args.url)
    stop.set()
    attackers: Counter[str] = Counter()
    for _ in processes:
        attackers.update(results.get(timeout=60))
    for process in processes:
        process.join(timeout=30)
    return {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {
            "machine": platform.machine(),
            "cpus": multiprocessing.cpu_count(),
            "python": platform.python_version(),
        },
        "gateway": args.url,
        "parameters": {
            key: getattr(args, key)
            for key in ("idle", "slow", "stall", "trickle_s", "reconnect_s", "processes", "clients")
            + ("baseline_s", "attack_s")
        },
        "baseline": baseline,
        "attack": attack,
        "p50_ratio": round(attack["p50_ms"] / baseline["p50_ms"], 3)
        if attack["p50_ms"] and baseline["p50_ms"]
        else None,
        "p99_ratio": round(attack["p99_ms"] / baseline["p99_ms"], 3)
        if attack["p99_ms"] and baseline["p99_ms"]
        else None,
        "attackers_connected_s": round(opening_s, 1),
        "attackers": dict(sorted(attackers.items())),
        "gateway_connections_peak": peak["connections"],
        "gateway_connection_events": events(before, after),
        "gateway_in_flight_after": prometheus.total(after, "kev_gateway_in_flight"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8009")
    parser.add_argument("--key", default=None, help="the gateway's bearer key, if it has one")
    parser.add_argument("--idle", type=int, default=20_000)
    parser.add_argument("--slow", type=int, default=1_000)
    parser.add_argument("--stall", type=float, default=0.5, help="share of slow bodies that stop after a few bytes")
    parser.add_argument("--trickle-s", type=float, default=1.0)
    parser.add_argument("--reconnect-s", type=float, default=30.0)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--clients", type=int, default=4, help="ordinary clients, each with one request at a time")
    parser.add_argument("--baseline-s", type=float, default=15.0)
    parser.add_argument("--attack-s", type=float, default=75.0)
    parser.add_argument("--open-timeout-s", type=float, default=120.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("baseline", "attack", "p50_ratio", "p99_ratio")}, indent=2))


if __name__ == "__main__":
    main()
