"""The server's figures as a soak run (loadtest/soak.py) reads them from outside, every sample: the processes' memory
(/proc), the GPUs' (nvidia-smi), and Triton's and the gateway's metrics."""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kev_backend.dev.provenance import nvidia_smi
from kev_backend.serve.client.prometheus import parse as parse_prometheus
from kev_backend.serve.supervisor.procs import CLOCK_TICKS, STUB_COMM, children, stat_fields, used_seconds

METRICS_TIMEOUT_S = 5.0
# The backend's counters of work done, by the name they get here (summed over model instances): a period's cost per
# token is the stubs' CPU seconds over the state tokens computed, which tells a server whose work got dearer from a
# host that got busier.
COUNTERS = {"tokens_computed": "kev_bank_tokens_computed_total", "requests_scored": "kev_request_ms_count"}
# The backend's gauges watched, by the name they get here, and Triton's metrics name (summed over model instances).
GAUGES = {
    "bank_bytes": "kev_bank_bytes",
    "graphs": "kev_graphs",
    "graph_bytes": "kev_graph_bytes",
    "tokenizer_cache_bytes": "kev_tokenizer_cache_bytes",
    "torch_reserved_bytes": "kev_gpu_reserved_bytes",
    "torch_allocated_bytes": "kev_gpu_allocated_bytes",
}


def proc_status_kb(pid: int, key: str) -> int | None:
    """A `kB` field of /proc/PID/status (VmRSS), or None when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_mb(pids: list[int]) -> float | None:
    """The summed VmRSS of `pids` in MiB; None when none could be read."""
    values = [kb for pid in pids if (kb := proc_status_kb(pid, "VmRSS")) is not None]
    return round(sum(values) / 1024, 1) if values else None


def cpu_seconds(pids: list[int]) -> float | None:
    """The CPU seconds (user and system) `pids` have used so far, summed; None when none could be read."""
    values = []
    for pid in pids:
        if (stat := stat_fields(pid)) is not None:
            values.append(used_seconds(stat[1]))
    return round(sum(values), 2) if values else None


def host_cpu_seconds() -> tuple[float, float] | None:
    """The host's CPU seconds so far over all its cores, (busy, all), from /proc/stat: all less idle and iowait. A
    period's busy share (the difference of busy over that of all) counts the server's processes and whatever else
    ran beside them: set beside the stub's own CPU, it shows what else took the cores."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    every = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is within user)
    return (every - fields[3] - fields[4]) / CLOCK_TICKS, every / CLOCK_TICKS


PROBE_STEPS = 300_000  # ~25 ms of one core on a 2-core CPU machine


def host_probe_ms() -> float:
    """The CPU milliseconds this thread takes for a fixed piece of pure-Python work: the same work each sample, so it
    moves only with the host's cores (their clock, a neighbour sharing them) and tells a slower host from a server
    whose own work got dearer. Best of three, so the server's preempting it counts less (thread time excludes waits,
    but not the caches it leaves cold)."""
    times = []
    for _ in range(3):
        started, total = time.thread_time(), 0
        for i in range(PROBE_STEPS):
            total += i * i % 7
        times.append(time.thread_time() - started)
    return round(1000 * min(times), 3)


def gpu_memory_mb() -> float | None:
    """Memory used on all GPUs together (MiB), or None without a GPU."""
    try:
        values = [float(v) for v in nvidia_smi("memory.used")]
    except ValueError:  # "[N/A]" on some virtual GPUs
        return None
    return sum(values) if values else None


def gauge_sums(
    samples: list[tuple[str, dict[str, str], float]], names: dict[str, str] = GAUGES
) -> dict[str, float | None]:
    """Each of `names` (GAUGES, or COUNTERS) summed over the model's instances; None when Triton does not report it."""
    sums: dict[str, float | None] = {}
    for key, name in names.items():
        values = [value for sample, _, value in samples if sample == name]
        sums[key] = sum(values) if values else None
    return sums


def sums_by_reason(samples: list[tuple[str, dict[str, str], float]], name: str) -> dict[str, float]:
    """A counter family summed over everything but its `reason` label."""
    sums: dict[str, float] = {}
    for sample, labels, value in samples:
        if sample == name:
            reason = labels.get("reason", "")
            sums[reason] = sums.get(reason, 0.0) + value
    return sums


# Loopback only: no proxy from the environment may carry the metrics requests elsewhere.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fetch_text(url: str) -> str | None:
    try:
        with OPENER.open(url, timeout=METRICS_TIMEOUT_S) as response:
            return response.read().decode(errors="replace")
    except OSError:
        return None


# The servers' own latency histograms (their buckets, cumulative, summed over labels): the model's time per request
# (ms) and the gateway's arrival-to-response (s). A sample holds their counts; soak_report takes each period's
# quantiles from the difference between two samples.
HISTOGRAMS = {"model_ms": "kev_request_ms_bucket", "gateway_s": "kev_gateway_request_duration_seconds_bucket"}


def buckets(samples: list[tuple[str, dict[str, str], float]], name: str) -> dict[str, float]:
    """A histogram's cumulative count by upper bound ("le", as written), summed over its other labels."""
    found: dict[str, float] = {}
    for sample, labels, value in samples:
        if sample == name:
            found[labels["le"]] = found.get(labels["le"], 0.0) + value
    return found


@dataclass(frozen=True)
class Watch:
    """Where the server's figures come from: its process (optional), Triton's metrics and the gateway's."""

    server_pid: int | None
    metrics_url: str
    gateway_metrics_url: str | None

    def read(self) -> dict[str, Any]:
        """Blocking (files, a subprocess, HTTP): run it off the event loop."""
        figures: dict[str, Any] = {
            "gpu_memory_mb": gpu_memory_mb(),
            "tritonserver_rss_mb": None,
            "stub_rss_mb": None,
            "stub_cpu_s": None,
            "host_busy_s": None,
            "host_cpu_s": None,
            "host_probe_ms": None,
            "gateway_errors": None,
        }
        if self.server_pid is not None:  # the server on this host: its processes, and the host beside them
            figures["tritonserver_rss_mb"] = rss_mb([self.server_pid])
            stubs = [pid for pid, comm in children(self.server_pid).items() if comm == STUB_COMM]
            figures["stub_rss_mb"] = rss_mb(stubs)
            figures["stub_cpu_s"] = cpu_seconds(stubs)
            if (host := host_cpu_seconds()) is not None:
                figures["host_busy_s"], figures["host_cpu_s"] = host
            figures["host_probe_ms"] = host_probe_ms()
        text = fetch_text(self.metrics_url)
        samples = parse_prometheus(text) if text is not None else []
        figures.update(gauge_sums(samples))
        figures.update(gauge_sums(samples, COUNTERS))
        figures["request_errors"] = sums_by_reason(samples, "kev_request_errors_total") if text is not None else None
        figures["model_ms_buckets"] = buckets(samples, HISTOGRAMS["model_ms"]) if text is not None else None
        figures["gateway_s_buckets"] = None
        if self.gateway_metrics_url is not None:  # the gateway's own refusals (client_disconnected, internal, ...)
            text = fetch_text(self.gateway_metrics_url)
            gateway = parse_prometheus(text) if text is not None else []
            errors = sums_by_reason(gateway, "kev_gateway_errors_total") if text is not None else None
            figures["gateway_errors"] = None if errors is None else {k: v for k, v in errors.items() if v}
            figures["gateway_s_buckets"] = buckets(gateway, HISTOGRAMS["gateway_s"]) if text is not None else None
        return figures
