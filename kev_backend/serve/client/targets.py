"""Where `kev score` sends each line, and what a failure means for it: a request's own refusal is final (it is written
as that line's error), anything else the server or the network did (overloaded, unavailable, restarting, a timeout)
is retried with backoff, and written as an error only once the retries are spent, for a rerun to retry again.

Two targets: Triton's gRPC (or HTTP) port through KevClient, and the System One gateway (`POST /v1/systemone`, its
bearer key), whose Retry-After is honoured."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Protocol

from ...protocol import envelope
from .clients import KevClient, KevError


class Failed(Exception):
    """A line not answered. `final`: the request itself was refused (no retry can help); else the server or the
    network failed it. `retry_after_s`: the server's hint, if it gave one."""

    def __init__(self, kind: str, message: str, final: bool, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.final, self.retry_after_s = kind, message, final, retry_after_s


class Target(Protocol):
    def score(self, line: str) -> dict[str, Any]: ...  # the response body, or Failed

    def close(self) -> None: ...


class TritonTarget:
    """Triton's port (gRPC by default). The model tags its refusal of a request (envelope.read_tagged): that is final;
    an untagged failure is Triton's or the network's (a full queue, a restart, a batch-mate's malformed tensor)."""

    def __init__(self, url: str, protocol: str, model: str, timeout_s: float) -> None:
        self.url, self.protocol, self.model, self.timeout_s = url, protocol, model, timeout_s
        # A gRPC client is shared by every thread; an HTTP one is not thread-safe: one a thread.
        self.local = threading.local()
        self.clients: list[KevClient] = []
        self.lock = threading.Lock()

    def client(self) -> KevClient:
        if self.protocol == "grpc" and self.clients:
            return self.clients[0]
        client = getattr(self.local, "client", None)
        if client is None:
            with self.lock:
                if self.protocol == "grpc" and self.clients:
                    return self.clients[0]
                client = KevClient(self.url, self.protocol, self.model, self.timeout_s)  # type: ignore[arg-type]
                self.clients.append(client)
            self.local.client = client
        return client

    def score(self, line: str) -> dict[str, Any]:
        try:
            return self.client().score(line)
        except KevError as error:
            tagged = envelope.read_tagged(error.message)
            if tagged is not None:
                status, detail = tagged
                kind = "invalid" if 400 <= status < 500 else "model_error"
                raise Failed(kind, detail if isinstance(detail, str) else json.dumps(detail), final=True) from None
            raise Failed(error.kind, error.message, final=False) from None

    def close(self) -> None:
        for client in self.clients:
            client.close()


# The gateway's statuses a retry can help: overloaded (429, 529), unavailable (502, 503), a timeout (504).
GATEWAY_RETRY = {429: "overloaded", 529: "overloaded", 502: "unavailable", 503: "unavailable", 504: "timeout"}
# And those that are final, by what they say about the request.
GATEWAY_FINAL = {401: "unauthorized", 403: "unauthorized", 413: "too_large", 500: "model_error"}


class GatewayTarget:
    """The System One gateway: 200 is the answer; 4xx and its 500 (the model failed this request) are final."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float) -> None:
        self.url = url.rstrip("/") + "/v1/systemone"
        self.headers = {"content-type": "application/json"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s

    def score(self, line: str) -> dict[str, Any]:
        request = urllib.request.Request(self.url, line.encode(), self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as error:
            detail = _detail(error.read())
            after = error.headers.get("retry-after")
            retry_after = float(after) if after and after.replace(".", "", 1).isdigit() else None
            retry = error.code in GATEWAY_RETRY
            kind = GATEWAY_RETRY.get(error.code) or GATEWAY_FINAL.get(error.code)
            kind = kind or ("invalid" if 400 <= error.code < 500 else f"http_{error.code}")
            raise Failed(kind, f"{error.code}: {detail}", not retry, retry_after) from None
        except (OSError, ValueError) as error:  # refused, reset, timed out; a reply that is not JSON
            raise Failed("unavailable", f"{type(error).__name__}: {error}", final=False) from None

    def close(self) -> None:
        pass


def _detail(raw: bytes) -> str:
    try:
        detail = json.loads(raw).get("detail", "")
    except (ValueError, AttributeError):
        return raw[:500].decode(errors="replace")
    return detail if isinstance(detail, str) else json.dumps(detail)


@dataclass(frozen=True)
class Retries:
    """How often a line is retried after a failure that is not final, and how long it waits: full jitter on an
    exponential backoff (base × 2^attempt, capped), or the server's Retry-After when it gave one (capped too)."""

    attempts: int = 5
    base_s: float = 0.5
    cap_s: float = 30.0

    def wait_s(self, attempt: int, retry_after_s: float | None) -> float:
        if retry_after_s is not None:
            return min(self.cap_s, retry_after_s)
        return random.uniform(0, min(self.cap_s, self.base_s * 2**attempt))


def score_with_retries(target: Target, line: str, retries: Retries, stopping: Any = None) -> dict[str, Any]:
    """The line's response body, retrying failures that are not final; raises the last Failed. `stopping`: an
    Event that ends the waits early (an interrupted run)."""
    attempt = 0
    while True:
        try:
            return target.score(line)
        except Failed as failed:
            if failed.final or attempt >= retries.attempts or (stopping is not None and stopping.is_set()):
                raise
            wait = retries.wait_s(attempt, failed.retry_after_s)
            attempt += 1
            if stopping is not None:
                if stopping.wait(wait):
                    raise
            else:
                time.sleep(wait)
