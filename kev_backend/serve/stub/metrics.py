"""Prometheus metrics from the Python backend, on Triton's metrics port (next to its own `nv_inference_*`).

Triton counts a request answered with a per-request error as a success (`nv_inference_request_success`), so every
request not answered gets counted here by reason (ERROR_REASONS); the rest describes the engine: the state bank,
tokens and requests per batch, engine time per batch, and CUDA-graph use once the engine replays graphs.
"""

from __future__ import annotations

from typing import Any

import torch

BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]
TOKEN_BUCKETS = [64, 256, 1024, 4096, 16384, 65536, 262144]
MS_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000]
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
        self._seen: dict[str, int] = {}  # the engine's running totals at the last record, per counter
        self._gauges: dict[int, float] = {}  # each gauge's value as last set

    def count_error(self, reason: str, n: int = 1) -> None:
        if n:
            self.request_errors[reason].increment(n)

    def count_state_key(self, matches: bool) -> None:
        """One state whose request carried a routing key: a key that is not the state's sends its state to a
        replica that may not bank it (a client hashing something else, or a proxy rewriting the header)."""
        self.state_keys["yes" if matches else "no"].increment(1)

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
            gauges += [
                (self.gpu_reserved, torch.cuda.memory_reserved(engine.device)),
                (self.gpu_allocated, torch.cuda.memory_allocated(engine.device)),
            ]
        for gauge, value in gauges:  # each set is a round trip to Triton's side of the backend: only the changes
            if self._gauges.get(id(gauge)) != value:
                gauge.set(value)
                self._gauges[id(gauge)] = value
