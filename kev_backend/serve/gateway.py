"""System One gateway: Kev 1.0's HTTP API in front of Triton, for the TypeSafe SDK and other System One clients.

`kev-gateway` serves `POST /v1/systemone`, `/v1/systemone/separate`, `/v1/systemone/permute` and `GET /v1/models`
with Kev's bodies, 422 messages (FastAPI's `detail` form), `x-typesafe-request-id` and `server-timing` headers and
an optional bearer key (KEV_API_KEY) on /v1/*. It holds no model: every question goes to Triton over one shared async
gRPC channel. Overload is answered at once — 429 when the gateway already has its limit of requests in flight, 529
when Triton's queue refuses — with `retry-after`, never queued without bound.

Hostile or unlucky clients cost the gateway a bounded amount:
- a body is read as it streams and refused with 413 once it passes KEV_GATEWAY_MAX_BODY_BYTES (at once when its
  Content-Length says so); a zstd or gzip body is decompressed a chunk at a time and refused with 413 once its output
  passes KEV_GATEWAY_MAX_DECODED_BYTES, on a worker thread when it is large; corrupt data is a 400, an encoding not
  served a 415;
- a client that goes away while its request waits on Triton has that request cancelled, every part of it (a gRPC call
  cancelled while queued costs the model nothing);
- any other failure is a JSON 500 naming the request id, logged in one line.
Every error body is JSON `{"detail": ...}`. CORS preflights are answered without the key, and every response,
401s and 500s included, carries CORS headers.

Operations: `GET /health` (the process is up), `GET /ready` (200 only when a real inference through Triton succeeded
in the last 2 s: a Triton whose Python stub crashed still reports ready itself) and `GET /metrics` (Prometheus text:
`kev_gateway_requests_total{route,status}`, `kev_gateway_errors_total{reason}`, `kev_gateway_in_flight`,
`kev_gateway_arriving`), none behind the key.

Settings: kev_backend.settings.GatewaySettings (docs/configuration.md). The request limits are the model's: read
from Triton's model config (its parameters with the same KEV_* overrides) once Triton answers, so both doors agree.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import copy
import dataclasses
import hmac
import json
import logging
import math
import os
import random
import time
import urllib.request
import uuid
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from pydantic import BaseModel, Field, ValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..protocol.systemone import Limits, Record, RequestError, parse_request, round4, state_key
from ..settings import GatewaySettings, SettingError, gateway_address, parameters
from . import prometheus
from .client import AsyncKevClient, KevError

try:
    from backports.zstd import ZstdDecompressor, ZstdError
except ImportError:  # Python 3.14+
    from compression.zstd import ZstdDecompressor, ZstdError  # type: ignore[import-not-found, no-redef]

REQUEST_ID = "x-typesafe-request-id"
DRAIN_FACTOR = 4  # a body up to this many times the limit is read (and dropped) before its 413: see read_body
OFFLOAD_BYTES = 64 << 10  # bodies over this decompress, and are parsed, on a worker thread, off the event loop
# A decompressor is fed DECODE_IN bytes at a time (what a frame leaves over, its `unused_data`, is a copy of at most
# that) and asked for at most DECODE_OUT bytes a call (a bomb's output stops within DECODE_OUT of the limit).
DECODE_IN = 16 << 10
DECODE_OUT = 256 << 10
MAX_FRAMES = 100  # zstd frames or gzip members in one body: each costs a new decompressor; clients send one
CLIENT_CLOSED = 499  # nginx's "client closed request": counted, never seen by the client
# Every reason kev_gateway_errors_total reports (all of them, from 0, so a rate is defined before the first error).
REASONS = (
    "invalid",  # 422 / 400: the request is not one Kev answers
    "too_large",  # 413: the body, or what it decodes to, is over a byte limit
    "unsupported_encoding",  # 415: a Content-Encoding other than identity, zstd, gzip
    "bad_encoding",  # 400: the zstd / gzip data does not decode
    "unauthorized",  # 401
    "overloaded",  # 429 (the gateway's limit) / 529 (Triton's queue)
    "timeout",  # 504: Triton did not answer within KEV_GATEWAY_TIMEOUT_S
    "client_disconnected",  # the client went away before its answer; its Triton calls were cancelled
    "model_error",  # 500 from Triton
    "internal",  # 500 from the gateway itself
)
# The arrival of the request a task serves (a one-item list: whether it still counts as arriving), for `admitted`.
_arrival: contextvars.ContextVar[list[bool]] = contextvars.ContextVar("arrival")
READY_PROBE = {"state": "ready?", "questions": {"ok": {"type": "noul", "instructions": "ok?"}}}
READY_FRESH_S = 2.0  # /ready is 200 while the last successful probe is at most this old
READY_INTERVAL_S = 1.0  # at most one probe a second, however often /ready is asked
READY_TIMEOUT_S = 2.0  # a probe slower than this could not be fresh anyway

log = logging.getLogger("kev_backend.serve.gateway")


class PermuteBody(BaseModel):
    request: dict[str, Any]
    question: str
    n_perm: int = Field(6, ge=1, le=64)
    seed: int = 0


class Refused(Exception):
    """A request the gateway answers with an error of its own: the status, the `detail` message, the metrics reason
    (one of REASONS) and any extra headers."""

    def __init__(self, status: int, reason: str, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.reason, self.detail, self.headers = status, reason, detail, headers

    def response(self) -> Response:
        return json_response({"detail": self.detail}, self.status, self.headers)


class CorruptBody(ValueError):
    """Compressed data that ends before its frame or member does."""


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    # A lone surrogate (from a `\udXXX` escape a client sent and an error message echoes) cannot be UTF-8:
    # backslashreplace writes it back as that same JSON escape, inside its string, so the body stays valid JSON.
    text = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    content = text.encode("utf-8", "backslashreplace")
    return Response(content, status_code=status, media_type="application/json", headers=headers)


# --- request bodies ------------------------------------------------------------------------------------------------


async def read_body(request: Request, limit: int) -> bytes:
    """The body as sent, refused with 413 once it is known to be over `limit` bytes. Nothing past the limit is kept.
    A body up to DRAIN_FACTOR times the limit is read to its end (and dropped) first, so its client, still sending,
    reads the 413 rather than a reset connection; a larger one is refused at once (from its Content-Length, or once
    that much has arrived) and the server discards the rest of the upload."""
    declared = request.headers.get("content-length", "")
    drain = limit * DRAIN_FACTOR
    if declared.isdigit() and int(declared) > drain:
        raise too_large(f"request body is {int(declared):,} bytes, over the {limit:,}-byte limit")
    body, seen = bytearray(), 0
    try:
        async with contextlib.aclosing(request.stream()) as stream:
            async for chunk in stream:
                seen += len(chunk)
                if seen <= limit:
                    body += chunk
                elif seen > drain:
                    break
    except ClientDisconnect:
        raise client_gone() from None
    if seen > limit:
        size = f"{seen:,} bytes" if seen <= drain else f"over {drain:,} bytes"
        raise too_large(f"request body is {size}, over the {limit:,}-byte limit")
    return bytes(body)


def too_large(message: str) -> Refused:
    return Refused(413, "too_large", message)


def client_gone() -> Refused:
    return Refused(CLIENT_CLOSED, "client_disconnected", "the client closed the connection")


async def decode_body(raw: bytes, encoding: str, limit: int) -> bytes:
    """`raw` decompressed per its Content-Encoding: on a worker thread when it is large, so a big body does not stall
    every other client. The output is bounded whatever the ratio: see `decompress`."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in DECODERS:
        raise Refused(415, "unsupported_encoding", f"unsupported content-encoding {encoding!r}: use zstd or gzip")
    if len(raw) > OFFLOAD_BYTES:
        return await asyncio.to_thread(decompress, raw, encoding, limit)
    return decompress(raw, encoding, limit)


def decompress(raw: bytes, encoding: str, limit: int) -> bytes:
    """`raw` decoded, refused with 413 once the output passes `limit` bytes (a bomb costs at most `limit` +
    DECODE_OUT bytes) and with 400 when it is not valid data."""
    out = bytearray()
    try:
        for chunk in DECODERS[encoding](raw):
            out += chunk
            if len(out) > limit:
                raise too_large(f"the {encoding} body decodes to over the {limit:,}-byte limit")
    except (ZstdError, zlib.error, CorruptBody) as error:
        raise Refused(400, "bad_encoding", f"could not decode the {encoding} body: {error}") from None
    return bytes(out)


def zstd_chunks(raw: bytes) -> Iterator[bytes]:
    """Decoded zstd, frame after frame as `zstd.decompress` reads them (at most MAX_FRAMES)."""
    view, pending = memoryview(raw), b""
    for _ in range(MAX_FRAMES):
        if not pending and not view:
            return
        frame = ZstdDecompressor()
        while not frame.eof:
            if frame.needs_input:
                if not pending:
                    pending, view = bytes(view[:DECODE_IN]), view[DECODE_IN:]
                if not pending:
                    raise CorruptBody("the data ends inside a frame")
                chunk, pending = frame.decompress(pending, DECODE_OUT), b""
            else:  # more output is waiting on the input already given
                chunk = frame.decompress(b"", DECODE_OUT)
            yield chunk
        pending = frame.unused_data  # the rest of the last slice: the next frame's start
    if pending or view:
        raise CorruptBody(f"more than {MAX_FRAMES} frames")


def gzip_chunks(raw: bytes) -> Iterator[bytes]:
    """Decoded gzip, member after member as `gzip.decompress` reads them (at most MAX_FRAMES)."""
    view, pending = memoryview(raw), b""
    for _ in range(MAX_FRAMES):
        if not pending and not view:
            return
        member = zlib.decompressobj(wbits=31)  # 31: a gzip header and trailer around deflate data
        while not member.eof:
            if not pending:
                pending, view = bytes(view[:DECODE_IN]), view[DECODE_IN:]
            chunk = member.decompress(pending, DECODE_OUT)
            if not chunk and not pending:  # no input left and no output pending
                raise CorruptBody("the data ends inside a member")
            pending = member.unconsumed_tail  # input held back because the output reached DECODE_OUT
            yield chunk
        pending = member.unused_data  # the rest of the last slice: the next member's start
    if pending or view:
        raise CorruptBody(f"more than {MAX_FRAMES} members")


DECODERS: dict[str, Callable[[bytes], Iterator[bytes]]] = {"zstd": zstd_chunks, "gzip": gzip_chunks}


def load_json(raw: bytes) -> Any:
    """json.loads for a body parse_request already accepted; a refusal, never a 500, should the two disagree."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise RequestError(f"the body is not readable JSON: {type(error).__name__}") from None


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


def from_triton(error: KevError, retry_after_s: int) -> Refused:
    """Triton's refusal as the gateway's answer."""
    if error.kind == "invalid":  # Kev's context-overflow 422s come from the model
        return Refused(422, "invalid", error.message)
    if error.kind == "overloaded":
        return Refused(529, "overloaded", f"overloaded: {error.message}", {"retry-after": str(retry_after_s)})
    if error.kind == "timeout":
        return Refused(504, "timeout", "the model did not answer in time")
    return Refused(500, "model_error", f"model error: {error.message}")


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


def single_question(raw: dict[str, Any], qid: str, question: dict[str, Any]) -> dict[str, Any]:
    body = {"state": raw.get("state"), "questions": {qid: question}}
    if "model" in raw:
        body["model"] = raw["model"]
    return body


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

    def render(self, in_flight: int, arriving: int) -> str:
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
            "# HELP kev_gateway_in_flight Requests holding an admission slot (at Triton).",
            "# TYPE kev_gateway_in_flight gauge",
            f"kev_gateway_in_flight {in_flight}",
            "# HELP kev_gateway_arriving Requests whose body is being read or parsed, before their admission.",
            "# TYPE kev_gateway_arriving gauge",
            f"kev_gateway_arriving {arriving}",
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


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        # Until Triton has answered with the model's config, the limits are the defaults with the KEV_* overrides;
        # the model checks its own again either way.
        self.limits = settings.limits({})
        self.limits_known = False
        self.kev: AsyncKevClient | None = None
        self.in_flight = 0  # admission slots held: one per Triton call under way
        self.arriving = 0  # requests whose body is being read, decoded or parsed: not yet admitted
        self.metrics = Metrics()
        self.readiness = Readiness(self.probe)

    async def start(self) -> None:
        self.kev = AsyncKevClient(self.settings.triton_url, "grpc", self.settings.model, self.settings.timeout_s)

    async def stop(self) -> None:
        if self.kev is not None:
            await self.kev.close()

    def overloaded(self) -> Refused:
        limit, retry = self.settings.max_in_flight, str(self.settings.retry_after_s)
        message = (
            f"overloaded: {self.in_flight} requests in flight, {self.arriving} arriving (limit {limit}); retry later"
        )
        return Refused(429, "overloaded", message, {"retry-after": retry})

    @contextlib.contextmanager
    def arrival(self) -> Iterator[None]:
        """A request from its first byte to its admission: counted with those in flight, and refused at once, its body
        unread, when they fill the limit. So the bodies the gateway holds are bounded by max_in_flight (each by the
        body limit) however many connections send them."""
        if self.in_flight + self.arriving >= self.settings.max_in_flight:
            raise self.overloaded()
        self.arriving += 1
        pending = [True]  # until admitted: `admitted`, in the handler's task, moves it to in_flight
        token = _arrival.set(pending)
        try:
            yield
        finally:
            _arrival.reset(token)
            if pending[0]:
                self.arriving -= 1

    @contextlib.contextmanager
    def admitted(self, n: int = 1) -> Iterator[None]:
        pending = _arrival.get(None)
        arriving = 1 if pending and pending[0] else 0
        if self.in_flight + self.arriving - arriving + n > self.settings.max_in_flight:
            raise self.overloaded()
        if arriving:
            pending[0] = False
            self.arriving -= 1
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

    async def score(self, body: dict[str, Any] | bytes, request_id: str, key: str) -> bytes:
        """One call to Triton, with the state's routing key."""
        assert self.kev is not None
        return await self.kev.score_raw(body, request_id, state_key=key)

    async def score_all(self, parts: list[dict[str, Any]], request_id: str, key: str) -> list[bytes]:
        """One call per part, at once; when one fails the others are cancelled (and with them their Triton calls)
        before the failure is raised, so none runs on after the request's admission ends."""
        calls = [asyncio.ensure_future(self.score(part, f"{request_id}-{i}", key)) for i, part in enumerate(parts)]
        try:
            return await asyncio.gather(*calls)
        except BaseException:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            raise

    async def probe(self) -> None:
        assert self.kev is not None
        reply = json.loads(await self.kev.score_raw(READY_PROBE, f"ready-{uuid.uuid4().hex}", READY_TIMEOUT_S))
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
        except SettingError as error:  # the model itself refuses to load with such a value
            log.error("the model's request limits: %s", error)
        return params

    def route(self, handler: Callable[[bytes, str], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """An endpoint: the body read and decoded within the limits, `handler`'s response unless the client leaves
        first, and every known failure turned into its JSON response and counted."""

        async def endpoint(request: Request) -> Response:
            settings = self.settings
            try:
                with self.arrival():
                    raw = await read_body(request, settings.max_body_bytes)
                    encoding = request.headers.get("content-encoding", "")
                    raw = await decode_body(raw, encoding, settings.max_decoded_bytes)
                    if not self.limits_known:  # until Triton has said what the model's limits are
                        await self.model_parameters()
                    return await unless_disconnected(request, handler(raw, request.state.request_id))
            except RequestError as error:  # Kev's refusals, in FastAPI's shapes
                self.metrics.error("too_large" if error.status == 413 else "invalid")
                return json_response(error.body, error.status)
            except KevError as error:
                refused = from_triton(error, settings.retry_after_s)
                if refused.reason == "model_error":
                    log.warning("model error (request id %s): %s", request.state.request_id, error.message)
                return self.refuse(refused)
            except Refused as error:
                return self.refuse(error)

        return endpoint

    def refuse(self, error: Refused) -> Response:
        self.metrics.error(error.reason)
        return error.response()

    async def system_one(self, raw: bytes, request_id: str) -> Response:
        _, key = await self.parse(raw, len(raw))
        with self.admitted():
            return Response(await self.score(raw, request_id, key), media_type="application/json")

    async def separate(self, raw: bytes, request_id: str) -> Response:
        record, key = await self.parse(raw, len(raw))
        body = load_json(raw)
        parts = [single_question(body, q.id, body["questions"][q.id]) for q in record.questions]
        with self.admitted(len(parts)):
            replies = await self.score_all(parts, request_id, key)
        answers: dict[str, Any] = {}
        input_tokens = output_tokens = 0
        latency = 0.0
        parsed = [json.loads(reply) for reply in replies]
        for reply in parsed:
            answers.update(reply["answers"])
            input_tokens += reply["usage"]["input_tokens"]
            output_tokens += reply["usage"]["output_tokens"]
            latency += reply["latency_ms"]
        merged = {
            "model": record.model,
            "answers": answers,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
            "latency_ms": round(latency, 1),
        }
        if (marks := truncation_marks(parsed[0])) is not None:  # every part has the one state: the first says it
            usage, merged["truncated"] = marks
            merged["usage"].update(usage)
        return json_response(merged)

    async def permute(self, raw: bytes, request_id: str) -> Response:
        try:
            envelope = PermuteBody.model_validate_json(raw)
        except ValidationError as error:
            detail = [{**e, "loc": ["body", *e["loc"]]} for e in error.errors(include_url=False)]
            raise RequestError(json.loads(json.dumps(detail, default=lambda _: {}))) from None
        try:
            record, key = await self.parse(envelope.request, len(raw))
        except RequestError as error:
            raise nested(error, "request") from None
        question = next((q for q in record.questions if q.id == envelope.question), None)
        if question is None or question.type != "choice":
            raise RequestError("question must be an existing choice question")
        original = envelope.request["questions"][question.id]
        keys = list(original["criteria"])
        rng = random.Random(envelope.seed)
        orders = [keys]
        for _ in range(envelope.n_perm - 1):
            order = list(keys)
            rng.shuffle(order)
            orders.append(order)
        parts = [
            single_question(
                envelope.request, question.id, {**original, "criteria": {k: original["criteria"][k] for k in order}}
            )
            for order in orders
        ]
        with self.admitted(len(parts)):
            replies = await self.score_all(parts, request_id, key)
        runs = []
        parsed = [json.loads(reply) for reply in replies]
        for order, reply in zip(orders, parsed):
            answer = reply["answers"][question.id]
            runs.append(
                {
                    "order": order,
                    "probabilities": answer["probabilities"],
                    "choice": answer["choice"],
                    "latency_ms": reply["latency_ms"],
                }
            )
        spread = {
            k: round4(max(r["probabilities"][k] for r in runs) - min(r["probabilities"][k] for r in runs)) for k in keys
        }
        stable = len({r["choice"] for r in runs}) == 1
        result: dict[str, Any] = {"runs": runs, "argmax_stable": stable, "spread": spread}
        if (marks := truncation_marks(parsed[0])) is not None:
            result["truncated"], result["usage"] = marks[1], marks[0]
        return json_response(result)

    async def models(self) -> Response:
        params = await self.model_parameters()
        limits = self.settings.limits(params) if params else self.limits
        extras = {
            "backend": "triton",
            "triton_model": self.settings.model,
            **dataclasses.asdict(limits),  # the request limits in force, the body limit being the decoded one
            "dtype": self.settings.dtype(params),
            "serving": await asyncio.to_thread(serving_statistics, self.settings.metrics_url, self.settings.model),
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
        return Response(
            self.metrics.render(self.in_flight, self.arriving), media_type="text/plain; version=0.0.4; charset=utf-8"
        )


# --- middleware, outermost first: Observe, CORS, Guard ---------------------------------------------------------------


class Observe:
    """Outermost: gives each request its id (the client's x-typesafe-request-id, else a fresh one) in
    `request.state.request_id`, adds it and server-timing to every response, and counts every response by route and
    status. Paths that are not routes count as "other", so hostile paths cannot grow the metrics."""

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
        request_id = Headers(scope=scope).get(REQUEST_ID) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
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


class Guard:
    """Inside CORS, so its answers carry CORS headers (a browser can read a 401 or 500): the bearer key on /v1/* (CORS
    answers preflights before they get here), and the catch-all that turns any exception below into a JSON 500
    naming the request id, logged in one line."""

    def __init__(self, app: ASGIApp, metrics: Metrics, api_key: str | None) -> None:
        self.app, self.metrics, self.api_key = app, metrics, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
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
        log_level="warning",
        log_config=log_config(),
        access_log=False,
    )


if __name__ == "__main__":
    main()
