"""The gateway's GET /metrics with prometheus_client: every metric it always had, the request duration histogram, and
`kev-gateway --workers 2` counting what every worker answered (prometheus_client's multiprocess mode)."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.multiprocess import MultiProcessCollector

from kev_backend.dev.ports import free_port
from kev_backend.serve.client import prometheus
from kev_backend.serve.gateway.app import create_app
from kev_backend.serve.gateway.observability import DURATION_BUCKETS
from kev_backend.serve.gateway.replies import REASONS
from kev_backend.settings import GatewaySettings
from tests.conftest import Gateway, wait_ready, wait_until


def start_workers_gateway(log: Path, workers: int, triton_grpc: str = "127.0.0.1:1", metrics: str = "") -> Gateway:
    """`kev-gateway --workers N` on a free loopback port (Triton at `triton_grpc`; none by default)."""
    port = free_port()
    env = {**os.environ, "TRITON_GRPC_URL": triton_grpc, "TRITON_METRICS_URL": metrics or "127.0.0.1:1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    command = [str(Path(sys.prefix) / "bin" / "kev-gateway"), "--port", str(port), "--workers", str(workers)]
    process = subprocess.Popen(command, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    gateway = Gateway(f"http://127.0.0.1:{port}", process, log)
    if not wait_ready(f"{gateway.url}/health", process, 60):
        process.kill()
        pytest.fail(f"kev-gateway did not start (exit code {process.poll()}):\n{log.read_text()[-3000:]}")
    return gateway


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            reply.read()
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def samples(url: str) -> list[prometheus.Sample]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        return prometheus.parse(reply.read().decode())


def metrics_directory(gateway: Gateway) -> Path:
    """The PROMETHEUS_MULTIPROC_DIR kev-gateway gave its workers (read from a child's environment)."""
    children = Path(f"/proc/{gateway.process.pid}/task/{gateway.process.pid}/children").read_text().split()
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
        for line in environ:
            if line.startswith("PROMETHEUS_MULTIPROC_DIR="):
                return Path(line.partition("=")[2])
    pytest.fail("no worker has PROMETHEUS_MULTIPROC_DIR")


def test_every_metric_keeps_its_name_and_the_duration_histogram_is_by_route_and_status() -> None:
    with TestClient(create_app(GatewaySettings(triton_url="127.0.0.1:1"))) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/nowhere").status_code == 404
        text = client.get("/metrics").text
    lines = text.splitlines()
    for name, kind in [
        ("kev_gateway_requests_total", "counter"),
        ("kev_gateway_errors_total", "counter"),
        ("kev_gateway_in_flight", "gauge"),
        ("kev_gateway_arriving", "gauge"),
        ("kev_gateway_arriving_bytes", "gauge"),
        ("kev_gateway_request_duration_seconds", "histogram"),
    ]:
        assert f"# TYPE {name} {kind}" in lines
    assert 'kev_gateway_requests_total{route="/health",status="200"} 1' in lines
    assert 'kev_gateway_requests_total{route="other",status="404"} 1' in lines
    assert all(f'kev_gateway_errors_total{{reason="{reason}"}} 0' in lines for reason in REASONS)
    found = prometheus.parse(text)
    bounds = [
        float(labels["le"])
        for name, labels, _ in found
        if name == "kev_gateway_request_duration_seconds_bucket" and labels["route"] == "/health"
    ]
    assert bounds == [*DURATION_BUCKETS, float("inf")] and bounds[0] == 0.001 and bounds[-2] == 60
    count = prometheus.total(found, "kev_gateway_request_duration_seconds_count", route="/health", status="200")
    assert count == 1 and prometheus.total(found, "kev_gateway_request_duration_seconds_sum", route="/health") > 0
    assert "_created" not in text  # a per-process start time: nothing to sum over workers


def test_two_workers_count_every_request_either_answered(tmp_path: Path) -> None:
    """Requests on fresh connections spread over both workers; whichever answers the scrape reports them all. Each
    worker's own share is read from its file in the shared directory, so the test knows both took part."""
    gateway = start_workers_gateway(tmp_path / "gateway.log", workers=2)
    try:
        directory = metrics_directory(gateway)

        def shares() -> dict[str, float]:
            found = {}
            for file in sorted(directory.glob("counter_*.db")):
                counted = MultiProcessCollector.merge([str(file)], accumulate=False)
                found[file.name] = sum(
                    s.value
                    for m in counted
                    for s in m.samples
                    if s.name == "kev_gateway_requests_total" and s.labels["route"] == "/health"
                )
            return found

        # Which worker accepts a connection is the kernel's choice: on a busy host one may take a whole round, so
        # rounds are sent until both have answered some.
        n = 0
        for _ in range(10):
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                statuses = list(pool.map(lambda _: get(f"{gateway.url}/health"), range(60)))
            assert statuses == [200] * 60
            n += 60
            if len(shares()) == 2 and all(share > 0 for share in shares().values()):
                break
        assert len(shares()) == 2 and all(share > 0 for share in shares().values()), (
            f"a worker answered nothing: {shares()}"
        )
        for _ in range(4):  # whichever worker answers the scrape
            found = samples(gateway.url)
            # n, and the one /health of the start's wait for the gateway
            assert prometheus.total(found, "kev_gateway_requests_total", route="/health", status="200") == n + 1
            assert prometheus.total(found, "kev_gateway_request_duration_seconds_count", route="/health") == n + 1
            assert prometheus.total(found, "kev_gateway_in_flight") == 0
        wait_until(lambda: prometheus.total(samples(gateway.url), "kev_gateway_connections") >= 1, "the connections")
    finally:
        gateway.process.terminate()
        gateway.process.wait(timeout=30)
    assert not directory.exists(), "the per-start metrics directory is removed when the gateway stops"
