"""The gateway's access log: one JSON line a request, on its own logger (`kev_backend.serve.gateway.access`, to
stdout), written when the response has been sent: time, request id, method, route (the path when it is one of the
gateway's routes, else "other": a hostile path is never logged), status, latency, bytes in and out, and the state's
routing key when the request got as far as parsing (`x-kev-state-key`: a hash of the rendered state, never the state
itself, so the log holds no client data).

The handlers learn the state key deep inside; they note it in the request's Access record through a context
variable the middleware sets, which every task the request starts inherits."""

from __future__ import annotations

import contextvars
import json
import logging
import time
from dataclasses import dataclass

access_log = logging.getLogger("kev_backend.serve.gateway.access")


@dataclass
class Access:
    request_id: str
    method: str
    route: str
    started: float
    bytes_in: int = 0
    bytes_out: int = 0
    status: int = 500  # should the app send nothing at all
    state_key: str | None = None

    def line(self) -> str:
        return json.dumps(
            {
                "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + "Z",
                "request_id": self.request_id,
                "method": self.method,
                "route": self.route,
                "status": self.status,
                "latency_ms": round((time.perf_counter() - self.started) * 1000, 2),
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
                "state_key": self.state_key,
            },
            separators=(",", ":"),
        )


current: contextvars.ContextVar[Access | None] = contextvars.ContextVar("kev_gateway_access", default=None)


def note_state_key(key: str) -> None:
    """The request's state key, for its access-log line (nothing outside a request)."""
    if (access := current.get()) is not None:
        access.state_key = key
