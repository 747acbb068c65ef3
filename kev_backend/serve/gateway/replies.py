"""The gateway's own answers: JSON bodies, the refusals it gives, and Triton's failures as a client should see them.

A failure is reported to the client it is about. The model tags the errors that are about a request itself
(protocol/envelope.py, TAGGED_ERRORS): those are that request's 4xx with Kev's detail. Anything untagged did not come
from the model's judgement of this request (a batch-mate's malformed tensor, Triton's shared memory, a stub or a
server restarting), so it is answered with a neutral message that echoes no other request's text and names nothing
internal: 503 with retry-after where trying again later can work, else 500. The real message is logged with the
request id.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.responses import Response

from ...protocol import envelope
from ..client.clients import KevError

REQUEST_ID = "x-typesafe-request-id"
CLIENT_CLOSED = 499  # nginx's "client closed request": counted, never seen by the client
# Every reason kev_gateway_errors_total reports (all of them, from 0, so a rate is defined before the first error).
REASONS = (
    "invalid",  # 422 / 400: the request is not one Kev answers
    "too_large",  # 413: the body, or what it decodes to, is over a byte limit
    "unsupported_encoding",  # 415: a Content-Encoding other than identity, zstd, gzip
    "bad_encoding",  # 400: the zstd / gzip data does not decode
    "unauthorized",  # 401
    "overloaded",  # 429 (the gateway's limits) / 529 (Triton's queue)
    "timeout",  # 504: Triton did not answer within KEV_GATEWAY_TIMEOUT_S; 408: the body did not arrive in time
    "unavailable",  # 503: Triton unreachable or restarting, or it failed the request's batch for another's sake
    "client_disconnected",  # the client went away before its answer; its Triton calls were cancelled
    "model_error",  # 500 from Triton
    "internal",  # 500 from the gateway itself
)
# Untagged Triton messages that say the server, not the request, is at fault right now (a restart or a shared-memory
# shortage passes): each is answered 503 with retry-after. Matched on Triton 2.51's and gRPC's own texts.
UNAVAILABLE_TEXTS = (
    "is not healthy",  # the Python stub died (kev-serve restarts it)
    "Failed to increase the shared memory pool size",  # the Python backend's shared memory is exhausted
    "shared memory",
    "Server not ready",
    "Request for unknown model",  # loading or unloading during a restart
    "is not ready",
    "failed to connect",  # the channel has no server
    "Connection refused",
    "Socket closed",
    "Connection reset",
    "GOAWAY",
)
# Triton's own queue refusals (dynamic_batching.default_queue_policy): 529, as Kev's overloaded server. The client
# also calls an UNAVAILABLE that mentions a queue or a timeout "overloaded" (client.KevError).
QUEUE_TEXTS = ("Exceeds maximum queue size", "Request timeout expired")


class Refused(Exception):
    """A request the gateway answers with an error of its own: the status, the `detail` (a message, or FastAPI's list
    of validation errors), the metrics reason (one of REASONS) and any extra headers."""

    def __init__(
        self, status: int, reason: str, detail: str | list[Any], headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(detail if isinstance(detail, str) else json.dumps(detail))
        assert reason in REASONS, reason
        self.status, self.reason, self.detail, self.headers = status, reason, detail, headers

    def response(self) -> Response:
        return json_response({"detail": self.detail}, self.status, self.headers)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """`body` as compact JSON. A lone surrogate (from a `\\udXXX` escape a client sent and an error message echoes)
    cannot be UTF-8: backslashreplace writes it back as that same JSON escape, inside its string, so the body stays
    valid JSON. A non-finite float (NaN, Infinity a client sent and a 422 echoes in its `input`) is written as null,
    as pydantic's JSON mode writes it: JSON has no such numbers."""
    return Response(encode_json(body), status_code=status, media_type="application/json", headers=headers)


def encode_json(body: Any) -> bytes:
    """`body` as json_response writes it."""
    try:
        text = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:  # a non-finite float somewhere: rare, so only then is the body walked
        text = json.dumps(finite(body), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8", "backslashreplace")


def with_request_id(body: bytes, request_id: str) -> bytes:
    """An error's JSON body with `request_id` added (Kev's fields untouched; a body that is not a JSON object, or
    names one already, as it is)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict) or "request_id" in data:
        return body
    return encode_json({**data, "request_id": request_id})


def finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None, containers rebuilt only where they hold one. Iterative:
    an echoed input may be nested as deep as the request limits allow."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if not isinstance(value, (dict, list, tuple)):
        return value
    root: list[Any] = [value]
    stack: list[tuple[Any, Any, Any]] = [(root, 0, value)]  # (container, key, value) to rebuild in place
    while stack:
        parent, key, item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                parent[key] = None
        elif isinstance(item, dict):
            parent[key] = copy = dict(item)
            stack.extend((copy, k, v) for k, v in copy.items())
        elif isinstance(item, (list, tuple)):
            parent[key] = copy = list(item)
            stack.extend((copy, i, v) for i, v in enumerate(copy))
    return root[0]


def from_triton(error: KevError, request_id: str, retry_after_s: int) -> Refused:
    """Triton's failure of a request as the gateway's answer (this module's docstring says why each)."""
    retry = {"retry-after": str(retry_after_s)}
    tagged = envelope.read_tagged(error.message)
    if tagged is not None:
        status, detail = tagged
        if status == 413:
            return Refused(413, "too_large", detail)
        if 400 <= status < 500:
            return Refused(status, "invalid", detail)
        return Refused(500, "model_error", f"the model failed to answer this request (request id {request_id})")
    if error.kind == "timeout":
        return Refused(504, "timeout", "the model did not answer in time")
    if error.kind == "overloaded" or any(text in error.message for text in QUEUE_TEXTS):
        return Refused(529, "overloaded", "overloaded: the model's queue is full; retry later", retry)
    unavailable = error.status in ("StatusCode.UNAVAILABLE", "503", "StatusCode.INVALID_ARGUMENT", "400")
    if unavailable or any(text in error.message for text in UNAVAILABLE_TEXTS):
        # An untagged INVALID_ARGUMENT is Triton failing a whole batch for one request's malformed tensor: another
        # client's fault, and its message quotes that client's request.
        detail = f"the model server could not answer this request now (request id {request_id}); retry later"
        return Refused(503, "unavailable", detail, retry)
    return Refused(500, "model_error", f"the model failed to answer this request (request id {request_id})")
