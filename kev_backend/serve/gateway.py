"""System One gateway: Kev 1.0's HTTP API in front of Triton, for the TypeSafe SDK and other System One clients.

`kev-gateway` serves `POST /v1/systemone`, `/v1/systemone/separate`, `/v1/systemone/permute` and `GET /v1/models`
with Kev's bodies, 422 messages (FastAPI's `detail` form), `x-typesafe-request-id` and `server-timing` headers and
an optional bearer key (KEV_API_KEY) on /v1/*. It holds no model: every request is one call to Triton over one shared
async gRPC channel (/separate and /permute too: the model answers many questions on one state, so the state travels
once). Overload is answered at once — 429 when the gateway already has its limit of requests in flight or arriving,
529 when Triton's queue refuses — with `retry-after`, never queued without bound.

Hostile or unlucky clients cost the gateway a bounded amount:
- connections, request heads and URLs, slow heads and bodies, idle sockets: serve/front.py;
- bodies (byte limits, zstd and gzip bombs, bytes arriving): serve/bodies.py;
- a request's in-flight slots are taken once its body is read and parsed (one per question of /separate, one per
  permutation of /permute); bodies still arriving are bounded apart (KEV_GATEWAY_MAX_ARRIVING, _ARRIVING_BYTES);
- a client that goes away while its request waits on Triton has that request cancelled (a gRPC call cancelled while
  queued costs the model nothing);
- Triton's failures are reported to the request they are about, with neutral messages otherwise (serve/replies.py);
  any other failure is a JSON 500 naming the request id, logged in one line.
Every error body is JSON `{"detail": ...}`. CORS preflights are answered without the key, and every response,
401s and 500s included, carries CORS headers.

Operations: `GET /health` (the process is up), `GET /ready` (200 only when a real inference through Triton succeeded
in the last 2 s: a Triton whose Python stub crashed still reports ready itself) and `GET /metrics` (Prometheus text:
`kev_gateway_requests_total{route,status}`, `kev_gateway_errors_total{reason}`, `kev_gateway_in_flight`,
`kev_gateway_arriving`, `kev_gateway_arriving_bytes`, `kev_gateway_connections`,
`kev_gateway_connection_events_total{event}`), none behind the key.

Settings: kev_backend.settings.GatewaySettings (docs/configuration.md). The request limits are the model's: read
from Triton's model config (its parameters with the same KEV_* overrides) once Triton answers, so both doors agree.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import copy
import ctypes
import ctypes.util
import dataclasses
import hmac
import json
import logging
import math
import os
import random
import time
import traceback
import urllib.request
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from pydantic import BaseModel, Field, ValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..protocol import envelope
from ..protocol.systemone import Limits, Record, RequestError, load_body, parse_request, round4, state_key
from ..settings import GatewaySettings, SettingError, gateway_address, model_limits, parameters
from . import front, prometheus
from .bodies import OFFLOAD_BYTES, client_gone, decode_body, read_body
from .client import AsyncKevClient, KevError, encode
from .replies import REASONS, REQUEST_ID, Refused, from_triton, json_response

# The arrival of the request a task serves, for `admitted`: it stops counting as arriving once admitted.
_arrival: contextvars.ContextVar[Arrival] = contextvars.ContextVar("arrival")
REQUEST_ID_MAX = 128  # a client's request id: 1 to this many visible ASCII characters, else 400
READY_PROBE = {"state": "ready?", "questions": {"ok": {"type": "noul", "instructions": "ok?"}}}
READY_FRESH_S = 2.0  # /ready is 200 while the last successful probe is at most this old
READY_INTERVAL_S = 1.0  # at most one probe a second, however often /ready is asked
READY_TIMEOUT_S = 2.0  # a probe slower than this could not be fresh anyway
MODELS_FRESH_S = 1.0  # GET /v1/models: the model's parameters and serving statistics are read at most once a second
TRIM_BYTES = 1 << 20  # after a request whose body was this large, freed heap is handed back to the system
TRIM_DELAY_S = 0.05  # ... this long after it ends, when its objects are gone
# Connections the kernel queues before the gateway accepts them (capped by net.core.somaxconn): room for a burst of
# new connections, as many as the front's accepts take a moment to catch up with.
BACKLOG = 4096
PARAMETERS = {envelope.TAGGED_ERRORS: True}  # every call: errors about the request are tagged (replies.from_triton)

log = logging.getLogger("kev_backend.serve.gateway")


class PermuteBody(BaseModel):
    """/permute's envelope. Its integers are strict, as JSON integers: "6", 6.0 or true are 422s, not coerced."""

    request: dict[str, Any]
    question: str
    n_perm: int = Field(6, ge=1, le=64, strict=True)
    seed: int = Field(0, strict=True)


# --- answering -----------------------------------------------------------------------------------------------------


async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s response, unless the client goes away first: then `work` is cancelled, and with it every Triton call
    it awaits, and the request is refused as client_disconnected.

    Only call it once the body is read: the next ASGI message is then `http.disconnect`, so waiting on `receive`
    notices the client leaving at once, without polling."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected(request.receive))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this request is itself cancelled (shutdown): nothing is left running
        watcher.cancel()
        task.cancel()
    if task in done:
        return task.result()
    await asyncio.wait((task,))  # let the cancelled work unwind: its admission slot is released in a `finally`
    if not task.cancelled():
        task.exception()  # whatever it ended with (it may have finished meanwhile), nobody is left to tell
    raise client_gone()


async def disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def nested(error: RequestError, *prefix: str) -> RequestError:
    """A request validated inside an envelope (`/permute`'s `request`): its error locations under that field."""
    if isinstance(error.detail, str):
        return error
    detail = [{**e, "loc": ["body", *prefix, *e["loc"][1:]]} for e in error.detail]
    return RequestError(detail, error.status)


def truncation_marks(reply: dict[str, Any]) -> tuple[dict[str, int], bool] | None:
    """A reply's truncation marks, which a server that truncates states puts on every response (usage.state_tokens,
    usage.state_tokens_used, truncated); None from a server that does not. /separate and /permute carry them as Kev's
    server does."""
    if "truncated" not in reply:
        return None
    usage = reply["usage"]
    return {"state_tokens": usage["state_tokens"], "state_tokens_used": usage["state_tokens_used"]}, reply["truncated"]


def parsed_and_keyed(body: bytes | dict[str, Any], limits: Limits) -> tuple[Record, str]:
    """The request's record and its state's routing key."""
    record = parse_request(body, limits)
    return record, state_key(record.state_text)


def permute_envelope(raw: bytes, limits: Limits) -> PermuteBody:
    """/permute's body, read as FastAPI reads a body (a BOM, UTF-16 and UTF-32 as Starlette decodes them) and
    validated with FastAPI's error shapes."""
    data = load_body(raw, limits)
    try:
        return PermuteBody.model_validate(data)
    except ValidationError as error:
        detail = [{**e, "loc": ["body", *e["loc"]]} for e in error.errors(include_url=False)]
        raise RequestError(json.loads(json.dumps(detail, default=lambda _: {}))) from None


def permutations(keys: list[str], n_perm: int, seed: int) -> list[list[str]]:
    """The option orders /permute scores: the request's own first, then n_perm - 1 shuffles (seeded)."""
    rng = random.Random(seed)
    orders = [keys]
    for _ in range(n_perm - 1):
        order = list(keys)
        rng.shuffle(order)
        orders.append(order)
    return orders


def grouped(sizes: list[int], room: int, most: int) -> list[range]:
    """Consecutive groups of items whose sizes sum to at most `room`, at most `most` items each (at least one item
    each, whatever its size: the model then refuses it by name)."""
    groups, start, used = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and (used + size > room or i - start >= most):
            groups.append(range(start, i))
            start, used = i, 0
        used += size
    groups.append(range(start, len(sizes)))
    return groups


def forget(error: BaseException) -> None:
    """Drops what a handled exception's traceback holds: its frames' locals (a request's body, its parsed record, the
    gRPC message) would otherwise stay in a reference cycle (exception, traceback, frame, the task that raised it)
    until the garbage collector happens to run, megabytes a large request."""
    traceback.clear_frames(error.__traceback__)
    error.__traceback__ = None


def malloc_trim() -> Callable[[], None]:
    """glibc's malloc_trim(0): hands freed heap back to the system, in every arena. A large body's transient objects
    (parsed on a worker thread, in that thread's arena) otherwise stay resident after they are freed. A no-op where
    the C library has none."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class Metrics:
    """The counters behind GET /metrics, written in Prometheus' text format (0.0.4) without a client library."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.errors: Counter[str] = Counter(dict.fromkeys(REASONS, 0))

    def request(self, route: str, status: int) -> None:
        self.requests[route, status] += 1

    def error(self, reason: str) -> None:
        assert reason in REASONS, reason
        self.errors[reason] += 1

    def render(self, gateway: Gateway) -> str:
        lines = [
            "# HELP kev_gateway_requests_total HTTP requests answered, by route (the path, or other) and status.",
            "# TYPE kev_gateway_requests_total counter",
            *(
                f'kev_gateway_requests_total{{route="{label(route)}",status="{status}"}} {n}'
                for (route, status), n in sorted(self.requests.items())
            ),
            "# HELP kev_gateway_errors_total Requests refused or failed, by reason.",
            "# TYPE kev_gateway_errors_total counter",
            *(f'kev_gateway_errors_total{{reason="{reason}"}} {self.errors[reason]}' for reason in REASONS),
            "# HELP kev_gateway_in_flight Admission slots held (one per Triton question under way).",
            "# TYPE kev_gateway_in_flight gauge",
            f"kev_gateway_in_flight {gateway.in_flight}",
            "# HELP kev_gateway_arriving Requests whose body is being read or parsed, before their admission.",
            "# TYPE kev_gateway_arriving gauge",
            f"kev_gateway_arriving {gateway.arriving}",
            "# HELP kev_gateway_arriving_bytes Body bytes held by requests not yet admitted.",
            "# TYPE kev_gateway_arriving_bytes gauge",
            f"kev_gateway_arriving_bytes {gateway.arriving_bytes}",
        ]
        if (connections := front.current()) is not None:
            lines += [
                "# HELP kev_gateway_connections Client connections open.",
                "# TYPE kev_gateway_connections gauge",
                f"kev_gateway_connections {connections.open}",
                "# HELP kev_gateway_connection_events_total Connections refused, closed or answered by the front.",
                "# TYPE kev_gateway_connection_events_total counter",
                *(
                    f'kev_gateway_connection_events_total{{event="{event}"}} {connections.events[event]}'
                    for event in front.EVENTS
                ),
            ]
        return "\n".join(lines) + "\n"


# The serving statistics of GET /v1/models, as Kev reports its own: each from a metric of Triton's metrics port,
# summed over the model's instances (the backend's kev_* and Triton's nv_inference_*).
SERVING_METRICS = {
    "bank_hits": "kev_bank_hits_total",
    "bank_misses": "kev_bank_misses_total",
    "bank_evictions": "kev_bank_evictions_total",
    "bank_states": "kev_bank_entries",
    "bank_bytes": "kev_bank_bytes",
    "graphs": "kev_graphs",
    "graph_captures": "kev_graph_captures_total",
    "graph_capture_failures": "kev_graph_capture_failures_total",
    "graph_replays": "kev_graph_replays_total",
    "oom_retries": "kev_oom_retries_total",
    "batches": "nv_inference_exec_count",
    "inferences": "nv_inference_count",
    "queued_now": "nv_inference_pending_request_count",
    "queue_us_total": "nv_inference_queue_duration_us",
}


def serving_statistics(metrics_url: str, model: str, timeout_s: float = 2.0) -> dict[str, float | int] | None:
    """Kev's serving statistics from Triton's metrics port, or None when it does not answer (the cards still do)."""
    try:
        with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=timeout_s) as reply:
            samples = prometheus.parse(reply.read().decode())
    except OSError:
        return None
    found = {key: prometheus.total(samples, metric, model=model) for key, metric in SERVING_METRICS.items()}
    return {key: int(value) if float(value).is_integer() else value for key, value in found.items()}


def label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Readiness:
    """Whether a real inference through Triton succeeded in the last READY_FRESH_S seconds. Probes run at most once
    every READY_INTERVAL_S, one at a time; callers in between share the cached result."""

    def __init__(self, probe: Callable[[], Awaitable[None]]) -> None:
        self.probe = probe
        self.last_ok = self.last_try = -math.inf
        self.why_not = "not probed yet"
        self.lock = asyncio.Lock()

    async def check(self) -> str | None:
        """None when ready, else why not."""
        if not self.fresh():
            async with self.lock:  # concurrent callers wait for the one probe
                if not self.fresh() and time.monotonic() - self.last_try >= READY_INTERVAL_S:
                    await self.run_probe()
        return None if self.fresh() else self.why_not

    def fresh(self) -> bool:
        return time.monotonic() - self.last_ok <= READY_FRESH_S

    async def run_probe(self) -> None:
        self.last_try = time.monotonic()
        try:
            await asyncio.wait_for(self.probe(), READY_TIMEOUT_S)
        except Exception as error:  # any failure means not ready; the reason is reported, not raised
            self.why_not = f"probe inference failed: {error!r}"
        else:
            self.last_ok = time.monotonic()


class Cached:
    """What `fetch` returns, fetched at most once every `fresh_s` and one fetch at a time: callers meanwhile share the
    last value (those that come while it is being fetched wait for it)."""

    def __init__(self, fetch: Callable[[], Awaitable[Any]], fresh_s: float) -> None:
        self.fetch, self.fresh_s = fetch, fresh_s
        self.value: Any = None
        self.at = -math.inf
        self.lock = asyncio.Lock()

    async def get(self) -> Any:
        if time.monotonic() - self.at > self.fresh_s:
            async with self.lock:
                if time.monotonic() - self.at > self.fresh_s:
                    self.value = await self.fetch()
                    self.at = time.monotonic()
        return self.value


class Arrival:
    """A request from the start of its body to its admission: counted in the gateway's arrivals, with the body bytes
    it holds (`reserve`)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.held = 0  # body bytes counted in gateway.arriving_bytes
        self.pending = True  # still counted as arriving: `admitted` or the end of the request ends it

    def reserve(self, total: int) -> None:
        """Counts this request as holding `total` body bytes; 429 when the bytes arriving cannot take them."""
        grow = total - self.held
        if grow <= 0 or not self.pending:
            return
        gateway = self.gateway
        if gateway.arriving_bytes + grow > gateway.settings.max_arriving_bytes:
            raise gateway.arrivals_full()
        gateway.arriving_bytes += grow
        self.held = total

    def end(self) -> None:
        if self.pending:
            self.pending = False
            self.gateway.arriving -= 1
            self.gateway.arriving_bytes -= self.held


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        # Until Triton has answered with the model's config, the limits are the defaults with the KEV_* overrides;
        # the model checks its own again either way.
        self.limits = settings.limits({})
        self.model_bytes = model_limits({}, settings.env).max_request_bytes  # the model's own body limit
        self.limits_known = False
        self.kev: AsyncKevClient | None = None
        self.in_flight = 0  # admission slots held: one per question of a Triton call under way
        self.arriving = 0  # requests whose body is being read, decoded or parsed: not yet admitted
        self.arriving_bytes = 0  # the body bytes those hold
        self.metrics = Metrics()
        self.readiness = Readiness(self.probe)
        self.model_info = Cached(self.read_model_info, MODELS_FRESH_S)
        self.trim = malloc_trim()
        self.trim_pending = False
        self.background: set[asyncio.Future[None]] = set()  # tasks the gateway started itself: kept until done

    async def start(self) -> None:
        self.kev = AsyncKevClient(self.settings.triton_url, "grpc", self.settings.model, self.settings.timeout_s)

    async def stop(self) -> None:
        if self.kev is not None:
            await self.kev.close()

    def overloaded(self) -> Refused:
        limit, retry = self.settings.max_in_flight, str(self.settings.retry_after_s)
        message = f"overloaded: {self.in_flight} requests in flight (limit {limit}); retry later"
        return Refused(429, "overloaded", message, {"retry-after": retry})

    def arrivals_full(self) -> Refused:
        settings = self.settings
        message = (
            f"overloaded: {self.arriving} requests arriving (limit {settings.max_arriving}) holding "
            f"{self.arriving_bytes:,} body bytes (limit {settings.max_arriving_bytes:,}); retry later"
        )
        return Refused(429, "overloaded", message, {"retry-after": str(settings.retry_after_s)})

    @contextlib.contextmanager
    def arrival(self) -> Iterator[Arrival]:
        """A request from the start of its body to its admission, refused at once (its body unread) when the
        arrivals are full. Arrivals hold no in-flight slot: a client still sending takes nothing from admitted work,
        and what all arriving bodies hold is bounded by max_arriving_bytes however many connections send them."""
        if self.arriving >= self.settings.max_arriving:
            raise self.arrivals_full()
        self.arriving += 1
        arrival = Arrival(self)
        token = _arrival.set(arrival)
        try:
            yield arrival
        finally:
            _arrival.reset(token)
            arrival.end()

    @contextlib.contextmanager
    def admitted(self, n: int = 1) -> Iterator[None]:
        """`n` in-flight slots for the work inside (one per question sent to Triton); 429 when they are not free.
        The request's arrival, if any, ends here."""
        if self.in_flight + n > self.settings.max_in_flight:
            raise self.overloaded()
        if (arrival := _arrival.get(None)) is not None:
            arrival.end()
        self.in_flight += n
        try:
            yield
        finally:
            self.in_flight -= n

    async def parse(self, body: bytes | dict[str, Any], size: int) -> tuple[Record, str]:
        """The request's record (Kev's 422s before any model work) and its state's routing key (x-kev-state-key, for
        a router in front of several servers), computed once for all of a request's calls. A body over
        OFFLOAD_BYTES (`size`) is parsed on a worker thread: its rendered state can be many times its size."""
        if size > OFFLOAD_BYTES:
            return await asyncio.to_thread(parsed_and_keyed, body, self.limits)
        return parsed_and_keyed(body, self.limits)

    async def score(
        self, body: dict[str, Any] | bytes, request_id: str, key: str, by_question: bool = False
    ) -> dict[str, Any]:
        """One call to Triton, with the state's routing key and tagged errors; its reply parsed. `by_question`: the
        reply's usage has each question's own (envelope.USAGE_BY_QUESTION)."""
        assert self.kev is not None
        params = {**PARAMETERS, envelope.USAGE_BY_QUESTION: True} if by_question else PARAMETERS
        return json.loads(await self.kev.score_raw(body, request_id, state_key=key, parameters=params))

    async def probe(self) -> None:
        assert self.kev is not None
        raw = await self.kev.score_raw(READY_PROBE, f"ready-{uuid.uuid4().hex}", READY_TIMEOUT_S, parameters=PARAMETERS)
        reply = json.loads(raw)
        if "ok" not in reply.get("answers", {}):
            raise ValueError(f"the probe's answer has no `ok`: {reply!r:.200}")
        if not self.limits_known:
            await self.model_parameters()

    async def model_parameters(self) -> dict[str, str]:
        """The model's parameters as Triton serves them (empty while Triton cannot say); the request limits follow."""
        assert self.kev is not None
        try:
            params = parameters(await self.kev.model_config())
        except Exception:  # Triton starting or gone: the defaults and overrides hold meanwhile
            return {}
        try:
            self.limits, self.limits_known = self.settings.limits(params), True
            self.model_bytes = model_limits(params, self.settings.env).max_request_bytes
        except SettingError as error:  # the model itself refuses to load with such a value
            log.error("the model's request limits: %s", error)
        return params

    async def read_model_info(self) -> tuple[dict[str, str], dict[str, float | int] | None]:
        """What GET /v1/models reports beside the cards: the model's parameters and its serving statistics."""
        params = await self.model_parameters()
        settings = self.settings
        return params, await asyncio.to_thread(serving_statistics, settings.metrics_url, settings.model)

    def route(self, handler: Callable[[bytes, str], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """An endpoint: the body read and decoded within the limits, `handler`'s response unless the client leaves
        first, and every known failure turned into its JSON response and counted."""

        async def endpoint(request: Request) -> Response:
            settings, request_id = self.settings, request.state.request_id
            arrival: Arrival | None = None
            decoded = 0
            try:
                with self.arrival() as arrival:
                    raw = await read_body(request, settings.max_body_bytes, arrival.reserve)
                    encoding = request.headers.get("content-encoding", "")
                    raw = await decode_body(raw, encoding, settings.max_decoded_bytes)
                    decoded = len(raw)
                    if not self.limits_known:  # until Triton has said what the model's limits are
                        await self.model_parameters()
                    return await unless_disconnected(request, handler(raw, request_id))
            except RequestError as error:  # Kev's refusals, in FastAPI's shapes
                forget(error)
                self.metrics.error("too_large" if error.status == 413 else "invalid")
                return json_response(error.body, error.status)
            except KevError as error:
                forget(error)
                refused = from_triton(error, request_id, settings.retry_after_s)
                if refused.status >= 500:  # the client sees a neutral message: the real one is logged here
                    log.warning("triton error (request id %s): %s: %s", request_id, error.status, error.message)
                return self.refuse(refused)
            except Refused as error:
                forget(error)
                return self.refuse(error)
            finally:
                if max(decoded, arrival.held if arrival else 0) > TRIM_BYTES:
                    self.trim_soon()

        return endpoint

    def refuse(self, error: Refused) -> Response:
        self.metrics.error(error.reason)
        return error.response()

    def trim_soon(self) -> None:
        """Hands the heap freed by a large request back to the system, shortly after (once its objects are gone) and
        on a worker thread; requests meanwhile share one trim."""
        if self.trim_pending:
            return
        self.trim_pending = True

        async def trim() -> None:
            await asyncio.sleep(TRIM_DELAY_S)
            self.trim_pending = False
            await asyncio.to_thread(self.trim)

        task = asyncio.ensure_future(trim())
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def system_one(self, raw: bytes, request_id: str) -> Response:
        _, key = await self.parse(raw, len(raw))
        with self.admitted():
            assert self.kev is not None
            reply = await self.kev.score_raw(raw, request_id, state_key=key, parameters=PARAMETERS)
            return Response(reply, media_type="application/json")

    async def separate(self, raw: bytes, request_id: str) -> Response:
        """Each question answered as if asked alone, in one call: the body goes to the model as sent, with each
        question's usage reported by the model (Kev's /separate sums them); `latency_ms` is the model time of that
        one call's batch."""
        record, key = await self.parse(raw, len(raw))
        with self.admitted(len(record.questions)):
            reply = await self.score(raw, request_id, key, by_question=True)
        usage = reply["usage"]
        alone = usage["questions"].values()
        merged = {
            "model": record.model,
            "answers": reply["answers"],
            "usage": {
                "input_tokens": sum(u["input_tokens"] for u in alone),
                "output_tokens": sum(u["output_tokens"] for u in alone),
            },
            "latency_ms": reply["latency_ms"],
        }
        if (marks := truncation_marks(reply)) is not None:
            merged["usage"].update(marks[0])
            merged["truncated"] = marks[1]
        return json_response(merged)

    async def permute(self, raw: bytes, request_id: str) -> Response:
        """The choice question under n_perm option orders, each order a question of its own (ids "0".."n-1"; the
        model never reads an id) on the request's one state: one call, or more only where the model's limits on
        questions or bytes per request need it."""
        envelope_ = permute_envelope(raw, self.limits)
        try:
            record, key = await self.parse(envelope_.request, len(raw))
        except RequestError as error:
            raise nested(error, "request") from None
        question = next((q for q in record.questions if q.id == envelope_.question), None)
        if question is None or question.type != "choice":
            raise RequestError("question must be an existing choice question")
        original = envelope_.request["questions"][question.id]
        keys = list(original["criteria"])
        orders = permutations(keys, envelope_.n_perm, envelope_.seed)
        variants = [{**original, "criteria": {k: original["criteria"][k] for k in order}} for order in orders]
        with self.admitted(len(variants)):
            replies = await self.score_permutations(envelope_.request, variants, request_id, key)
        runs = []
        for i, order in enumerate(orders):
            reply = replies[i]
            answer = reply["answers"][str(i)]
            run = {"order": order, "probabilities": answer["probabilities"], "choice": answer["choice"]}
            runs.append({**run, "latency_ms": reply["latency_ms"]})
        spread = {
            k: round4(max(r["probabilities"][k] for r in runs) - min(r["probabilities"][k] for r in runs)) for k in keys
        }
        stable = len({r["choice"] for r in runs}) == 1
        result: dict[str, Any] = {"runs": runs, "argmax_stable": stable, "spread": spread}
        if (marks := truncation_marks(replies[0])) is not None:
            result["truncated"], result["usage"] = marks[1], marks[0]
        return json_response(result)

    async def score_permutations(
        self, request: dict[str, Any], variants: list[dict[str, Any]], request_id: str, key: str
    ) -> list[dict[str, Any]]:
        """The reply holding each variant (variant i asked as question "i"): one call for all of them, unless the
        model's question or byte limits need the variants split among several (each with the state once)."""
        base = {"state": request.get("state"), "questions": {}}
        if "model" in request:
            base["model"] = request["model"]
        room = self.model_bytes - len(encode(base))
        sizes = [len(encode({str(i): v})) for i, v in enumerate(variants)]  # its `"i":{...}` and a comma, about
        groups = grouped(sizes, room, self.limits.max_questions)
        calls = [
            self.score({**base, "questions": {str(i): variants[i] for i in group}}, f"{request_id}-{n}", key)
            for n, group in enumerate(groups)
        ]
        replies = await gather_or_cancel(calls) if len(calls) > 1 else [await calls[0]]
        return [replies[n] for n, group in enumerate(groups) for _ in group]

    async def models(self) -> Response:
        """The model cards, admitted like other work; their parameters and serving statistics at most
        MODELS_FRESH_S old, read by one call at a time however many ask."""
        try:
            with self.admitted():
                params, serving = await self.model_info.get()
        except Refused as error:
            return self.refuse(error)
        limits = self.settings.limits(params) if params else self.limits
        extras = {
            "backend": "triton",
            "triton_model": self.settings.model,
            **dataclasses.asdict(limits),  # the request limits in force, the body limit being the decoded one
            "dtype": self.settings.dtype(params),
            "serving": serving,
        }
        cards = [
            {
                "name": "kev-latest",
                "description": "Kev decision model (noul, choice, score), served by Triton.",
                "release_date": self.settings.release_date,
                **extras,
            },
            {
                "name": "jev-latest",
                "description": "Alias of kev-latest for TypeSafe SDK defaults.",
                "release_date": self.settings.release_date,
                **extras,
            },
        ]
        return json_response({"models": cards})

    async def ready(self) -> Response:
        why_not = await self.readiness.check()
        if why_not is None:
            return json_response({"status": "ready"})
        return json_response({"status": "not ready", "detail": why_not}, 503)

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(self), media_type="text/plain; version=0.0.4; charset=utf-8")


async def gather_or_cancel(calls: list[Awaitable[Any]]) -> list[Any]:
    """All of `calls`' results; when one fails the others are cancelled (and with them their Triton calls) before the
    failure is raised, so none runs on after the request's admission ends."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


# --- middleware, outermost first: Observe, CORS, Guard ---------------------------------------------------------------


class Observe:
    """Outermost: gives each request its id in `request.state.request_id`, adds it and server-timing to every
    response, and counts every response by route and status. Paths that are not routes count as "other", so hostile
    paths cannot grow the metrics.

    The id is the client's x-typesafe-request-id when that is 1 to REQUEST_ID_MAX visible ASCII characters, else a
    fresh one: a malformed id is never echoed, sent to Triton or logged, and Guard refuses its request with 400 (the
    response carrying the fresh id)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics
        self.routes: frozenset[str] | None = None

    def route(self, scope: Scope) -> str:
        if self.routes is None:  # read at the first request, once every route is registered
            self.routes = frozenset(path for route in scope["app"].routes if (path := getattr(route, "path", None)))
        return scope["path"] if scope["path"] in self.routes else "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        sent = Headers(scope=scope).get(REQUEST_ID)
        request_id = sent if sent and valid_request_id(sent) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["bad_request_id"] = request_id, bool(sent) and request_id != sent
        status = 500  # should the app send nothing at all

        async def send_with_headers(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = MutableHeaders(raw=list(message.get("headers", [])))
                headers[REQUEST_ID] = request_id
                headers["server-timing"] = f"app;dur={(time.perf_counter() - started) * 1000:.1f}"
                message = {**message, "headers": headers.raw}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            self.metrics.request(self.route(scope), status)


def valid_request_id(value: str) -> bool:
    return len(value) <= REQUEST_ID_MAX and all("!" <= c <= "~" for c in value)


class Guard:
    """Inside CORS, so its answers carry CORS headers (a browser can read a 400, 401 or 500): a malformed request id
    (Observe), the bearer key on /v1/* (CORS answers preflights before they get here), and the catch-all that turns
    any exception below into a JSON 500 naming the request id, logged in one line."""

    def __init__(self, app: ASGIApp, metrics: Metrics, api_key: str | None) -> None:
        self.app, self.metrics, self.api_key = app, metrics, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["state"].get("bad_request_id"):
            self.metrics.error("invalid")
            detail = f"the {REQUEST_ID} header must be 1 to {REQUEST_ID_MAX} visible ASCII characters"
            await json_response({"detail": detail}, 400)(scope, receive, send)
            return
        if self.api_key and scope["path"].startswith("/v1") and not authorized(Headers(scope=scope), self.api_key):
            self.metrics.error("unauthorized")
            response = json_response({"detail": "invalid or missing API key"}, 401, {"www-authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        response_started = False

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as error:  # anything the handlers did not expect: one log line, never a traceback dump
            request_id = scope["state"]["request_id"]
            log.error("internal error (request id %s) on %s %s: %r", request_id, scope["method"], scope["path"], error)
            self.metrics.error("internal")
            if not response_started:  # else the client sees the response cut short, which is all that is left
                await json_response({"detail": f"internal error (request id {request_id})"}, 500)(scope, receive, send)


def authorized(headers: Headers, key: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings.read()
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await gateway.start()
        yield
        await gateway.stop()

    app = FastAPI(title="Kev System One gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway
    app.post("/v1/systemone")(gateway.route(gateway.system_one))
    app.post("/v1/systemone/separate")(gateway.route(gateway.separate))
    app.post("/v1/systemone/permute")(gateway.route(gateway.permute))
    app.get("/v1/models")(gateway.models)
    app.get("/ready")(gateway.ready)
    app.get("/metrics")(gateway.prometheus)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    # add_middleware puts each new layer outside the ones before it.
    app.add_middleware(Guard, metrics=gateway.metrics, api_key=settings.api_key)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=["*"],
        allow_methods=["*"],
        allow_headers=["*"],
        expose_headers=[REQUEST_ID, "server-timing"],
    )
    app.add_middleware(Observe, metrics=gateway.metrics)
    return app


def log_config() -> dict[str, Any]:
    """uvicorn's logging, with this module's logger on its handler (every worker process configures it)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["kev_backend"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description="Kev System One gateway in front of Triton")
    host, port = gateway_address()
    parser.add_argument("--host", default=host, help="listening address (GATEWAY_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=port, help="listening port (GATEWAY_PORT, default 8009)")
    parser.add_argument("--triton", help="Triton gRPC address (TRITON_GRPC_URL, default 127.0.0.1:8001)")
    parser.add_argument("--metrics", help="Triton metrics address (TRITON_METRICS_URL, default 127.0.0.1:8002)")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    front.raise_descriptor_limit()  # before uvicorn forks any worker: they inherit it
    settings = GatewaySettings.read()  # read here too, so a bad setting stops the start with its message
    if args.triton:  # the app factory runs in uvicorn's workers, which inherit the environment
        os.environ["TRITON_GRPC_URL"] = args.triton
    if args.metrics:
        os.environ["TRITON_METRICS_URL"] = args.metrics
    import uvicorn

    uvicorn.run(
        "kev_backend.serve.gateway:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        http="kev_backend.serve.front:GuardedProtocol",
        ws="none",
        backlog=BACKLOG,
        timeout_keep_alive=max(1, round(settings.keepalive_timeout_s)),  # unused: GuardedProtocol keeps its own
        log_level="warning",
        log_config=log_config(),
        access_log=False,
    )


if __name__ == "__main__":
    main()
