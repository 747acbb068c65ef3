"""loadtest/simulate.py on small synthetic curves (no committed results read): one replica below and above its
capacity, the queue bound, the HPA's reaction to a burst, scale from zero, determinism."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "loadtest"))

from simulate import Autoscaler, ServiceModel, Traffic, simulate  # noqa: E402

# A replica that serves 100 req/s alone (10 ms a request) and 200 req/s at 8 or more in flight.
MODEL = ServiceModel(concurrency=(1.0, 8.0), short_rps=(100.0, 200.0), long_rps=(10.0, 20.0), max_in_system=64)
FIXED = Autoscaler(kind="none", min_replicas=1)


def answered_p50(result: object) -> float:
    windows = [w for w in result.windows if w["p50_ms"] is not None and w["t_s"] >= 10]
    return sorted(w["p50_ms"] for w in windows)[len(windows) // 2]


def test_below_capacity_latency_is_near_the_measured_one_and_nothing_is_refused() -> None:
    result = simulate(MODEL, Traffic(base=20.0, duration=60.0), FIXED, seed=1)
    assert result.summary["refused"] == 0
    assert result.summary["answered"] == result.summary["sent"] > 1000
    assert 10.0 <= answered_p50(result) <= 15.0  # alone: 10 ms; at 10 % load little queueing
    assert result.summary["p99_ms"] < 60.0


def test_above_capacity_the_queue_grows_and_past_its_bound_requests_are_refused() -> None:
    result = simulate(MODEL, Traffic(base=300.0, duration=60.0), FIXED, seed=1)
    p99 = [w["p99_ms"] for w in result.windows if w["p99_ms"] is not None]
    assert p99[2] > 3 * p99[0] or p99[0] > 200.0  # the queue fills in the first seconds
    assert result.summary["refused_share"] == pytest.approx(1 / 3, abs=0.05)  # 300 offered, 200 served
    answered_rate = result.summary["answered"] / 60.0
    assert answered_rate == pytest.approx(200.0, rel=0.05)
    # the queue bound caps latency: 64 in flight at 200 req/s is ~0.32 s
    assert max(p99) < 400.0


def test_a_request_that_waits_past_the_timeout_is_refused() -> None:
    slow = ServiceModel(concurrency=(1.0,), short_rps=(1.0,), long_rps=(1.0,), max_in_system=1000, timeout_s=2.0)
    result = simulate(slow, Traffic(base=5.0, duration=20.0), FIXED, seed=2)
    assert result.summary["refused"] > 0
    assert result.summary["p99_ms"] <= 3100.0  # nobody answered after waiting much past 2 s + 1 s of service


def test_hpa_adds_replicas_after_a_burst_within_sync_plus_cold_start() -> None:
    scaler = Autoscaler(
        kind="hpa", metric="queue", target=5.0, min_replicas=1, sync_s=15.0, scrape_s=5.0, window_s=15.0
    )
    scaler_ready = scaler.schedule_s + scaler.ready_s
    traffic = Traffic(base=40.0, burst=6.0, burst_at=60.0, burst_s=120.0, duration=240.0)
    result = simulate(MODEL, traffic, scaler, seed=3)
    before = [s for s in result.scaling if s["t_s"] < 60.0]
    assert all(s["replicas"] == 1 for s in before)
    asked = next(s["t_s"] for s in result.scaling if s["replicas"] > 1)
    assert 60.0 < asked <= 60.0 + 2 * scaler.sync_s + scaler.window_s
    ready = next(s["t_s"] for s in result.scaling if s["ready"] > 1)
    assert ready <= asked + scaler_ready + scaler.sync_s
    # and once ready the burst is served: the last minute of it answers under 200 ms p99
    late = [w for w in result.windows if 120.0 <= w["t_s"] < 180.0]
    assert all(w["p99_ms"] < 200.0 and w["refused"] == 0 for w in late)


def test_concurrency_target_scales_too() -> None:
    scaler = Autoscaler(kind="hpa", metric="concurrency", target=4.0, min_replicas=1, scrape_s=5.0, window_s=15.0)
    traffic = Traffic(base=80.0, burst=3.0, burst_at=60.0, burst_s=120.0, duration=200.0)
    assert simulate(MODEL, traffic, scaler, seed=3).summary["max_replicas"] > 1


def test_keda_scales_from_zero_and_refuses_until_the_first_replica_is_ready() -> None:
    scaler = Autoscaler(kind="keda", target=5.0, min_replicas=0, schedule_s=20.0, ready_s=10.0)
    result = simulate(MODEL, Traffic(base=20.0, start_at=30.0, duration=150.0), scaler, seed=4)
    first = result.summary["first_answer_s"]
    # traffic at 30 s, seen at the 45 s poll, ready 30 s later
    assert 30.0 + 20.0 + 10.0 <= first <= 30.0 + 15.0 + 20.0 + 10.0 + 1.0
    assert result.summary["refused"] == pytest.approx(20.0 * (first - 30.0), rel=0.2)
    hpa = simulate(MODEL, Traffic(base=20.0, start_at=30.0, duration=150.0), Autoscaler(min_replicas=0), seed=4)
    assert hpa.summary["answered"] == 0  # an HPA alone never leaves zero


def test_same_seed_same_result_other_seed_other_result() -> None:
    scaler = Autoscaler(target=5.0, min_replicas=1, scrape_s=5.0, window_s=15.0)
    traffic = Traffic(base=150.0, burst=2.0, burst_at=30.0, burst_s=60.0, duration=120.0)
    a, b = simulate(MODEL, traffic, scaler, seed=7), simulate(MODEL, traffic, scaler, seed=7)
    assert a.summary == b.summary and a.windows == b.windows and a.scaling == b.scaling
    assert simulate(MODEL, traffic, scaler, seed=8).summary != a.summary
