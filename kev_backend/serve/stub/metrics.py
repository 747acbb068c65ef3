"""Prometheus metrics from the Python backend, on Triton's metrics port (next to its own `nv_inference_*`).

Triton counts a request answered with a per-request error as a success (`nv_inference_request_success`), so every
request not answered gets counted here by reason (ERROR_REASONS); the rest describes the engine: the state bank,
tokens and requests per batch, engine time per batch, and CUDA-graph use once the engine replays graphs; and each
answered request: its time in the model (from execute() to its response) and its tokens.

Triton 2.51 has no per-request latency histogram of its own: its queue and compute times are running totals
(`nv_inference_queue_duration_us`, `nv_inference_compute_infer_duration_us`: means, by rate over rate) and, with
`--metrics-config summary_latencies=true`, per-process quantiles that cannot be summed over pods. So the
distributions are histograms here and in the gateway (docs/operations.md, "Metrics").

kev-serve's own state (restarts by cause, readiness) reaches Prometheus here too (SupervisorMetrics): kev-serve
writes it to a small file beside the stubs' heartbeats, and one stub publishes it on Triton's metrics port, the port
Prometheus already scrapes on every Triton pod.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]
TOKEN_BUCKETS = [64, 256, 1024, 4096, 16384, 65536, 262144]
MS_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000]
# A request's time in the model: from 1 ms to the minute a long request may take on a busy server.
REQUEST_MS_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000]
# Why a request got no answer: refused with Kev's message (invalid), refused for its size before parsing (too_large),
# cancelled by its client before scoring, a fault while preparing or answering it (internal), or its batch's engine
# fault (engine_error).
ERROR_REASONS = ("invalid", "too_large", "cancelled", "internal", "engine_error")


class KevMetrics:
    """Metric families registered once per model instance; `record(engine)` after every batch."""

    def __init__(self, pb_utils: Any, labels: dict[str, str]) -> None:
        family = pb_utils.MetricFamily
        self._families = []  # keep the families alive as long as their metrics

        def metric(name: str, kind: Any, description: str, buckets: list[float] | None = None):
            fam = family(name=name, description=description, kind=kind)
            self._families.append(fam)
            return fam.Metric(labels=labels, buckets=buckets) if buckets else fam.Metric(labels=labels)

        counter, gauge, histogram = family.COUNTER, family.GAUGE, family.HISTOGRAM
        errors = family(name="kev_request_errors_total", description="requests not answered, by reason", kind=counter)
        self._families.append(errors)
        self.request_errors = {reason: errors.Metric(labels={**labels, "reason": reason}) for reason in ERROR_REASONS}
        keys = family(
            name="kev_state_keys_total",
            description="requests' states that came with a routing key (x-kev-state-key), by whether it is theirs",
            kind=counter,
        )
        self._families.append(keys)
        self.state_keys = {m: keys.Metric(labels={**labels, "matches": m}) for m in ("yes", "no")}
        self.bank_hits = metric("kev_bank_hits_total", counter, "states found in the state bank")
        self.bank_misses = metric("kev_bank_misses_total", counter, "states computed (not in the bank)")
        self.bank_evictions = metric("kev_bank_evictions_total", counter, "states evicted from the bank")
        self.prefix_hits = metric(
            "kev_bank_prefix_hits_total", counter, "states computed from a banked state they continue (growing states)"
        )
        self.tokens_reused = metric(
            "kev_bank_tokens_reused_total", counter, "state tokens not computed: held by the banked state continued"
        )
        self.tokens_computed = metric("kev_bank_tokens_computed_total", counter, "state tokens computed")
        self.bank_bytes = metric("kev_bank_bytes", gauge, "bytes held by states in the bank")
        self.bank_entries = metric("kev_bank_entries", gauge, "states held in the bank")
        self.graph_hits = metric("kev_graph_replays_total", counter, "passes replayed from a CUDA graph")
        self.graph_captures = metric("kev_graph_captures_total", counter, "CUDA graphs captured")
        self.graph_failures = metric(
            "kev_graph_capture_failures_total", counter, "CUDA graph captures that failed (their passes run eagerly)"
        )
        self.oom_retries = metric(
            "kev_oom_retries_total", counter, "passes retried in parts after the GPU ran out of memory"
        )
        self.graphs = metric("kev_graphs", gauge, "CUDA graphs held")
        self.graph_bytes = metric("kev_graph_bytes", gauge, "GPU memory reserved while capturing the graphs")
        self.batch_requests = metric("kev_batch_requests", histogram, "requests per engine call", BATCH_BUCKETS)
        self.state_tokens = metric(
            "kev_batch_state_tokens", histogram, "distinct state tokens per batch", TOKEN_BUCKETS
        )
        self.row_tokens = metric("kev_batch_row_tokens", histogram, "question-row tokens per batch", TOKEN_BUCKETS)
        self.tokenized_chars = metric(
            "kev_tokenized_chars_total", counter, "characters of request text run through the tokenizer"
        )
        self.tokenizer_cache_bytes = metric(
            "kev_tokenizer_cache_bytes", gauge, "bytes held by the tokenizer's cache of accepted texts"
        )
        self.gpu_reserved = metric(
            "kev_gpu_reserved_bytes", gauge, "GPU memory torch's caching allocator holds (0 on a CPU)"
        )
        self.gpu_allocated = metric("kev_gpu_allocated_bytes", gauge, "GPU memory in torch tensors (0 on a CPU)")
        self.engine_ms = metric("kev_engine_ms", histogram, "engine model time per batch (ms)", MS_BUCKETS)
        self.request_ms = metric(
            "kev_request_ms",
            histogram,
            "answered requests' time in the model, from execute() to the response sent (ms): the wait behind other"
            " batches in the stub's pipeline and the batch's engine time; Triton's queue before it is not in it",
            REQUEST_MS_BUCKETS,
        )
        self.request_tokens = metric(
            "kev_request_tokens",
            histogram,
            "tokens per scored request body (its state and question rows)",
            TOKEN_BUCKETS,
        )
        self._seen: dict[str, int] = {}  # the engine's running totals at the last record, per counter
        self._gauges: dict[int, float] = {}  # each gauge's value as last set

    def count_error(self, reason: str, n: int = 1) -> None:
        if n:
            self.request_errors[reason].increment(n)

    def count_state_key(self, matches: bool) -> None:
        """One state whose request carried a routing key: a key that is not the state's sends its state to a
        replica that may not bank it (a client hashing something else, or a proxy rewriting the header)."""
        self.state_keys["yes" if matches else "no"].increment(1)

    def record_requests(self, answered_ms: list[float | None], tokens: list[int]) -> None:
        """After a batch's answers are sent: each answered request's time in the model (None: not answered) and each
        scored body's tokens."""
        for ms in answered_ms:
            if ms is not None:
                self.request_ms.observe(ms)
        for n in tokens:
            self.request_tokens.observe(n)

    def record(self, engine: Any, batch: Any = None) -> None:
        """After a batch: its report (BatchReport; default the engine's last) and the engine's running totals."""
        batch = batch or engine.last_batch
        self.batch_requests.observe(batch.requests)
        if batch.requests > batch.errors:
            self.state_tokens.observe(batch.state_tokens)
            self.row_tokens.observe(batch.row_tokens)
            self.engine_ms.observe(batch.model_ms)
        stats = engine.bank_stats
        scoring = engine.scorer.stats()
        totals = {
            "hits": stats.hits,
            "misses": stats.misses,
            "evictions": stats.evictions,
            "prefix_hits": stats.prefix_hits,
            "tokens_reused": stats.tokens_reused,
            "tokens_computed": stats.tokens_computed,
            "graph_replays": scoring.graph_replays,
            "graph_captures": scoring.graph_captures,
            "graph_failures": scoring.graph_capture_failures,
            "tokenized_chars": engine.tokenizer.tokenized_chars,
            "oom_retries": scoring.oom_retries,
        }
        counters = {
            "hits": self.bank_hits,
            "misses": self.bank_misses,
            "evictions": self.bank_evictions,
            "prefix_hits": self.prefix_hits,
            "tokens_reused": self.tokens_reused,
            "tokens_computed": self.tokens_computed,
            "graph_replays": self.graph_hits,
            "graph_captures": self.graph_captures,
            "graph_failures": self.graph_failures,
            "tokenized_chars": self.tokenized_chars,
            "oom_retries": self.oom_retries,
        }
        for key, total in totals.items():
            if total > self._seen.get(key, 0):
                counters[key].increment(total - self._seen.get(key, 0))
            self._seen[key] = total
        gauges = [
            (self.bank_bytes, stats.bytes),
            (self.bank_entries, stats.entries),
            (self.tokenizer_cache_bytes, engine.tokenizer.cache.bytes),
            (self.graphs, scoring.graphs or 0),
            (self.graph_bytes, scoring.graph_bytes),
        ]
        if engine.device.type == "cuda":
            import torch  # here, not at the top: kev-serve imports this module's supervisor state without torch

            gauges += [
                (self.gpu_reserved, torch.cuda.memory_reserved(engine.device)),
                (self.gpu_allocated, torch.cuda.memory_allocated(engine.device)),
            ]
        for gauge, value in gauges:  # each set is a round trip to Triton's side of the backend: only the changes
            if self._gauges.get(id(gauge)) != value:
                gauge.set(value)
                self._gauges[id(gauge)] = value


# kev-serve's restarts, by process and cause (every pair from 0, so a rate is defined before the first restart).
RESTART_CAUSES = {
    "triton": (
        "exited",  # tritonserver exited
        "stub_died",  # a Python backend stub died (Triton 2.51 never restarts one)
        "engine_broken",  # a model instance reported its engine broken (a CUDA error)
        "hung",  # a model instance held jobs without progress for KEV_PROGRESS_TIMEOUT_S
        "probe_unhealthy",  # the probe was answered "stub not healthy"
        "probe_failed",  # KEV_PROBE_FAILURES probes failed while the model made no progress
        "start_timeout",  # not ready within KEV_START_TIMEOUT_S
    ),
    "gateway": ("exited",),  # the gateway kev-serve runs beside Triton exited
}
SUPERVISOR_POLL_S = 2.0  # how often the publishing stub reads kev-serve's state


def supervisor_state_path(heartbeat_prefix: str) -> Path:
    """kev-serve's state for a start: beside the start's heartbeats (`{region prefix}heartbeat_<instance>`), as
    `{region prefix}supervisor.json`, so it is removed with the start's other regions and no heartbeat reader takes
    it for one."""
    return Path(f"{heartbeat_prefix.removesuffix('heartbeat_')}supervisor.json")


def read_supervisor_state(path: Path) -> dict[str, Any] | None:
    """{"ready": bool, "restarts": {process: {cause: n}}}, or None while there is none (or it is being replaced)."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


class SupervisorMetrics:
    """Publishes kev-serve's state on Triton's metrics port: `kev_serve_restarts_total{process,cause}` and
    `kev_serve_ready`. One stub per start publishes (the first to claim the state file's `.publisher`), so series
    are not repeated by every model instance. Its counters start at kev-serve's totals, which survive Triton's
    restarts: the series continues across them (a restart that Prometheus did not see during the outage is counted
    once the new Triton serves). Without kev-serve (tritonserver started by hand) nothing is published."""

    def __init__(self, pb_utils: Any, heartbeat_prefix: str | None) -> None:
        self.pb_utils = pb_utils
        self.path = supervisor_state_path(heartbeat_prefix) if heartbeat_prefix else None
        self.families: list[Any] = []
        self.restarts: dict[tuple[str, str], Any] = {}
        self.ready: Any = None
        self.seen: dict[tuple[str, str], int] = {}
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        if self.path is not None and self.claim():
            self.thread = threading.Thread(target=self.run, name="kev-supervisor-metrics", daemon=True)
            self.thread.start()

    def claim(self) -> bool:
        assert self.path is not None
        try:
            os.close(os.open(f"{self.path}.publisher", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            return False  # another instance of this start publishes
        except OSError:
            return False  # no shared memory to claim in: nothing to publish either
        return True

    def run(self) -> None:
        while True:
            try:
                self.publish()
            except Exception as error:  # noqa: BLE001 - publishing must never take the stub down
                self.pb_utils.Logger.log_warn(f"kev: kev-serve's state not published: {error!r}")
            if self.stopped.wait(SUPERVISOR_POLL_S):
                return

    def publish(self) -> None:
        assert self.path is not None
        if (state := read_supervisor_state(self.path)) is None:
            return
        if self.ready is None:
            self.register()
        restarts = state.get("restarts", {})
        for (process, cause), counter in self.restarts.items():
            total = int(restarts.get(process, {}).get(cause, 0))
            if total > self.seen.get((process, cause), 0):
                counter.increment(total - self.seen.get((process, cause), 0))
            self.seen[process, cause] = total
        self.ready.set(1 if state.get("ready") else 0)

    def register(self) -> None:
        family = self.pb_utils.MetricFamily
        restarts = family(
            name="kev_serve_restarts_total",
            description="kev-serve's restarts of the processes it runs, by process and cause",
            kind=family.COUNTER,
        )
        ready = family(
            name="kev_serve_ready",
            description="1 while kev-serve finds Triton ready and its last probe answered, else 0",
            kind=family.GAUGE,
        )
        self.families = [restarts, ready]
        self.restarts = {
            (process, cause): restarts.Metric(labels={"process": process, "cause": cause})
            for process, causes in RESTART_CAUSES.items()
            for cause in causes
        }
        self.ready = ready.Metric(labels={})

    def close(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join(timeout=SUPERVISOR_POLL_S + 1)
