"""What the gateway tells about itself and the model: its Prometheus text for GET /metrics (no client library), the
serving statistics GET /v1/models reports from Triton's metrics port, the readiness probe behind GET /ready, and a
value fetched at most so often, one fetch at a time."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..client import prometheus
from . import front
from .replies import REASONS

if TYPE_CHECKING:
    from .service import Gateway

READY_FRESH_S = 2.0  # /ready is 200 while the last successful probe is at most this old
READY_INTERVAL_S = 1.0  # at most one probe a second, however often /ready is asked
READY_TIMEOUT_S = 2.0  # a probe slower than this could not be fresh anyway
log = logging.getLogger("kev_backend.serve.gateway")  # the gateway's one logger, whichever module logs


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
