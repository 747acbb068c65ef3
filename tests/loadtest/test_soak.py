"""The soak driver (loadtest/soak.py) run for real, briefly, against tritonserver and the gateway on the tiny
checkpoint: good, hostile and abandoned requests through both doors, the server's memory watched, and its outputs
checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kev_backend.serve.supervisor.procs import descendant_named
from tests.conftest import REPO, TritonServer, start_gateway, stop_gateway

MEMORY = ("gpu_memory_mb", "stub_rss_mb", "tritonserver_rss_mb", "bank_bytes", "graphs", "graph_bytes")
GROWTH = (*MEMORY, "tokenizer_cache_bytes", "torch_reserved_bytes", "torch_allocated_bytes")
SAMPLE_KEYS = {
    "t_s",
    "time",
    "sent",
    "answered",
    "expected_errors",
    "unexpected_errors",
    "refused_overload",
    "disconnects",
    "p50_ms",
    "p99_ms",
    *GROWTH,
    "request_errors",
    "gateway_errors",
    "model_p50_ms",
    "model_p99_ms",
    "gateway_p99_ms",
    "stub_cpu_s",
    "host_busy_s",
    "host_cpu_s",
    "host_probe_ms",
    "tokens_computed",
    "requests_scored",
}


def tritonserver_pid(triton: TritonServer) -> int:
    """The tritonserver process: `triton.process` is the supervisor that runs it (kev-serve through serve.sh)."""
    pid = descendant_named(triton.process.pid, "tritonserver")
    assert pid is not None, f"no tritonserver below pid {triton.process.pid}"
    return pid


def test_soak_briefly(triton: TritonServer, tmp_path: Path) -> None:
    gateway = start_gateway(triton, tmp_path / "gateway.log")
    out = tmp_path / "soak"
    command = [
        str(Path(sys.prefix) / "bin" / "python"),
        str(REPO / "loadtest" / "soak.py"),
        "--triton-grpc",
        triton.grpc_url,
        "--gateway",
        gateway.url,
        "--metrics",
        f"http://{triton.metrics_url}/metrics",
        "--minutes",
        "0.4",
        "--rate",
        "8",
        "--shape",
        "short6",
        "--bad-share",
        "0.1",
        "--disconnect-share",
        "0.1",
        "--sample-seconds",
        "3",
        "--server-pid",
        str(tritonserver_pid(triton)),
        "--out",
        str(out),
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=REPO)
    finally:
        stop_gateway(gateway)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    record = json.loads((out / "soak.json").read_text())
    assert {"gpu", "date", "commit", "soak"} <= set(record) and record["date"].endswith("Z")
    soak = record["soak"]
    for key in ("minutes", "requests", "unexpected_errors", "expected_errors", "disconnects", "rate", "shape"):
        assert key in soak, key
    assert soak["minutes"] == 0.4 and soak["rate"] == 8.0 and soak["shape"] == "short6"
    assert soak["requests"] > 0 and soak["unexpected_errors"] == 0, soak["unexpected_examples"]
    assert soak["expected_errors"] > 0 and soak["disconnects"] > 0 and soak["answered"] > 0
    for part in ("growth", "start", "end", "max"):
        assert set(soak[part]) == set(GROWTH), part
    for figure in ("stub_rss_mb", "tritonserver_rss_mb"):
        assert soak["start"][figure] > 0 and soak["end"][figure] > 0 and soak["growth"][figure] is not None
    # ~24 s sampled every 3 s, plus the baseline before traffic and the last sample after the last answer
    samples = soak["samples"]
    assert len(samples) >= 8 and all(SAMPLE_KEYS <= set(s) for s in samples)
    assert [s["t_s"] for s in samples] == sorted(s["t_s"] for s in samples)
    assert samples[-1]["sent"] == soak["requests"] and samples[-1]["unexpected_errors"] == 0
    assert all(s["stub_rss_mb"] and s["tritonserver_rss_mb"] for s in samples)
    assert any(s["p50_ms"] is not None and s["p50_ms"] <= s["p99_ms"] for s in samples)
    # Triton counted the gRPC refusals the driver saw as expected (the gateway refuses its own before Triton)
    errors = samples[-1]["request_errors"]
    assert errors["invalid"] + errors["too_large"] > 0 and errors["internal"] == errors["engine_error"] == 0
    # Each period's latency from the servers' own histograms: the model's time per request sits below the clients'
    # p99, the gateway's p99 is there while traffic goes through it; the raw buckets are not kept.
    model = [s for s in samples if s["model_p99_ms"] is not None]
    assert model and all(0 < s["model_p50_ms"] <= s["model_p99_ms"] for s in model)
    assert any(s["gateway_p99_ms"] is not None for s in samples)
    assert not any("model_ms_buckets" in s or "gateway_s_buckets" in s for s in samples)
    assert {"p99_ms", "model_p99_ms", "gateway_p99_ms"} <= set(soak["latency_after_warmup"])
    # What the work cost, per window after the warm-up (one here, shorter than 10 minutes): the stub's CPU per request
    # and per computed token, the host's busy share beside it; the counters behind them only grow.
    for key in ("stub_cpu_s", "host_busy_s", "tokens_computed", "requests_scored"):
        values = [s[key] for s in samples]
        assert None not in values and values == sorted(values) and values[-1] > values[0], key
    (window,) = soak["windows"]
    assert window["answered"] > 0 and 0 < window["model_p50_ms"] <= window["model_p99_ms"]
    assert window["tokens_per_s"] > 0 and window["stub_cpu_ms_per_request"] > 0 and window["stub_cpu_s_per_ktoken"] > 0
    assert 0 < window["host_busy_share"] <= 1 and window["host_probe_ms"] > 0
    assert "stub_cpu_ms_per_request" in result.stdout
    assert (out / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "unexpected" in result.stdout and "tritonserver_rss_mb" in result.stdout


def test_period_quantiles_follow_prometheus_interpolation() -> None:
    """soak_report.period_quantile on two samples of cumulative buckets: the period's observations alone, linear
    within the bucket that holds the rank, the last finite bound for the +Inf bucket."""
    sys.path.insert(0, str(REPO / "loadtest"))
    from soak_report import period_quantile

    before = {"10": 5.0, "20": 5.0, "+Inf": 5.0}
    after = {"10": 5.0, "20": 15.0, "+Inf": 15.0}  # the period: 10 observations between 10 and 20
    assert period_quantile(before, after, 0.5) == 15.0 and period_quantile(before, after, 1.0) == 20.0
    assert period_quantile(None, {"10": 4.0, "+Inf": 4.0}, 0.5) == 5.0
    assert period_quantile(None, {"10": 0.0, "+Inf": 2.0}, 0.99) == 10.0
    assert period_quantile(after, after, 0.5) is None and period_quantile(None, None, 0.5) is None


def test_windows_split_the_run_after_its_warm_up() -> None:
    """soak_report.windows: 10-minute windows from the end of the warm-up (the last one shorter), each from its own
    samples: the model's p50 from the histogram's difference, the cost per request and token, the host's share."""
    sys.path.insert(0, str(REPO / "loadtest"))
    from soak_report import windows

    def sample(minute: int) -> dict:
        # from minute 15 on, each request costs twice the CPU (done: CPU work in 0.1 s units) and lands in the
        # higher bucket
        done = 60 * minute + 60 * max(0, minute - 15)
        return {
            "t_s": 60.0 * minute,
            "answered": 60 * minute,
            "requests_scored": 60 * minute,
            "tokens_computed": 6000 * minute,
            "stub_cpu_s": done / 10,
            "host_busy_s": 30.0 * minute,
            "host_cpu_s": 120.0 * minute,
            "host_probe_ms": 20.0 + (minute >= 25),
            "model_ms_buckets": {"10": 60.0 * min(minute, 15), "20": 60.0 * minute, "+Inf": 60.0 * minute},
        }

    found = windows([sample(m) for m in range(0, 31)], warmup_s=5 * 60)
    assert [(w["from_min"], w["to_min"]) for w in found] == [(5, 15), (15, 25), (25, 30)]
    assert [w["answered"] for w in found] == [600, 600, 300]
    assert [w["stub_cpu_ms_per_request"] for w in found] == [100, 200, 200]
    assert [w["model_p50_ms"] for w in found] == [5.0, 15.0, 15.0]
    assert all(w["tokens_per_s"] == 100 and w["host_busy_share"] == 0.25 for w in found)
    assert [w["host_probe_ms"] for w in found] == [20, 20, 21]  # each window's samples, its bounds included
    assert windows([sample(0)], warmup_s=0) == []
