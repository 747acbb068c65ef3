"""deploy/monitoring/: the alert rules checked and unit-tested by promtool (every alert), the PrometheusRule equal to
the rule file, a runbook entry for every alert, and the Grafana dashboard's every query answered by a real
Prometheus scraping a live server (kev-serve's Triton on the toy checkpoint and `kev-gateway --workers 2`) while
valid and invalid requests go through. Marker `deploy`; promtool and prometheus from Debian's `prometheus` package
(2.42)."""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from kev_backend.dev.ports import free_port
from tests.conftest import TritonServer, wait_ready, wait_until
from tests.serve.gateway.clients import BODY, call
from tests.serve.gateway.test_metrics import start_workers_gateway

pytestmark = pytest.mark.deploy

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "deploy" / "monitoring"
RULES = MONITORING / "alerts" / "kev-alerts.yaml"
RULE_TESTS = MONITORING / "alerts" / "kev-alerts.test.yaml"
PROMETHEUS_RULE = MONITORING / "alerts" / "kev-prometheusrule.yaml"
DASHBOARD = MONITORING / "grafana" / "kev-dashboard.json"
OPERATIONS = REPO / "docs" / "operations.md"
# Grafana's variables as the test's Prometheus (a scrape a second) needs them: a rate window of several scrapes.
GRAFANA_VARIABLES = {"$__rate_interval": "20s", "$__interval": "1s", "$__range": "5m", "${datasource}": ""}


def tool(name: str) -> str:
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: apt-get install -y prometheus (Debian 12: promtool and prometheus 2.42)")
    return found


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def alerts() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"] if "alert" in rule]


def test_the_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_every_alert_has_a_unit_test_that_fires_it_and_they_pass() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())
    fired = {case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert fired == {rule["alert"] for rule in alerts()}
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_unit_tests_can_fail(tmp_path: Path) -> None:
    """A rule made wrong (a threshold no trouble reaches) fails its unit test."""
    (tmp_path / "kev-alerts.yaml").write_text(RULES.read_text().replace("> 0.95", "> 1.5"))
    shutil.copy(RULE_TESTS, tmp_path)
    result = promtool("test", "rules", str(tmp_path / RULE_TESTS.name))
    assert result.returncode != 0 and "KevGpuMemoryHigh" in result.stdout + result.stderr


def test_the_prometheusrule_holds_the_rule_file() -> None:
    wrapped = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert (wrapped["apiVersion"], wrapped["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert wrapped["spec"] == yaml.safe_load(RULES.read_text()), (
        "regenerate kev-prometheusrule.yaml from kev-alerts.yaml"
    )


def test_every_alert_has_its_runbook_entry() -> None:
    headings = {heading.strip().lower() for heading in re.findall(r"^#+ (.+)$", OPERATIONS.read_text(), re.M)}
    assert "alerts and runbook" in headings
    for rule in alerts():
        anchor = rule["alert"].lower()
        assert rule["annotations"]["runbook"] == f"docs/operations.md#{anchor}"
        assert anchor in headings, f"docs/operations.md has no entry for {rule['alert']}"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's variables substituted) of every target of every panel."""
    found = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"{panel['title']}: a variable the test does not know: {expr}"
            found.append((panel["title"], expr))
    return found


class Prometheus:
    def __init__(self, tmp_path: Path, targets: dict[str, str], paths: dict[str, str] | None = None) -> None:
        """targets: job name to HOST:PORT; paths: a job's metrics path where it is not /metrics."""
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {
                    "job_name": job,
                    "metrics_path": (paths or {}).get(job, "/metrics"),
                    "static_configs": [{"targets": [target]}],
                }
                for job, target in targets.items()
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = tmp_path / "prometheus.log"
        command = [
            tool("prometheus"),
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--web.listen-address={self.url.removeprefix('http://')}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
        ]
        self.process = subprocess.Popen(command, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        if not wait_ready(f"{self.url}/-/ready", self.process, 60):
            self.stop()
            pytest.fail(f"prometheus did not start:\n{self.log.read_text()[-3000:]}")

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as reply:
            answer = json.loads(reply.read())
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


def test_every_dashboard_query_answers_from_a_live_server(triton: TritonServer, tmp_path: Path) -> None:
    gateway = start_workers_gateway(tmp_path / "gateway.log", 2, triton.grpc_url, triton.metrics_url)
    prometheus = Prometheus(
        tmp_path, {"kev-gateway": gateway.url.removeprefix("http://"), "kev-triton": triton.metrics_url}
    )
    try:

        def all_up() -> bool:
            targets = prometheus.api("targets")["activeTargets"]
            return len(targets) == 2 and all(t["health"] == "up" for t in targets)

        wait_until(all_up, "Prometheus scraping the gateway and Triton")
        time.sleep(2)  # samples before the traffic: rates over it start from them
        statuses = []
        for n in range(12):  # answered, refused (invalid: not JSON, no questions) and unknown paths
            statuses.append(call(gateway, "/v1/systemone", BODY.replace(b"twice", f"twice {n}".encode()), key=None)[0])
            statuses.append(call(gateway, "/v1/systemone", b"{not json", key=None)[0])
            statuses.append(call(gateway, "/v1/systemone", b'{"state": "x"}', key=None)[0])
            statuses.append(call(gateway, "/nowhere", None, key=None, method="GET")[0])
            # Spread over several scrapes: a series is born at its first request, and a rate needs it to move after.
            time.sleep(0.4)
        assert sorted(set(statuses)) == [200, 404, 422], statuses
        time.sleep(4)  # a few scrapes after it
        gpu = bool(prometheus.query("nv_gpu_memory_total_bytes"))
        empty = []
        for title, expr in dashboard_queries():
            result = prometheus.query(expr)
            values = [float(sample["value"][1]) for sample in result]
            if not any(value == value for value in values):  # none, or every one NaN
                if "nv_gpu_" in expr and not gpu:
                    continue  # Triton's GPU metrics: a GPU host's only
                empty.append(f"{title}: {expr}")
        assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
        answered = prometheus.query('sum(kev_gateway_requests_total{route="/v1/systemone",status="200"})')
        assert float(answered[0]["value"][1]) == 12  # summed over both workers
        assert float(prometheus.query("sum(kev_serve_ready)")[0]["value"][1]) == 1  # kev-serve's, via the stub
        rules = [rule for group in prometheus.api("rules")["groups"] for rule in group["rules"]]
        assert len(rules) == len(alerts()) and all(rule["health"] == "ok" for rule in rules), rules
        firing = [rule["name"] for rule in rules if rule["state"] != "inactive"]
        assert firing == [], f"alerts on a healthy server: {firing}"
    finally:
        prometheus.stop()
        gateway.process.terminate()
        gateway.process.wait(timeout=30)


# Scrapes of a GPU host's `make serve` (one H200, Kev-4B shapes on random weights, 4 s apart while short6 went over
# gRPC and valid and invalid requests through the gateway), kept so that the panels only a GPU host feeds (Triton's
# nv_gpu_* series, kev_build_info's GPU labels) are checked here too. `bash bench/gpu.sh hardening` writes fresh ones
# (OUT/metrics/).
GPU_SCRAPES = Path(__file__).with_name("gpu_scrapes")


class Replay:
    """A loopback HTTP server that answers each job's /JOB/metrics with that job's kept scrapes in turn, then the last
    one again: Prometheus sees the counters move as they moved on the GPU host."""

    def __init__(self, scrapes: dict[str, list[Path]]) -> None:
        served = {job: 0 for job in scrapes}
        self.served = served

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                job = self.path.strip("/").split("/")[0]
                if job not in scrapes:
                    self.send_error(404)
                    return
                body = scrapes[job][min(served[job], len(scrapes[job]) - 1)].read_bytes()
                served[job] += 1
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_every_dashboard_query_answers_from_a_gpu_hosts_metrics(tmp_path: Path) -> None:
    scrapes = {job: sorted(GPU_SCRAPES.glob(f"{job}-*.txt")) for job in ("triton", "gateway")}
    assert all(len(kept) >= 2 for kept in scrapes.values()), scrapes  # a rate needs two samples
    replay = Replay(scrapes)
    prometheus = Prometheus(
        tmp_path,
        {f"kev-{job}": replay.address for job in scrapes},
        {f"kev-{job}": f"/{job}/metrics" for job in scrapes},
    )
    try:
        wait_until(
            lambda: all(replay.served[job] > len(kept) for job, kept in scrapes.items()),
            "Prometheus scraping every kept scrape",
        )
        time.sleep(1.5)  # the last scrape ingested
        empty = []
        for title, expr in dashboard_queries():
            values = [float(sample["value"][1]) for sample in prometheus.query(expr)]
            if not any(value == value for value in values):
                empty.append(f"{title}: {expr}")
        assert not empty, "dashboard queries without data from the GPU host's metrics:\n" + "\n".join(empty)
        used = prometheus.query("nv_gpu_memory_used_bytes")
        assert used and float(used[0]["value"][1]) > 0
        info = [sample["metric"] for sample in prometheus.query("kev_build_info == 1")]
        assert len(info) == 1, info  # the "pending" series dropped to 0 once the hash was known
        assert info[0]["gpu"].startswith("NVIDIA ") and info[0]["device"] == "cuda:0"
        assert re.fullmatch(r"[0-9a-f]{64}", info[0]["checkpoint_sha256"]), info[0]
        assert info[0]["torch"] and info[0]["cublaslt"] and info[0]["driver"]
    finally:
        prometheus.stop()
        replay.stop()
