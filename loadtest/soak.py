"""Soak test of Kev on Triton: hours of steady open-loop traffic, watching memory, latency and errors for drift.

Poisson arrivals at `--rate` requests/s in total, split between Triton's gRPC port and the System One gateway. Most
requests are good ones of a Traffic shape; `--bad-share` are hostile inputs that must each get their own client error
(gRPC INVALID_ARGUMENT, gateway 4xx JSON), and `--disconnect-share` are abandoned by their client (a gRPC call
cancelled just after it is sent; a raw HTTP request to the gateway whose socket is closed at once). Every
`--sample-seconds` it records the counts so far, the period's p50/p99 latency of good requests, tritonserver's and
its Python stub's RSS, the GPU memory used and the backend's gauges (state bank, CUDA graphs, tokenizer cache) and
refusals by reason from Triton's metrics. Growth of each memory figure is reported from the first sample after the
warm-up to the last. Writes OUT/soak.json and OUT/soak.png, prints a table, and exits 1 on any unexpected error.

    python loadtest/soak.py --minutes 60 --rate 40 --shape mix --server-pid $(pgrep -x tritonserver) --out out/soak

Traffic goes only to the addresses given, and only to loopback ones: hostile bodies and 5 MB uploads are not for
a shared server. The run ends by itself: no new request after `--minutes` (or `--max-requests`, or Ctrl-C), then at
most `--timeout` seconds for the last answers.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import ipaddress
import itertools
import json
import random
import signal
import socket
import sys
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from soak_report import latency_drift, plot, print_table, server_latencies, summarize, windows
from soak_watch import Watch

from kev_backend.dev.provenance import commit, gpu_name
from kev_backend.dev.workloads import Traffic
from kev_backend.serve.client import AsyncKevClient, KevError

REPO = Path(__file__).resolve().parents[1]

# What became of one request.
ANSWERED = "answered"  # a good request answered, every question it asked answered
EXPECTED = "expected_error"  # a bad request refused with the error its case expects
DISCONNECT = "disconnect"  # a request whose client went away, ended by that (or answered before it could)
OVERLOAD = "refused_overload"  # Triton's queue (gRPC UNAVAILABLE) or the gateway (429 / 529) refused it at once
UNEXPECTED = "unexpected"  # anything else: a failed good request, a wrong refusal, no answer in time

GATEWAY_PATH = "/v1/systemone"
GATEWAY_OVERLOAD = (429, 529)  # the gateway's own in-flight limit, and Triton's queue as the gateway reports it
# A gRPC disconnect cancels its call this long after sending: long enough for the request to reach Triton's queue
# (or its batch), short enough that most are still unanswered.
CANCEL_AFTER_S = (0.002, 0.02)
EXAMPLES_KEPT = 20  # distinct unexpected errors described in the JSON, with their counts; others are only counted
WORDS = "the refund is late please help "


# --- bad inputs -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BadCase:
    """A request Kev must refuse: its body and the gateway statuses that count as the right refusal (gRPC: always
    INVALID_ARGUMENT)."""

    name: str
    body: bytes
    gateway_statuses: tuple[int, ...] = (422,)


def request_body(state: Any, questions: dict[str, Any] | None = None) -> bytes:
    return json.dumps({"state": state, "questions": questions or {"q": {"type": "noul"}}}).encode()


def bad_cases() -> list[BadCase]:
    """One of each way tests/serve/test_hostile_at_every_door.py found to hurt a server, built once (the largest is
    5 MB)."""
    depth = 400  # past the 64-level limit; written as text, so nothing recursive builds it
    deep = b'{"state": ' + b"[" * depth + b'"leaf"' + b"]" * depth + b', "questions": {"q": {"type": "noul"}}}'
    noul = {"type": "noul", "instructions": "is this urgent ?"}
    return [
        BadCase("deep nesting", deep),
        # json.dumps cannot write a lone surrogate: the escape is written by hand
        BadCase("lone surrogate", b'{"state": "a \\ud800 b", "questions": {"q": {"type": "noul"}}}'),
        BadCase("too many questions", request_body("x", {f"q{i}": noul for i in range(257)})),
        BadCase("state over the token limit", request_body(WORDS * 20_000)),
        # the gateway refuses a body it cannot parse with 422 (Kev's form) or 400
        BadCase("invalid JSON", request_body("x")[:-3], (422, 400)),
        BadCase("5 MB body", request_body(WORDS * (5_000_000 // len(WORDS))), (413,)),
    ]


# --- sending ----------------------------------------------------------------------------------------------------


Result = tuple[str, str]  # (outcome, what happened when it is not the expected one)


def check_answer(raw: bytes, questions: frozenset[str]) -> Result:
    """A good request's answer: JSON holding exactly the questions asked (a reply meant for another request of the
    same batch would not)."""
    try:
        answers = json.loads(raw)["answers"]
    except (ValueError, KeyError, TypeError) as error:
        return UNEXPECTED, f"unreadable answer: {error!r}"
    if set(answers) != questions:
        return UNEXPECTED, f"answered {sorted(answers)[:5]}, asked {sorted(questions)[:5]}"
    return ANSWERED, ""


def kev_error(error: KevError) -> Result:
    if error.kind == "overloaded":
        return OVERLOAD, error.message[:200]
    return UNEXPECTED, f"{error.status} {error.message[:200]}"


async def grpc_good(kev: AsyncKevClient, body: bytes, questions: frozenset[str]) -> Result:
    try:
        raw = await kev.score_raw(body)
    except KevError as error:
        return kev_error(error)
    return check_answer(raw, questions)


async def grpc_bad(kev: AsyncKevClient, case: BadCase) -> Result:
    try:
        await kev.score_raw(case.body)
    except KevError as error:
        if error.status == "StatusCode.INVALID_ARGUMENT":
            return EXPECTED, ""
        return kev_error(error)
    return UNEXPECTED, "answered"


async def grpc_disconnect(kev: AsyncKevClient, body: bytes, delay_s: float) -> Result:
    """Send, then cancel the call (the gRPC client going away): Triton drops it if still queued."""
    call = asyncio.ensure_future(kev.score_raw(body))
    try:
        await asyncio.sleep(delay_s)
    finally:  # also when this request is itself abandoned: no call left running unawaited
        call.cancel()
    await asyncio.wait((call,))  # the call's own end, not a cancellation of this coroutine
    if call.cancelled():
        return DISCONNECT, ""
    error = call.exception()
    if error is None:  # answered before the cancel: the server did nothing wrong
        return DISCONNECT, ""
    if isinstance(error, KevError) and error.status == "StatusCode.CANCELLED":  # the cancel, as gRPC reported it
        return DISCONNECT, ""
    if isinstance(error, KevError):
        return kev_error(error)
    return UNEXPECTED, repr(error)


async def gateway_post(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, bytes]:
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as response:
        return response.status, await response.read()


async def gateway_good(session: aiohttp.ClientSession, url: str, body: bytes, questions: frozenset[str]) -> Result:
    status, raw = await gateway_post(session, url, body)
    if status == 200:
        return check_answer(raw, questions)
    if status in GATEWAY_OVERLOAD:
        return OVERLOAD, f"{status}"
    return UNEXPECTED, f"{status} {raw[:200]!r}"


async def gateway_bad(session: aiohttp.ClientSession, url: str, case: BadCase) -> Result:
    status, raw = await gateway_post(session, url, case.body)
    if status in GATEWAY_OVERLOAD:
        return OVERLOAD, f"{status}"
    if status not in case.gateway_statuses:
        return UNEXPECTED, f"{status}, expected {case.gateway_statuses}: {raw[:200]!r}"
    try:
        json.loads(raw)["detail"]  # every refusal is JSON with a `detail`
    except (ValueError, KeyError, TypeError):
        return UNEXPECTED, f"{status} without a JSON detail: {raw[:200]!r}"
    return EXPECTED, ""


async def gateway_disconnect(host: str, port: int, body: bytes) -> Result:
    """The whole request on a raw socket, then the socket closed at once, before any answer."""
    try:
        _, writer = await asyncio.open_connection(host, port)
    except OSError as error:  # the gateway not accepting connections is a failure, not a disconnect
        return UNEXPECTED, f"connect: {error!r}"
    head = (
        f"POST {GATEWAY_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    try:
        writer.write(head.encode() + body)
        await writer.drain()
        writer.close()
        await writer.wait_closed()
    except ConnectionError:  # the server closing first is still a closed connection
        pass
    return DISCONNECT, ""


# --- counting ---------------------------------------------------------------------------------------------------


@dataclass
class Tally:
    """Every request's outcome so far, and the latencies of the good ones answered in the current sample period."""

    allow_overload: bool
    sent: int = 0
    counts: Counter = field(default_factory=Counter)  # outcome -> requests
    outcomes: Counter = field(default_factory=Counter)  # "channel/kind/outcome" -> requests
    unexpected: int = 0
    examples: Counter = field(default_factory=Counter)  # description -> requests
    period_ms: list[float] = field(default_factory=list)

    def record(self, channel: str, kind: str, case: str, result: Result, latency_s: float) -> None:
        outcome, detail = result
        self.counts[outcome] += 1
        self.outcomes[f"{channel}/{kind}/{outcome}"] += 1
        if outcome == ANSWERED:
            self.period_ms.append(1000 * latency_s)
        if outcome == UNEXPECTED or (outcome == OVERLOAD and not self.allow_overload):
            self.unexpected += 1
            example = f"{channel} {kind}{f' ({case})' if case else ''}: {outcome}: {detail}"[:400]
            if example in self.examples or len(self.examples) < EXAMPLES_KEPT:
                self.examples[example] += 1

    def snapshot(self) -> dict[str, Any]:
        """The counts so far and the period's latency percentiles; starts a new period."""
        latencies, self.period_ms = sorted(self.period_ms), []
        return {
            "sent": self.sent,
            "answered": self.counts[ANSWERED],
            "expected_errors": self.counts[EXPECTED],
            "unexpected_errors": self.unexpected,
            "refused_overload": self.counts[OVERLOAD],
            "disconnects": self.counts[DISCONNECT],
            "in_flight": self.sent - sum(self.counts.values()),
            "good_in_period": len(latencies),
            "p50_ms": percentile(latencies, 0.50),
            "p99_ms": percentile(latencies, 0.99),
        }


def percentile(ordered: list[float], q: float) -> float | None:
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2) if ordered else None


# --- the run ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One request as drawn at its arrival: where it goes, what it is, and its body."""

    channel: str  # grpc | gateway
    kind: str  # good | bad | disconnect
    body: bytes
    questions: frozenset[str] = frozenset()
    case: BadCase | None = None


class Soak:
    """One run: offers the traffic, records every request's outcome and samples the server as it goes."""

    def __init__(
        self, args: argparse.Namespace, kev: AsyncKevClient, session: aiohttp.ClientSession | None, watch: Watch
    ) -> None:
        self.args, self.kev, self.session, self.watch = args, kev, session, watch
        self.rng = random.Random(args.seed)
        self.traffic = Traffic(args.shape, args.repeat, seed=args.seed)
        self.cases = bad_cases()
        self.tally = Tally(allow_overload=args.allow_overload)
        self.samples: list[dict[str, Any]] = []
        self.pending: set[asyncio.Task] = set()
        self.stop = asyncio.Event()
        self.started = time.monotonic()

    def plan(self) -> Planned:
        rng, args = self.rng, self.args
        channel = "gateway" if self.session is not None and rng.random() < args.gateway_share else "grpc"
        draw = rng.random()
        if draw < args.bad_share:
            case = rng.choice(self.cases)
            return Planned(channel, "bad", case.body, case=case)
        request = self.traffic.next()
        kind = "disconnect" if draw < args.bad_share + args.disconnect_share else "good"
        return Planned(channel, kind, json.dumps(request).encode(), frozenset(request["questions"]))

    def sender(self, planned: Planned) -> Awaitable[Result]:
        if planned.channel == "grpc":
            if planned.kind == "bad":
                assert planned.case is not None
                return grpc_bad(self.kev, planned.case)
            if planned.kind == "disconnect":
                return grpc_disconnect(self.kev, planned.body, self.rng.uniform(*CANCEL_AFTER_S))
            return grpc_good(self.kev, planned.body, planned.questions)
        assert self.session is not None
        url = self.args.gateway + GATEWAY_PATH
        if planned.kind == "bad":
            assert planned.case is not None
            return gateway_bad(self.session, url, planned.case)
        if planned.kind == "disconnect":
            parts = urllib.parse.urlsplit(self.args.gateway)
            return gateway_disconnect(parts.hostname or "127.0.0.1", parts.port or 80, planned.body)
        return gateway_good(self.session, url, planned.body, planned.questions)

    async def one(self, planned: Planned, arrival: float) -> None:
        """Send one request and record its outcome; latency counts from its scheduled arrival (open loop)."""
        try:
            result = await asyncio.wait_for(self.sender(planned), self.args.timeout)
        except TimeoutError:
            result = (UNEXPECTED, f"no answer within {self.args.timeout:g} s")
        except Exception as error:  # a client-side failure (reset, refused connection) is counted, never fatal
            result = (UNEXPECTED, repr(error)[:300])
        case = planned.case.name if planned.case else ""
        self.tally.record(planned.channel, planned.kind, case, result, time.monotonic() - arrival)

    def launch(self, planned: Planned, arrival: float) -> None:
        task = asyncio.ensure_future(self.one(planned, arrival))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)
        self.tally.sent += 1

    async def offer(self) -> None:
        """Poisson arrivals until the time or the request budget is spent, or a stop signal."""
        t, seconds = 0.0, 60 * self.args.minutes
        while not self.stop.is_set() and self.tally.sent < self.args.max_requests:
            t += self.rng.expovariate(self.args.rate)
            if t >= seconds:
                break
            # sleep(0) when behind schedule still lets the answers in flight be handled
            await asyncio.sleep(max(0.0, self.started + t - time.monotonic()))
            self.launch(self.plan(), self.started + t)

    def on_signal(self) -> None:
        """The first Ctrl-C (or SIGTERM) ends the offer and lets the requests in flight finish; a second abandons
        them (they stay `in_flight` in the last sample, reported as `abandoned`)."""
        if self.stop.is_set():
            for task in list(self.pending):
                task.cancel()
        self.stop.set()

    async def sample(self) -> None:
        counts = self.tally.snapshot()
        figures = await asyncio.to_thread(self.watch.read)
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.samples.append({"t_s": round(time.monotonic() - self.started, 2), "time": now, **counts, **figures})

    async def sample_every(self, period_s: float) -> None:
        for k in itertools.count(1):  # periods counted from the start, so a slow read does not shift them
            await asyncio.sleep(max(0.0, self.started + k * period_s - time.monotonic()))
            await self.sample()

    async def drain(self) -> None:
        """The last requests, each already bounded by its timeout; a margin for the event loop, then give up."""
        if self.pending:
            await asyncio.wait(set(self.pending), timeout=self.args.timeout + 10)
        for task in list(self.pending):
            task.cancel()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self.on_signal)
        await self.sample()  # before any traffic: the baseline
        sampler = asyncio.ensure_future(self.sample_every(self.args.sample_seconds))
        try:
            await self.offer()
            await self.drain()
        finally:
            sampler.cancel()
        await self.sample()


async def drive(args: argparse.Namespace) -> Soak:
    watch = Watch(args.server_pid, args.metrics, None if args.gateway is None else args.gateway + "/metrics")
    async with AsyncKevClient(args.triton_grpc, "grpc", args.model, timeout_s=args.timeout) as kev:
        if args.gateway is None:
            soak = Soak(args, kev, None, watch)
            await soak.run()
            return soak
        # No limit on connections: an open loop must not queue its own requests behind a pool.
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            soak = Soak(args, kev, session, watch)
            await soak.run()
            return soak


# --- results ----------------------------------------------------------------------------------------------------


def build_record(args: argparse.Namespace, soak: Soak) -> dict[str, Any]:
    tally, samples = soak.tally, soak.samples
    warmup_s = 60 * args.warmup_minutes
    by_window = windows(samples, warmup_s)
    server_latencies(samples)  # each period's quantiles from the servers' own histograms
    return {
        "gpu": gpu_name(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(args.commit),
        "soak": {
            "minutes": args.minutes,
            "elapsed_s": samples[-1]["t_s"],
            "stopped_early": soak.stop.is_set(),
            "requests": tally.sent,
            "answered": tally.counts[ANSWERED],
            "unexpected_errors": tally.unexpected,
            "expected_errors": tally.counts[EXPECTED],
            "disconnects": tally.counts[DISCONNECT],
            "refused_overload": tally.counts[OVERLOAD],
            "abandoned": samples[-1]["in_flight"],
            "rate": args.rate,
            "shape": args.shape,
            "repeat": args.repeat,
            "gateway_share": 0.0 if args.gateway is None else args.gateway_share,
            "bad_share": args.bad_share,
            "disconnect_share": args.disconnect_share,
            "allow_overload": args.allow_overload,
            "warmup_minutes": round(args.warmup_minutes, 4),
            "timeout_s": args.timeout,
            **summarize(samples, warmup_s),
            "latency_after_warmup": latency_drift(samples, warmup_s),
            "windows": by_window,
            "outcomes": dict(sorted(tally.outcomes.items())),
            "unexpected_examples": dict(tally.examples.most_common()),
            "samples": samples,
        },
    }


# --- command line -----------------------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """True when every address `host` resolves to is a loopback one."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def metrics_url(value: str) -> str:
    """A full URL as given, or HOST:PORT as the other load tests take it (then /metrics on it)."""
    return value if "://" in value else f"http://{value}/metrics"


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what would send traffic off this host or could not end; fill the defaults that depend on others."""
    hosts = [args.triton_grpc.rsplit(":", 1)[0], urllib.parse.urlsplit(args.metrics).hostname or ""]
    if args.gateway is not None:
        args.gateway = args.gateway.rstrip("/")
        parts = urllib.parse.urlsplit(args.gateway)
        if parts.scheme != "http":
            parser.error("--gateway must be an http:// URL")
        hosts.append(parts.hostname or "")
    for host in hosts:
        if not is_loopback(host):
            parser.error(f"{host!r} is not a loopback address: the soak sends hostile traffic to this host only")
    for name in ("repeat", "bad_share", "disconnect_share", "gateway_share"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    if args.bad_share + args.disconnect_share > 1.0:
        parser.error("--bad-share plus --disconnect-share must be at most 1")
    if args.minutes <= 0 or args.rate <= 0 or args.sample_seconds <= 0 or args.timeout <= 0:
        parser.error("--minutes, --rate, --sample-seconds and --timeout must be positive")
    if args.warmup_minutes is None:
        args.warmup_minutes = 0.1 * args.minutes
    if args.max_requests is None:  # twice the expected count: Poisson arrivals never reach it, a runaway loop would
        args.max_requests = int(2 * args.rate * 60 * args.minutes) + 100


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triton-grpc", default="127.0.0.1:8001", help="Triton's gRPC address, HOST:PORT")
    parser.add_argument("--gateway", default="http://127.0.0.1:8009", help="the System One gateway's URL")
    parser.add_argument("--no-gateway", dest="gateway", action="store_const", const=None, help="gRPC only")
    parser.add_argument("--gateway-share", type=float, default=0.3, help="share of requests sent to the gateway")
    parser.add_argument("--metrics", type=metrics_url, default="http://127.0.0.1:8002/metrics", help="Triton's")
    parser.add_argument("--model", default="kev")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long new requests are offered")
    parser.add_argument("--rate", type=float, default=20.0, help="requests/s offered in total (Poisson)")
    parser.add_argument("--shape", choices=Traffic.SHAPES, default="mix")
    parser.add_argument("--repeat", type=float, default=0.0, help="share of requests on a state already sent")
    parser.add_argument("--bad-share", type=float, default=0.02, help="share of hostile requests")
    parser.add_argument("--disconnect-share", type=float, default=0.02, help="share of requests abandoned")
    parser.add_argument("--allow-overload", action="store_true", help="overload refusals are not unexpected")
    parser.add_argument("--warmup-minutes", type=float, default=None, help="default: 10%% of --minutes")
    parser.add_argument("--sample-seconds", type=float, default=10.0)
    parser.add_argument("--server-pid", type=int, default=None, help="the tritonserver process (RSS, its stub's)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take before it counts")
    parser.add_argument("--max-requests", type=int, default=None, help="default: twice the expected count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", help="the commit the record names (default: git's HEAD)")
    parser.add_argument("--out", type=Path, default=Path("soak"), help="directory for soak.json and soak.png")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def main() -> None:
    args = parse_args()
    soak = asyncio.run(drive(args))
    record = build_record(args, soak)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(record, indent=2) + "\n")
    title = f"Kev on Triton soak: {args.shape} at {args.rate:g} r/s, {record['gpu']}, {record['commit']}"
    plot(soak.samples, 60 * args.warmup_minutes, title, args.out / "soak.png")
    print_table(record)
    print(f"written: {args.out / 'soak.json'} and soak.png")
    sys.exit(0 if record["soak"]["unexpected_errors"] == 0 else 1)


if __name__ == "__main__":
    main()
