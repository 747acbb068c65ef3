"""The gateway's middleware, outermost first: Observe (the request id, server-timing, counting and timing
responses), CORS (Starlette's), Guard (a malformed request id, the bearer key, the catch-all 500)."""

from __future__ import annotations

import hmac
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .access import Access, access_log, current
from .observability import Metrics, log
from .replies import REQUEST_ID, json_response, with_request_id

REQUEST_ID_MAX = 128  # a client's request id: 1 to this many visible ASCII characters, else 400


class Observe:
    """Outermost: gives each request its id in `request.state.request_id`, adds it and server-timing to every
    response and `request_id` to every JSON error body, counts and times every response by route and status (the time
    from the request's arrival here to the end of its response, body sent: kev_gateway_request_duration_seconds), and
    writes its access-log line (access.py). Paths that are not routes count as "other", so hostile paths cannot grow
    the metrics or reach the log.

    The id is the client's x-typesafe-request-id when that is 1 to REQUEST_ID_MAX visible ASCII characters, else a
    fresh one: a malformed id is never echoed, sent to Triton or logged, and Guard refuses its request with 400 (the
    response carrying the fresh id). The id goes to Triton with the request (its request id), so a server-side log
    line names it too."""

    def __init__(self, app: ASGIApp, metrics: Metrics, access_log: bool = True) -> None:
        self.app, self.metrics, self.access_log = app, metrics, access_log
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
        access = Access(request_id, scope["method"], "other", started)
        held: Message | None = None  # an error's response start, held until its body is complete
        parts: list[bytes] = []

        async def counting_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                access.bytes_in += len(message.get("body", b""))
            return message

        async def send_with_headers(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                access.status = message["status"]
                headers = MutableHeaders(raw=list(message.get("headers", [])))
                headers[REQUEST_ID] = request_id
                headers["server-timing"] = f"app;dur={(time.perf_counter() - started) * 1000:.1f}"
                message = {**message, "headers": headers.raw}
                if access.status >= 400 and headers.get("content-type", "").startswith("application/json"):
                    held = message  # error bodies are small: held whole, for their request id
                    return
            elif message["type"] == "http.response.body" and held is not None:
                parts.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = with_request_id(b"".join(parts), request_id)
                headers = MutableHeaders(raw=list(held["headers"]))
                headers["content-length"] = str(len(body))
                start, held = {**held, "headers": headers.raw}, None
                await send(start)
                message = {"type": "http.response.body", "body": body}
            if message["type"] == "http.response.body":
                access.bytes_out += len(message.get("body", b""))
            await send(message)

        token = current.set(access)
        try:
            await self.app(scope, counting_receive, send_with_headers)
        finally:
            current.reset(token)
            access.route = self.route(scope)
            self.metrics.request(access.route, access.status, time.perf_counter() - started)
            if self.access_log:
                access_log.info(access.line())


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
