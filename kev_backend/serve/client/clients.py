"""A small client for Kev on Triton, for tritonclient users: builds `REQUEST`, parses `RESPONSE`, and turns Triton
errors into KevError. Sync (`KevClient`) and async (`AsyncKevClient`), over gRPC (default) or HTTP.

    with KevClient("localhost:8001") as kev:
        body = kev.score({"state": "...", "questions": {...}})
"""

from __future__ import annotations

import json
from typing import Any, Literal

import numpy as np
from tritonclient.utils import InferenceServerException

from ...protocol.request import STATE_KEY_HEADER, state_key_of

Protocol = Literal["grpc", "http"]
Body = dict[str, Any] | str | bytes


class KevError(Exception):
    """A request the server did not answer. `kind`: "invalid" (the request: Kev's 422 message), "overloaded"
    (Triton's queue is full or its queue timeout passed), "timeout" (the client gave up) or "internal"."""

    def __init__(self, kind: str, message: str, status: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.status = status

    @classmethod
    def from_triton(cls, error: InferenceServerException) -> KevError:
        status = str(error.status() or "")
        message = error.message() or str(error)
        if status in ("400", "StatusCode.INVALID_ARGUMENT"):
            kind = "invalid"
        elif status in ("503", "StatusCode.UNAVAILABLE") and ("queue" in message or "timeout" in message):
            kind = "overloaded"
        elif status == "StatusCode.DEADLINE_EXCEEDED" or "Deadline Exceeded" in message:
            kind = "timeout"
        else:
            kind = "internal"
        return cls(kind, message, status)

    def __repr__(self) -> str:  # Locust and logs group failures by repr
        return f"KevError({self.kind!r}, {self.message!r})"


# tritonclient's own channel options (messages up to 2 GiB, its keep-alive defaults), and reconnection attempts at
# most a second apart: after a server restart the channel is back within a second of the server, not gRPC's default
# backoff of up to two minutes.
GRPC_CHANNEL = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.keepalive_time_ms", 2**31 - 1),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", False),
    ("grpc.http2.max_pings_without_data", 2),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


def encode(body: Body) -> bytes:
    """The request's bytes. A dict is written as compact UTF-8 JSON: escaped, non-ASCII text takes up to six bytes a
    character, and a part of a request the gateway splits could then pass the server's byte limit where the request
    did not. One holding a lone surrogate, which UTF-8 cannot carry, is escaped, for the server to refuse with Kev's
    message."""
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode()
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode()


def _module(protocol: Protocol, asynchronous: bool):
    if protocol == "grpc":
        import tritonclient.grpc as sync_module
        import tritonclient.grpc.aio as async_module
    elif protocol == "http":
        try:
            import tritonclient.http as sync_module
            import tritonclient.http.aio as async_module
        except ImportError as error:  # the serve set has the gRPC client only
            raise ImportError(
                f"protocol 'http' needs Triton's HTTP client: pip install 'tritonclient[http]' ({error})"
            ) from error
    else:
        raise ValueError(f"protocol must be grpc or http, not {protocol!r}")
    return sync_module, (async_module if asynchronous else sync_module)


def request_input(protocol: Protocol, body: Body):
    sync_module, _ = _module(protocol, False)
    array = np.array([[encode(body)]], dtype=np.object_)
    tensor = sync_module.InferInput("REQUEST", list(array.shape), "BYTES")
    tensor.set_data_from_numpy(array)
    return tensor


def response_body(result) -> dict[str, Any]:
    return json.loads(result.as_numpy("RESPONSE")[0, 0])


class _Client:
    def __init__(self, url: str, protocol: Protocol, model: str, timeout_s: float, asynchronous: bool) -> None:
        self.protocol, self.model, self.timeout_s = protocol, model, timeout_s
        options = {"channel_args": GRPC_CHANNEL} if protocol == "grpc" else {}
        self._client = _module(protocol, asynchronous)[1].InferenceServerClient(url, **options)

    def _infer_args(
        self,
        body: Body,
        request_id: str,
        timeout_s: float | None = None,
        state_key: str | None = None,
        parameters: dict[str, Any] | None = None,
    ) -> tuple[list, dict[str, Any]]:
        """The inputs and options of one call; the state's routing key travels as a header (gRPC metadata), so a
        proxy in front of several servers sends a repeated state where it is banked. `parameters`: the request's
        parameters (protocol/envelope.py says which the model reads)."""
        options: dict[str, Any] = {"request_id": request_id}
        if parameters:
            options["parameters"] = parameters
        if key := state_key or state_key_of(body):
            options["headers"] = {STATE_KEY_HEADER: key}
        if self.protocol == "grpc":  # only the gRPC client takes a client-side deadline
            options["client_timeout"] = self.timeout_s if timeout_s is None else timeout_s
        return [request_input(self.protocol, body)], options


class KevClient(_Client):
    """Blocking client; a gRPC client is thread-safe, an HTTP one is not (use one per thread)."""

    def __init__(
        self, url: str = "127.0.0.1:8001", protocol: Protocol = "grpc", model: str = "kev", timeout_s: float = 60.0
    ) -> None:
        super().__init__(url, protocol, model, timeout_s, asynchronous=False)

    def score(self, body: Body, request_id: str = "", state_key: str | None = None) -> dict[str, Any]:
        """The response body (Kev 1.0's JSON as a dict) for one System One request. `state_key`: its routing key
        when the caller has it already (else computed from the body)."""
        inputs, options = self._infer_args(body, request_id, state_key=state_key)
        try:
            result = self._client.infer(self.model, inputs, **options)
        except InferenceServerException as error:
            raise KevError.from_triton(error) from None
        return response_body(result)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> KevClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class AsyncKevClient(_Client):
    """asyncio client; one instance shares one channel (gRPC) or connection pool (HTTP) across coroutines."""

    def __init__(
        self, url: str = "127.0.0.1:8001", protocol: Protocol = "grpc", model: str = "kev", timeout_s: float = 60.0
    ) -> None:
        super().__init__(url, protocol, model, timeout_s, asynchronous=True)

    async def score(self, body: Body, request_id: str = "", state_key: str | None = None) -> dict[str, Any]:
        return json.loads(await self.score_raw(body, request_id, state_key=state_key))

    async def score_raw(
        self,
        body: Body,
        request_id: str = "",
        timeout_s: float | None = None,
        state_key: str | None = None,
        parameters: dict[str, Any] | None = None,
    ) -> bytes:
        """The response JSON as the server wrote it (for pass-through). `timeout_s` overrides the client's deadline
        for this call (gRPC only); `parameters` are the request's. Cancelling the awaiting task cancels the call:
        Triton drops it if still queued."""
        inputs, options = self._infer_args(body, request_id, timeout_s, state_key, parameters)
        try:
            result = await self._client.infer(self.model, inputs, **options)
        except InferenceServerException as error:
            raise KevError.from_triton(error) from None
        return result.as_numpy("RESPONSE")[0, 0]

    async def server_version(self) -> str:
        """tritonserver's version, from its server metadata."""
        try:
            if self.protocol == "grpc":
                return str((await self._client.get_server_metadata(as_json=True))["version"])
            return str((await self._client.get_server_metadata())["version"])
        except InferenceServerException as error:
            raise KevError.from_triton(error) from None

    async def model_config(self) -> dict[str, Any]:
        if self.protocol == "grpc":
            return (await self._client.get_model_config(self.model, as_json=True))["config"]
        return await self._client.get_model_config(self.model)

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> AsyncKevClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()
