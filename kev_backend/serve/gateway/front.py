"""The gateway's connections: what a client costs before its request reaches the app, bounded.

`GuardedProtocol` is uvicorn's httptools protocol (`uvicorn.run(http=...)`) with these limits (GatewaySettings):
- a request's head (request line and headers) is fed to the parser at most `max_header_bytes` in all, and its URL at
  most `max_url_bytes`: past them 431 / 414 at once, before any middleware or the bearer key, and nothing past the
  limit is buffered (httptools joins a header's fragments by concatenation: a header fed whole in many reads costs
  the square of its size);
- the head must arrive within `header_timeout_s` of its first byte (else 408); a body must keep arriving (no pause
  over `body_idle_timeout_s`) and be whole within `body_timeout_s` of its head (else 408 from the app: the reader is
  woken with the deadline's message, bodies.read_body); a connection with no request in progress is closed after
  `keepalive_timeout_s`, a new one included;
- at most `max_connections` connections, below the process's descriptor limit (raised to its hard limit at start):
  a new connection over it closes the connection idle longest (no request in progress) to take its place, as nginx
  reuses keep-alive connections; only when none is idle is it refused (503, retry-after).
Counts of each event are in GET /metrics (`kev_gateway_connection_events_total`).

One uvicorn server runs in a process, so its connections share one `Front`, made by the first connection.
"""

from __future__ import annotations

import asyncio
import json
import resource
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from ...settings import GatewaySettings

FRONT_EXTENSION = "kev.front"  # the request's BodyClock in its ASGI scope's extensions
DRAIN_S = 2.0  # after refusing a request mid-head, its remaining bytes are read and dropped this long at most
DRAIN_BYTES = 1 << 20  # ... and this many: then the connection is closed (a reset past here is the client's)
ANSWER_GRACE_S = 5.0  # after a body deadline, the app has this long to send its 408 before the connection goes
# Connection events counted for GET /metrics, all from 0.
EVENTS = (
    "refused",  # a new connection over max_connections with none idle to close
    "evicted",  # an idle connection closed to admit a new one
    "idle_closed",  # no request within keepalive_timeout_s
    "header_timeout",  # 408: the head did not arrive within header_timeout_s
    "body_timeout",  # 408: the body paused over body_idle_timeout_s or took over body_timeout_s
    "header_too_large",  # 431
    "url_too_long",  # 414
)


class Phase:
    IDLE = "idle"  # no request in progress: may be closed to admit a new connection
    HEAD = "head"  # a request's head arriving
    BODY = "body"  # its body arriving
    BUSY = "busy"  # the whole request read, its response not yet sent
    CLOSING = "closing"  # refused or timed out: nothing more is parsed


@dataclass(frozen=True)
class FrontLimits:
    header_timeout_s: float
    body_idle_timeout_s: float
    body_timeout_s: float
    keepalive_timeout_s: float
    max_header_bytes: int
    max_url_bytes: int
    max_connections: int

    @classmethod
    def of(cls, settings: GatewaySettings) -> FrontLimits:
        return cls(
            header_timeout_s=settings.header_timeout_s,
            body_idle_timeout_s=settings.body_idle_timeout_s,
            body_timeout_s=settings.body_timeout_s,
            keepalive_timeout_s=settings.keepalive_timeout_s,
            max_header_bytes=settings.max_header_bytes,
            max_url_bytes=settings.max_url_bytes,
            max_connections=settings.max_connections or default_max_connections(),
        )


def raise_descriptor_limit() -> int:
    """Raises this process's soft RLIMIT_NOFILE to its hard limit (what the process may open without privileges);
    returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # an infinite hard limit some kernels refuse as a soft one: keep the soft
            pass
    return soft


def default_max_connections() -> int:
    """The descriptor limit less an eighth (at least 64): room for the listening socket, Triton's channel, worker
    threads, logs and the connections the kernel hands over in one burst of accepts before any is counted."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(1, soft - max(64, soft // 8))


class BodyClock:
    """A request's body deadline, shared by the protocol (which sets `expired` to the refusal's message) and the
    body's reader (which answers 408 with it)."""

    __slots__ = ("expired",)

    def __init__(self) -> None:
        self.expired: str | None = None


def body_clock(scope: dict[str, Any]) -> BodyClock | None:
    """The request's BodyClock; None when it came through another server (a test client)."""
    return scope.get("extensions", {}).get(FRONT_EXTENSION)


class Front:
    """The connections of one server process: how many are open, which are idle (longest idle first), and counts of
    each event."""

    def __init__(self, limits: FrontLimits) -> None:
        self.limits = limits
        self.open = 0
        self.idle: OrderedDict[GuardedProtocol, None] = OrderedDict()
        self.events: Counter[str] = Counter(dict.fromkeys(EVENTS, 0))

    def admit(self, connection: GuardedProtocol) -> bool:
        """Counts a new connection; over the limit, closes the connection idle longest to make room. False when none
        is idle: the new one is to be refused."""
        self.open += 1
        if self.open <= self.limits.max_connections:
            return True
        if not self.idle:
            return False
        victim, _ = self.idle.popitem(last=False)
        self.events["evicted"] += 1
        victim.close()
        return True

    def closed(self, connection: GuardedProtocol) -> None:
        self.open -= 1
        self.idle.pop(connection, None)

    def rests(self, connection: GuardedProtocol) -> None:
        self.idle[connection] = None
        self.idle.move_to_end(connection)

    def wakes(self, connection: GuardedProtocol) -> None:
        self.idle.pop(connection, None)


_front: Front | None = None


def current() -> Front | None:
    """This process's Front, once a connection has made it."""
    return _front


def shared_front() -> Front:
    global _front
    if _front is None:
        _front = Front(FrontLimits.of(GatewaySettings.read()))
    return _front


class UrlTooLong(Exception):
    """Raised from the parser's URL callback: parsing stops there."""


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of this module's docstring. Each connection is in one Phase at a
    time, and has at most one timer: the deadline of that phase."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.front = shared_front()
        self.limits = self.front.limits
        self.phase = Phase.IDLE
        self.timer: asyncio.TimerHandle | None = None
        self.head_bytes = 0  # bytes of the current request's head fed to the parser
        self.clock = BodyClock()
        self.body_deadline = self.last_body = 0.0
        self.drained = 0  # bytes dropped after a refusal

    # --- the connection ------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.front.admit(self):
            self.front.events["refused"] += 1
            self.phase = Phase.CLOSING
            self.transport.write(response_bytes(503, "too many connections; retry later", {"retry-after": "1"}))
            self.transport.close()
            return
        self.rest()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_timer()
        self.front.closed(self)
        super().connection_lost(exc)

    def close(self) -> None:
        """Closes the connection at once (idle, or past a deadline)."""
        self.phase = Phase.CLOSING
        self.cancel_timer()
        self.front.wakes(self)
        if not self.transport.is_closing():
            self.transport.close()

    def rest(self) -> None:
        """No request in progress: idle until the keep-alive deadline, and first in line to be closed for room."""
        self.phase = Phase.IDLE
        self.front.rests(self)
        self.arm(self.limits.keepalive_timeout_s, self.idle_expired)

    def idle_expired(self) -> None:
        self.front.events["idle_closed"] += 1
        self.close()

    def arm(self, delay: float, callback: Any) -> None:
        self.cancel_timer()
        self.timer = self.loop.call_later(delay, callback)

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    # --- bytes in ----------------------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.phase == Phase.CLOSING:
            self.drain(len(data))
            return
        view = memoryview(data)
        while view:
            if self.phase in (Phase.IDLE, Phase.BUSY):  # a request's first byte (pipelined after BUSY)
                self.start_head()
            if self.phase == Phase.HEAD:  # never more than the head limit fed before the head is complete
                room = self.limits.max_header_bytes - self.head_bytes
                if room <= 0:
                    self.front.events["header_too_large"] += 1
                    limit = self.limits.max_header_bytes
                    self.refuse(431, f"the request's head is over the {limit:,}-byte limit")
                    return
                piece = view[:room]
                self.head_bytes += len(piece)
            else:
                piece = view
            view = view[len(piece) :]
            if not self.feed(piece) or self.phase == Phase.CLOSING:
                return

    def feed(self, piece: memoryview) -> bool:
        """Parses `piece`; False when the request was refused (nothing more of the connection is parsed)."""
        try:
            self.parser.feed_data(piece)
        except httptools.HttpParserCallbackError as error:
            if isinstance(error.__context__, UrlTooLong):
                self.front.events["url_too_long"] += 1
                self.refuse(414, f"the request's URL is over the {self.limits.max_url_bytes:,}-byte limit")
            else:
                self.refuse(400, "invalid HTTP request")
            return False
        except httptools.HttpParserError:
            self.refuse(400, "invalid HTTP request")
            return False
        except httptools.HttpParserUpgrade:  # the gateway serves no upgrades: the request was answered as plain HTTP
            self._unsupported_upgrade_warning()
            return False
        return True

    def start_head(self) -> None:
        self.front.wakes(self)
        self.phase = Phase.HEAD
        self.head_bytes = 0
        self.arm(self.limits.header_timeout_s, self.head_expired)

    def head_expired(self) -> None:
        if self.phase == Phase.HEAD:
            self.front.events["header_timeout"] += 1
            self.refuse(408, f"the request's head did not arrive within {self.limits.header_timeout_s:g} s")

    def refuse(self, status: int, message: str) -> None:
        """Answers `status` on the protocol's own (no request reached the app, or the one that did has answered),
        then drops what the client still sends for a moment before closing, so it can read the answer rather than a
        reset."""
        self.phase = Phase.CLOSING
        self.cancel_timer()
        self.front.wakes(self)
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:  # an earlier request's answer is under way
            self.transport.close()
            return
        self.transport.write(response_bytes(status, message))
        self.linger()

    def linger(self) -> None:
        """Ends the connection after its last answer: the answer and then end-of-stream go out, and what the client
        still sends is dropped for DRAIN_S (at most DRAIN_BYTES) before the connection is closed. Closing at once
        with unread bytes would reset the connection, and a reset can discard the answer before the client reads
        it."""
        self.phase = Phase.CLOSING
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.arm(DRAIN_S, self.close)
        else:
            self.close()

    def drain(self, n: int) -> None:
        self.drained += n
        if self.drained > DRAIN_BYTES:
            self.close()

    # --- parser callbacks ----------------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.phase != Phase.HEAD:  # pipelined in bytes fed as a body's
            self.start_head()
        self.clock = BodyClock()
        self.scope["extensions"] = {FRONT_EXTENSION: self.clock}  # type: ignore[typeddict-unknown-key]

    def on_url(self, url: bytes) -> None:
        if len(self.url) + len(url) > self.limits.max_url_bytes:
            raise UrlTooLong
        super().on_url(url)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        now = self.loop.time()
        self.phase = Phase.BODY
        self.body_deadline, self.last_body = now + self.limits.body_timeout_s, now
        self.arm(min(self.limits.body_idle_timeout_s, self.limits.body_timeout_s), self.body_check)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self.last_body = self.loop.time()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self.phase != Phase.BODY:
            return
        self.phase = Phase.BUSY
        self.cancel_timer()
        if self.cycle.response_complete and self.cycle.keep_alive and not self.transport.is_closing():
            self.rest()  # answered before its body was whole (an early refusal): the connection is free again

    def on_response_complete(self) -> None:
        # uvicorn's, with this protocol's keep-alive deadline (`rest`) in place of its own, and only once the request
        # is read whole: a connection still receiving a refused request's body is not idle.
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        if self.phase == Phase.CLOSING:  # the 408 of a body past its deadline
            self.linger()
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        elif self.phase == Phase.BUSY:
            self.rest()

    # --- body deadlines ------------------------------------------------------------------------------------------

    def body_check(self) -> None:
        """The body's deadlines: a pause over body_idle_timeout_s, or over body_timeout_s in all. Time the app left
        the body unread (reading paused: its buffer is full, or a pipelined request waits) is not the client's."""
        if self.phase != Phase.BODY:
            return
        now, limits = self.loop.time(), self.limits
        if self.flow.read_paused:
            self.last_body = now
        if now >= self.body_deadline:
            self.body_expired(f"the request body did not arrive within {limits.body_timeout_s:g} s")
        elif now >= self.last_body + limits.body_idle_timeout_s:
            self.body_expired(f"the request body stopped arriving for {limits.body_idle_timeout_s:g} s")
        else:
            self.arm(min(self.last_body + limits.body_idle_timeout_s, self.body_deadline) - now, self.body_check)

    def body_expired(self, message: str) -> None:
        """The app's reader answers 408 with `message`, and the connection ends after it (`linger`); if the app has
        answered already, or does not within ANSWER_GRACE_S, the connection is closed."""
        self.front.events["body_timeout"] += 1
        cycle = self.cycle
        self.phase = Phase.CLOSING
        if cycle.response_started:
            self.close()
            return
        self.clock.expired = message
        cycle.message_event.set()
        self.arm(ANSWER_GRACE_S, self.close)


def response_bytes(status: int, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response with a JSON `{"detail": message}` body, closing the connection."""
    body = json.dumps({"detail": message}).encode()
    lines = [STATUS_LINE[status]]
    fields = {"content-type": "application/json", "content-length": str(len(body)), "connection": "close"}
    for name, value in {**fields, **(headers or {})}.items():
        lines.append(f"{name}: {value}\r\n".encode())
    return b"".join([*lines, b"\r\n", body])
