"""The backend's metrics through a stand-in for pb_utils' custom-metrics API: requests' time and tokens, and
kev-serve's state published by one stub of a start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kev_backend.serve.stub.metrics import REQUEST_MS_BUCKETS, KevMetrics, SupervisorMetrics, supervisor_state_path


class FakeMetric:
    def __init__(self, labels: dict[str, str], buckets: list[float] | None) -> None:
        self.labels, self.buckets = labels, buckets
        self.value = 0.0
        self.observed: list[float] = []

    def increment(self, n: float) -> None:
        self.value += n

    def set(self, value: float) -> None:
        self.value = value

    def observe(self, value: float) -> None:
        self.observed.append(value)


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made: dict[str, FakeFamily] = {}

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.kind, self.metrics = name, kind, []
        FakeFamily.made[name] = self

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> FakeMetric:  # noqa: N802
        self.metrics.append(FakeMetric(labels, buckets))
        return self.metrics[-1]


class FakeLogger:
    @staticmethod
    def log_warn(message: str) -> None:
        raise AssertionError(message)


class FakePbUtils:
    MetricFamily = FakeFamily
    Logger = FakeLogger


def test_requests_time_and_tokens() -> None:
    metrics = KevMetrics(FakePbUtils, {"model": "kev", "instance": "kev_0_0"})
    metrics.record_requests([12.5, None, 800.0], [300, 5000])
    assert metrics.request_ms.observed == [12.5, 800.0] and metrics.request_tokens.observed == [300, 5000]
    family = FakeFamily.made["kev_request_ms"]
    assert family.kind == "histogram" and metrics.request_ms.buckets == REQUEST_MS_BUCKETS
    assert REQUEST_MS_BUCKETS[0] == 1 and REQUEST_MS_BUCKETS[-1] == 60_000


def write(path: Path, ready: bool, **triton: int) -> None:
    path.write_text(json.dumps({"ready": ready, "restarts": {"triton": triton, "gateway": {"exited": 0}}}))


def test_one_stub_publishes_kev_serve_state_and_its_counters_continue(tmp_path: Path) -> None:
    FakeFamily.made.clear()
    prefix = f"{tmp_path}/kev_serve_1_1_2_heartbeat_"
    path = supervisor_state_path(prefix)
    publisher = SupervisorMetrics(FakePbUtils, prefix)
    other = SupervisorMetrics(FakePbUtils, prefix)  # a second instance of the same start
    try:
        assert publisher.thread is not None and other.thread is None
        publisher.publish()  # no state yet (tritonserver by hand): nothing registered
        assert "kev_serve_ready" not in FakeFamily.made
        write(path, True, hung=2)  # a restarted Triton: kev-serve's totals, not zero
        publisher.publish()
        counters: dict[tuple[str, str], Any] = {
            (m.labels["process"], m.labels["cause"]): m for m in FakeFamily.made["kev_serve_restarts_total"].metrics
        }
        assert counters["triton", "hung"].value == 2 and counters["triton", "stub_died"].value == 0
        assert counters["gateway", "exited"].value == 0
        assert FakeFamily.made["kev_serve_ready"].metrics[0].value == 1
        write(path, False, hung=2, stub_died=1)
        publisher.publish()
        assert counters["triton", "stub_died"].value == 1 and counters["triton", "hung"].value == 2
        assert FakeFamily.made["kev_serve_ready"].metrics[0].value == 0
    finally:
        publisher.close()
        other.close()
    assert SupervisorMetrics(FakePbUtils, None).thread is None  # no kev-serve: nothing published
