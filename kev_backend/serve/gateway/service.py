"""The gateway's state and its routes: admission (in-flight slots, bodies still arriving), each route's handler, the
one shared Triton client, and the heap a large request leaves handed back to the system."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import ctypes.util
import dataclasses
import json
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from fastapi import Request, Response

from ...protocol import envelope
from ...protocol.answers import round4
from ...protocol.request import Record, RequestError
from ...settings import GatewaySettings, SettingError, model_limits, parameters
from ..client.clients import AsyncKevClient, KevError, encode
from ..version import version
from .access import note_state_key
from .answering import (
    forget,
    gather_or_cancel,
    grouped,
    nested,
    parsed_and_keyed,
    permutations,
    permute_envelope,
    truncation_marks,
    unless_disconnected,
)
from .bodies import OFFLOAD_BYTES, decode_body, read_body
from .observability import READY_TIMEOUT_S, Cached, Metrics, Readiness, log, serving_statistics
from .replies import Refused, from_triton, json_response

READY_PROBE = {"state": "ready?", "questions": {"ok": {"type": "noul", "instructions": "ok?"}}}
MODELS_FRESH_S = 1.0  # GET /v1/models: the model's parameters and serving statistics are read at most once a second
TRIM_BYTES = 1 << 20  # after a request whose body was this large, freed heap is handed back to the system
TRIM_DELAY_S = 0.05  # ... this long after it ends, when its objects are gone
PARAMETERS = {envelope.TAGGED_ERRORS: True}  # every call: errors about the request are tagged (replies.from_triton)
# The arrival of the request a task serves, for `admitted`: it stops counting as arriving once admitted.
_arrival: contextvars.ContextVar[Arrival] = contextvars.ContextVar("arrival")


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
            record, key = await asyncio.to_thread(parsed_and_keyed, body, self.limits)
        else:
            record, key = parsed_and_keyed(body, self.limits)
        note_state_key(key)  # for the request's access-log line
        return record, key

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

    async def read_model_info(self) -> tuple[dict[str, str], dict[str, float | int] | None, dict[str, Any]]:
        """What GET /v1/models reports beside the cards: the model's parameters, its serving statistics and what
        answers (the model instances' kev_build_info, tritonserver's version, this gateway's)."""
        params = await self.model_parameters()
        settings = self.settings
        serving, answering = await asyncio.to_thread(serving_statistics, settings.metrics_url, settings.model)
        try:
            tritonserver = await self.kev.server_version()
        except KevError:
            tritonserver = None
        provenance = {"instances": answering, "tritonserver": tritonserver, "gateway": version()}
        return params, serving, provenance

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
                params, serving, provenance = await self.model_info.get()
        except Refused as error:
            return self.refuse(error)
        limits = self.settings.limits(params) if params else self.limits
        extras = {
            "backend": "triton",
            "triton_model": self.settings.model,
            **dataclasses.asdict(limits),  # the request limits in force, the body limit being the decoded one
            "dtype": self.settings.dtype(params),
            "serving": serving,
            "provenance": provenance,
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
