"""Clients of the gateway for its tests: raw HTTP calls (any body, chunked or not, with or without the key), the
gateway's and Triton's metrics scraped as {series: value}, and calls run side by side."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import urlsplit

from tests.conftest import Gateway, TritonServer

KEY = "hostile-key"
URGENT = {"type": "noul", "instructions": "is this urgent ?", "criteria": {"true": "reply today"}}
QUESTIONS = {
    "urgent": URGENT,
    "team": {"type": "choice", "instructions": "route it", "criteria": {"billing": None, "tech": None, "sales": None}},
    "tone": {"type": "score", "instructions": "sentiment", "criteria": ["angry", "neutral", "happy"]},
}
BODY = json.dumps({"state": "my card was charged twice", "questions": {"urgent": URGENT}}).encode()
REQUEST_ID = "x-typesafe-request-id"


def call(
    gateway: Gateway,
    path: str,
    body: bytes | Iterable[bytes] | None = BODY,
    headers: dict[str, str] | None = None,
    key: str | None = KEY,
    method: str = "POST",
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lowercase names, body) of one request. An iterable body goes chunked, with no
    Content-Length."""
    url = urlsplit(gateway.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    all_headers = {"content-type": "application/json", **(headers or {})}
    if key:
        all_headers["authorization"] = f"Bearer {key}"
    try:
        chunked = body is not None and not isinstance(body, bytes)
        connection.request(method, path, body=body, headers=all_headers, encode_chunked=chunked)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def call_json(gateway: Gateway, path: str, *args, **kwargs) -> tuple[int, dict[str, str], dict]:
    status, headers, body = call(gateway, path, *args, **kwargs)
    assert headers["content-type"] == "application/json", (status, headers, body[:300])
    return status, headers, json.loads(body)


def scrape(url: str) -> dict[str, float]:
    """Prometheus text as {series: value}, a series written as it appears (name and labels)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("GET", parts.path)
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    series = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            series[name] = float(value)
    return series


def gateway_metrics(gateway: Gateway) -> dict[str, float]:
    return scrape(f"{gateway.url}/metrics")


def triton_metrics(triton: TritonServer) -> dict[str, float]:
    """Triton's and the Kev model's series for the model `kev`, labels other than `reason` dropped (summed)."""
    totals: dict[str, float] = {}
    for series, value in scrape(f"http://{triton.metrics_url}/metrics").items():
        name, _, labels = series.partition("{")
        if 'model="kev"' not in labels:
            continue
        reason = next((p.split('"')[1] for p in labels.split(",") if p.startswith("reason=")), None)
        key = f"{name}[{reason}]" if reason else name
        totals[key] = totals.get(key, 0.0) + value
    return totals


def error_count(metrics: dict[str, float], reason: str) -> float:
    return metrics[f'kev_gateway_errors_total{{reason="{reason}"}}']


def request_count(metrics: dict[str, float], route: str, status: int) -> float:
    return metrics.get(f'kev_gateway_requests_total{{route="{route}",status="{status}"}}', 0.0)


def peak_rss_bytes(gateway: Gateway) -> int:
    """The gateway process's peak resident memory (VmHWM)."""
    for line in Path(f"/proc/{gateway.process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


def in_parallel(*calls: Callable[[], object]) -> list[object]:
    results: list[object] = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def assert_answered(result: tuple[int, dict[str, str], dict]) -> None:
    status, _, reply = result
    assert status == 200 and set(reply["answers"]) == {"urgent"}, result


def ask(gateway: Gateway, state: str) -> tuple[int, dict[str, str], dict]:
    """One ordinary request (a fresh `state` is a state the model must compute)."""
    return call_json(gateway, "/v1/systemone", json.dumps({"state": state, "questions": {"urgent": URGENT}}).encode())


def sender(gateway: Gateway, body: bytes, headers: dict[str, str] | None = None) -> Callable[[], object]:
    return lambda: call_json(gateway, "/v1/systemone", body, headers)
