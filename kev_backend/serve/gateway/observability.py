"""What the gateway tells about itself and the model: its metrics for GET /metrics (prometheus_client, aggregated over
uvicorn's workers when there are several), the serving statistics GET /v1/models reports from Triton's metrics port,
the readiness probe behind GET /ready, and a value fetched at most so often, one fetch at a time."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from ..client import prometheus
from ..version import version
from . import front
from .replies import REASONS

if TYPE_CHECKING:
    from .service import Gateway

READY_FRESH_S = 2.0  # /ready is 200 while the last successful probe is at most this old
READY_INTERVAL_S = 1.0  # at most one probe a second, however often /ready is asked
READY_TIMEOUT_S = 2.0  # a probe slower than this could not be fresh anyway
log = logging.getLogger("kev_backend.serve.gateway")  # the gateway's one logger, whichever module logs

# kev_gateway_request_duration_seconds: from 1 ms (a refusal, /health) to 60 s, about 2.5x apart, so a quantile read
# from them is off by at most that step. Slower requests (up to KEV_GATEWAY_TIMEOUT_S, 120 s by default) fall in
# +Inf: a p99 past a minute is an outage whose exact length the histogram need not resolve.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# With several workers each one copies its gauges (in flight, arriving, connections) into the shared files this
# often; the worker that answers a scrape copies its own first. Counters and the histogram are written as they move.
SYNC_INTERVAL_S = 1.0
# prometheus_client's files for a worker's live gauges: gauge_live<mode>_<pid>.db (multiprocess mode).
LIVE_GAUGE_FILE = re.compile(r"gauge_live\w+_(\d+)\.db")


def multiprocess_mode() -> bool:
    """Whether this process's metrics live in prometheus_client's shared files (PROMETHEUS_MULTIPROC_DIR, which
    `kev-gateway --workers N` sets for its workers). prometheus_client decides once, when it is imported: its value
    class says what it decided, which is what matters here, whatever the environment says now."""
    return values.ValueClass is not values.MutexValue


class Metrics:
    """The gateway's metrics, with prometheus_client. One process (the default, and every in-process app): a registry
    of this gateway's own. Several uvicorn workers (kev-gateway --workers N): prometheus_client's multiprocess mode,
    each worker writing its values into files of the per-start directory kev-gateway makes, and whichever worker
    answers a scrape reading every worker's: counters and the histogram summed over every worker that ever ran this
    start (a restarted worker's counts are kept, so totals never go back), gauges summed over the live ones."""

    def __init__(self) -> None:
        self.multiprocess = multiprocess_mode()
        self.registry = CollectorRegistry()
        if self.multiprocess:
            WorkersCollector(self.registry)  # reads the directory prometheus_client was imported with
        own = None if self.multiprocess else self.registry  # multiprocess: the values go to the files only
        self.requests = Counter(
            "kev_gateway_requests_total",
            "HTTP requests answered, by route (the path, or other) and status.",
            ["route", "status"],
            registry=own,
        )
        self.duration = Histogram(
            "kev_gateway_request_duration_seconds",
            "Time from a request's arrival to the end of its response, by route (the path, or other) and status.",
            ["route", "status"],
            buckets=DURATION_BUCKETS,
            registry=own,
        )
        self.errors = Counter(
            "kev_gateway_errors_total", "Requests refused or failed, by reason.", ["reason"], registry=own
        )
        for reason in REASONS:  # every reason from 0, so a rate is defined before the first error
            self.errors.labels(reason)

        def gauge(name: str, description: str) -> Gauge:
            return Gauge(name, description, registry=own, multiprocess_mode="livesum")

        self.in_flight = gauge("kev_gateway_in_flight", "Admission slots held (one per Triton question under way).")
        self.arriving = gauge(
            "kev_gateway_arriving", "Requests whose body is being read or parsed, before their admission."
        )
        self.arriving_bytes = gauge("kev_gateway_arriving_bytes", "Body bytes held by requests not yet admitted.")
        # The front's, made at the first sync that finds one: an app served by another server (a test client) has no
        # front, and reports no connections rather than zero.
        self.connections: Gauge | None = None
        self.connection_events: Counter | None = None
        self.events_seen: dict[str, int] = {}
        # What this gateway is (the backend's own kev_build_info, on Triton's metrics port, names the model's side).
        self.build_info = Gauge(
            "kev_gateway_build_info", "This gateway's version (value 1).", ["version"], registry=own,
            multiprocess_mode="max",
        )  # fmt: skip
        self.build_info.labels(version()).set(1)

    def request(self, route: str, status: int, seconds: float | None = None) -> None:
        self.requests.labels(route, str(status)).inc()
        if seconds is not None:
            self.duration.labels(route, str(status)).observe(seconds)

    def error(self, reason: str) -> None:
        assert reason in REASONS, reason
        self.errors.labels(reason).inc()

    def sync(self, gateway: Gateway) -> None:
        """Copies the gateway's and its front's current values (plain attributes, changed as requests come and go)
        into the metrics."""
        self.in_flight.set(gateway.in_flight)
        self.arriving.set(gateway.arriving)
        self.arriving_bytes.set(gateway.arriving_bytes)
        if (connections := front.current()) is None:
            return
        if self.connections is None or self.connection_events is None:
            own = None if self.multiprocess else self.registry
            self.connections = Gauge(
                "kev_gateway_connections", "Client connections open.", registry=own, multiprocess_mode="livesum"
            )
            self.connection_events = Counter(
                "kev_gateway_connection_events_total",
                "Connections refused, closed or answered by the front.",
                ["event"],
                registry=own,
            )
        self.connections.set(connections.open)
        for event in front.EVENTS:  # the front counts on; the counter takes what it counted since the last sync
            total = connections.events[event]
            self.connection_events.labels(event).inc(max(0, total - self.events_seen.get(event, 0)))
            self.events_seen[event] = total

    def render(self, gateway: Gateway) -> str:
        self.sync(gateway)
        return exposition(self.registry)

    async def keep_synced(self, gateway: Gateway) -> None:
        """With several workers: copies this worker's gauges into the shared files every SYNC_INTERVAL_S (a scrape
        answered by another worker reads them there), until cancelled."""
        while True:
            self.sync(gateway)
            await asyncio.sleep(SYNC_INTERVAL_S)

    def close(self) -> None:
        """A worker stopping: its live gauges leave the sums."""
        if self.multiprocess:
            mark_process_dead(os.getpid())


class WorkersCollector(MultiProcessCollector):
    """prometheus_client's collector of every worker's files, which first drops the live gauges of workers no longer
    running (a killed one cannot drop its own; its in-flight requests are gone with it). Their counters stay: they
    are what the service answered."""

    def collect(self) -> Iterator[Metric]:
        for file in Path(self._path).glob("gauge_live*_*.db"):
            if (match := LIVE_GAUGE_FILE.fullmatch(file.name)) and not process_running(int(match[1])):
                mark_process_dead(int(match[1]), self._path)
        return super().collect()


def process_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: running
        return True
    return True


def exposition(registry: CollectorRegistry) -> str:
    """Prometheus' text format (0.0.4) of what `registry` collects, as prometheus_client's generate_latest writes it
    but for two things: whole values are written as integers (`1`, not `1.0`: what this gateway always wrote, and
    what readers of its text compare), and no `_created` series (a per-process start time that means nothing summed
    over workers)."""
    lines = []
    for family in registry.collect():
        name = f"{family.name}_total" if family.type == "counter" else family.name
        help_text = family.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {family.type}"]
        for sample in sorted(family.samples, key=sample_order):
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f'{key}="{label(value)}"' for key, value in sample.labels.items())
            lines.append(
                f"{sample.name}{{{labels}}} {number(sample.value)}"
                if labels
                else f"{sample.name} {number(sample.value)}"
            )
    return "\n".join(lines) + "\n"


def sample_order(sample: Sample) -> tuple[str, list[tuple[str, str]], float]:
    """Series in a stable order (the files of several workers come in any order); a histogram's buckets by bound."""
    le = sample.labels.get("le")
    bound = math.inf if le in (None, "+Inf") else float(le)
    return sample.name, sorted((k, v) for k, v in sample.labels.items() if k != "le"), bound


def number(value: float) -> str:
    if math.isfinite(value) and value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return floatToGoString(value)


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


def serving_statistics(
    metrics_url: str, model: str, timeout_s: float = 2.0
) -> tuple[dict[str, float | int] | None, list[dict[str, str]]]:
    """Kev's serving statistics from Triton's metrics port, and what answers (each model instance's kev_build_info
    labels but model and instance); (None, []) when it does not answer (the cards still do)."""
    try:
        with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=timeout_s) as reply:
            samples = prometheus.parse(reply.read().decode())
    except OSError:
        return None, []
    found = {key: prometheus.total(samples, metric, model=model) for key, metric in SERVING_METRICS.items()}
    serving = {key: int(value) if float(value).is_integer() else value for key, value in found.items()}
    answering = [
        {key: value for key, value in labels.items() if key not in ("model", "instance")}
        for name, labels, value in samples
        if name == "kev_build_info" and labels.get("model") == model and value == 1
    ]
    unique = [dict(fields) for fields in dict.fromkeys(tuple(sorted(a.items())) for a in answering)]
    return serving, unique


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
