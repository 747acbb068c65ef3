"""The System One gateway against hostile or unlucky clients, on the real stack (tritonserver + kev-gateway, tiny
checkpoint): compression bombs, corrupt and oversized bodies, unsupported encodings, CORS with a key, metrics by
reason, readiness, failures as JSON, and clients that leave before their answer (their Triton calls are cancelled,
never scored)."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from backports.zstd import ZstdCompressor, compress
from starlette.testclient import TestClient

from kev_backend.dev.ports import free_port
from kev_backend.engine.pipeline import PREPARE_APART_BYTES
from kev_backend.serve.client import KevError
from kev_backend.serve.gateway import create_app
from kev_backend.serve.gateway.answering import gather_or_cancel
from kev_backend.serve.gateway.bodies import MAX_FRAMES, decompress
from kev_backend.serve.gateway.replies import REASONS, Refused
from kev_backend.serve.gateway.service import Gateway as GatewayService
from kev_backend.settings import GatewaySettings
from tests.conftest import Gateway, TritonServer, settled, start_gateway, stop_gateway, wait_until
from tests.helpers import error_detail

KEY = "hostile-key"
LIMIT = 4 << 20  # the default for both byte limits
URGENT = {"type": "noul", "instructions": "is this urgent ?", "criteria": {"true": "reply today"}}
QUESTIONS = {
    "urgent": URGENT,
    "team": {"type": "choice", "instructions": "route it", "criteria": {"billing": None, "tech": None, "sales": None}},
    "tone": {"type": "score", "instructions": "sentiment", "criteria": ["angry", "neutral", "happy"]},
}
BODY = json.dumps({"state": "my card was charged twice", "questions": {"urgent": URGENT}}).encode()
REQUEST_ID = "x-typesafe-request-id"


@pytest.fixture(scope="module")
def gateway(triton: TritonServer, tmp_path_factory: pytest.TempPathFactory):
    server = start_gateway(triton, tmp_path_factory.mktemp("hostile") / "gateway.log", KEV_API_KEY=KEY)
    yield server
    stop_gateway(server)


# --- helpers -------------------------------------------------------------------------------------------------------


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


def zeros(total: int, chunk: int = 1 << 20) -> Iterator[bytes]:
    block = bytes(chunk)
    for _ in range(total // chunk):
        yield block


def zstd_bomb(total: int) -> bytes:
    compressor = ZstdCompressor()
    return b"".join(compressor.compress(block) for block in zeros(total)) + compressor.flush()


def gzip_bomb(total: int) -> bytes:
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    return b"".join(compressor.compress(block) for block in zeros(total)) + compressor.flush()


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


# --- compressed bodies ---------------------------------------------------------------------------------------------


def test_zstd_bomb_is_refused_without_decoding_it(gateway: Gateway) -> None:
    """1 GiB of zeros in ~32 KB of zstd, eight at once: each refused with 413 once 4 MiB are decoded, the gateway's
    memory stays far below one decoded bomb, and a normal request sent alongside is answered."""
    bomb = zstd_bomb(1 << 30)
    assert len(bomb) < 64 << 10  # small enough to be decoded on the event loop: the output cap must hold there too
    *bombs, answered = in_parallel(*[sender(gateway, bomb, {"content-encoding": "zstd"})] * 8, sender(gateway, BODY))
    for status, _, reply in bombs:
        assert status == 413 and error_detail(reply) == {
            "detail": f"the zstd body decodes to over the {LIMIT:,}-byte limit"
        }
    assert_answered(answered)
    assert peak_rss_bytes(gateway) < 512 << 20


def test_gzip_bomb_is_refused_without_decoding_it(gateway: Gateway) -> None:
    """256 MiB of zeros in ~250 KB of gzip (decoded on a worker thread: over 64 KiB), four at once."""
    bomb = gzip_bomb(256 << 20)
    assert 64 << 10 < len(bomb) < LIMIT
    *bombs, answered = in_parallel(*[sender(gateway, bomb, {"content-encoding": "gzip"})] * 4, sender(gateway, BODY))
    for status, _, reply in bombs:
        assert status == 413 and error_detail(reply) == {
            "detail": f"the gzip body decodes to over the {LIMIT:,}-byte limit"
        }
    assert_answered(answered)
    assert peak_rss_bytes(gateway) < 512 << 20


def test_compressed_bodies_within_the_limit_are_decoded(gateway: Gateway) -> None:
    """Large but honest: a ~3.5 MB body in ~0.5 MB of gzip (the worker-thread path) is decoded whole and reaches
    Kev's own state-token limit; bodies of several frames or members are answered."""
    state = " ".join(f"refund {i} is late" for i in range(200_000))[:3_500_000]
    body = json.dumps({"state": state, "questions": {"urgent": URGENT}}).encode()
    status, _, reply = call_json(gateway, "/v1/systemone", zlib.compress(body, wbits=31), {"content-encoding": "gzip"})
    assert status == 422 and "over the 65,536-token limit" in reply["detail"], reply
    half = len(BODY) // 2
    frames = compress(BODY[:half]) + compress(BODY[half:])
    assert_answered(call_json(gateway, "/v1/systemone", frames, {"content-encoding": "zstd"}))
    members = zlib.compress(BODY[:half], wbits=31) + zlib.compress(BODY[half:], wbits=31)
    assert_answered(call_json(gateway, "/v1/systemone", members, {"content-encoding": "gzip"}))


@pytest.mark.parametrize(
    ("encoding", "body", "message"),
    [
        ("zstd", compress(BODY)[:-4], "could not decode the zstd body: the data ends inside a frame"),
        ("zstd", b"not zstd at all", "could not decode the zstd body: "),
        ("zstd", compress(BODY) + b"trailing junk", "could not decode the zstd body: "),
        ("gzip", zlib.compress(BODY, wbits=31)[:-4], "could not decode the gzip body: the data ends inside a member"),
        ("gzip", b"not gzip at all", "could not decode the gzip body: "),
        ("zstd", compress(b"") * (MAX_FRAMES + 1), f"could not decode the zstd body: more than {MAX_FRAMES} frames"),
    ],
)
def test_corrupt_bodies_are_400_json(gateway: Gateway, encoding: str, body: bytes, message: str) -> None:
    status, _, reply = call_json(gateway, "/v1/systemone", body, {"content-encoding": encoding})
    assert status == 400 and reply["detail"].startswith(message), reply


def test_unsupported_encoding_is_415_json(gateway: Gateway) -> None:
    status, _, reply = call_json(gateway, "/v1/systemone", BODY, {"content-encoding": "br"})
    assert status == 415 and error_detail(reply) == {"detail": "unsupported content-encoding 'br': use zstd or gzip"}


def test_decompress_matches_the_libraries_and_caps_its_output() -> None:
    """The streamed decoders read what zstd.decompress / gzip.decompress read (several frames or members, each
    fed in slices) and stop at the cap, which counts the decoded bytes exactly."""
    import gzip
    import os

    from backports.zstd import decompress as zstd_decompress

    data = os.urandom(300_000) + bytes(700_000)
    frames = b"".join(compress(data[i : i + 250_000]) for i in range(0, len(data), 250_000))
    members = b"".join(gzip.compress(data[i : i + 250_000]) for i in range(0, len(data), 250_000))
    assert decompress(frames, "zstd", len(data)) == zstd_decompress(frames) == data
    assert decompress(members, "gzip", len(data)) == gzip.decompress(members) == data
    for encoding, body in (("zstd", frames), ("gzip", members)):
        with pytest.raises(Refused) as refused:
            decompress(body, encoding, len(data) - 1)
        assert refused.value.status == 413 and refused.value.reason == "too_large"


# --- body size -----------------------------------------------------------------------------------------------------


def test_body_over_the_limit_is_413_json(gateway: Gateway) -> None:
    big = b" " * (LIMIT + 1)  # whitespace: the limit must refuse it before anything parses it
    status, _, reply = call_json(gateway, "/v1/systemone", big)  # with Content-Length: refused from the header
    assert status == 413 and error_detail(reply) == {
        "detail": f"request body is {LIMIT + 1:,} bytes, over the {LIMIT:,}-byte limit"
    }
    n = LIMIT // (64 << 10) + 2
    chunks = (b" " * (64 << 10) for _ in range(n))  # chunked: read to its end (under 4x the limit), then refused
    status, _, reply = call_json(gateway, "/v1/systemone", chunks)
    assert status == 413 and error_detail(reply) == {
        "detail": f"request body is {n * (64 << 10):,} bytes, over the {LIMIT:,}-byte limit"
    }
    assert_answered(call_json(gateway, "/v1/systemone", b" " * (LIMIT - len(BODY)) + BODY))  # at the limit


def test_byte_limits_come_from_the_environment(triton: TritonServer, tmp_path: Path) -> None:
    small = start_gateway(
        triton, tmp_path / "gateway.log", KEV_GATEWAY_MAX_BODY_BYTES="2000", KEV_GATEWAY_MAX_DECODED_BYTES="3000"
    )
    try:

        def padded(n: int) -> bytes:
            return BODY + b" " * (n - len(BODY))

        assert_answered(call_json(small, "/v1/systemone", padded(2000), key=None))
        status, _, reply = call_json(small, "/v1/systemone", padded(2001), key=None)
        assert status == 413 and reply["detail"] == "request body is 2,001 bytes, over the 2,000-byte limit"
        chunked = iter([padded(2001)[:1000], padded(2001)[1000:]])
        status, _, reply = call_json(small, "/v1/systemone", chunked, key=None)
        assert status == 413 and reply["detail"] == "request body is 2,001 bytes, over the 2,000-byte limit"
        huge = iter([b" " * 1000] * 20)  # past 4x the limit: refused without reading it all
        status, _, reply = call_json(small, "/v1/systemone", huge, key=None)
        assert status == 413 and reply["detail"] == "request body is over 8,000 bytes, over the 2,000-byte limit"
        assert_answered(call_json(small, "/v1/systemone", compress(padded(3000)), {"content-encoding": "zstd"}, None))
        status, _, reply = call_json(small, "/v1/systemone", compress(padded(3001)), {"content-encoding": "zstd"}, None)
        assert status == 413 and reply["detail"] == "the zstd body decodes to over the 3,000-byte limit"
    finally:
        stop_gateway(small)


def test_depth_and_question_limits_follow_the_models_variables(triton: TritonServer, tmp_path: Path) -> None:
    """KEV_MAX_QUESTIONS and KEV_MAX_JSON_DEPTH, the model's overrides, set the gateway's limits too."""
    small = start_gateway(triton, tmp_path / "gateway.log", KEV_MAX_QUESTIONS="2", KEV_MAX_JSON_DEPTH="4")
    try:
        three = {"state": "x", "questions": {q: URGENT for q in ("a", "b", "c")}}
        status, _, reply = call_json(small, "/v1/systemone", json.dumps(three).encode(), key=None)
        assert status == 422 and reply["detail"] == "request has 3 questions, over the limit of 2"
        deep = {"state": [[[["too deep"]]]], "questions": {"a": URGENT}}  # the body is level 1
        status, _, reply = call_json(small, "/v1/systemone", json.dumps(deep).encode(), key=None)
        assert status == 422 and reply["detail"] == "request JSON is nested more than 4 levels deep"
        assert_answered(call_json(small, "/v1/systemone", BODY, key=None))
    finally:
        stop_gateway(small)


# --- CORS, auth, operations ----------------------------------------------------------------------------------------


def test_cors_preflight_passes_without_the_key_and_401_carries_cors(gateway: Gateway) -> None:
    origin = "https://app.example"
    preflight = {
        "origin": origin,
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    status, headers, _ = call(gateway, "/v1/systemone", None, preflight, key=None, method="OPTIONS")
    assert 200 <= status < 300 and headers["access-control-allow-origin"] in ("*", origin), (status, headers)
    assert "authorization" in headers["access-control-allow-headers"].lower()
    status, headers, reply = call_json(gateway, "/v1/systemone", BODY, {"origin": origin}, key=None)
    assert status == 401 and error_detail(reply) == {"detail": "invalid or missing API key"}
    assert headers["access-control-allow-origin"] in ("*", origin) and headers["www-authenticate"] == "Bearer"
    assert REQUEST_ID in headers
    status, headers, _ = call_json(gateway, "/v1/systemone", BODY, {"origin": origin})  # the key still opens it
    assert status == 200 and headers["access-control-allow-origin"] in ("*", origin)


def test_health_ready_and_metrics_need_no_key(gateway: Gateway) -> None:
    status, _, reply = call_json(gateway, "/ready", None, key=None, method="GET")
    assert status == 200 and reply == {"status": "ready"}
    assert call(gateway, "/health", None, key=None, method="GET")[0] == 200
    status, headers, text = call(gateway, "/metrics", None, key=None, method="GET")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = text.decode().splitlines()
    assert "# TYPE kev_gateway_requests_total counter" in lines and "# TYPE kev_gateway_errors_total counter" in lines
    assert call(gateway, "/v1/models", None, key=None, method="GET")[0] == 401  # /v1/* stays keyed


def test_ready_is_503_json_without_a_working_triton(tmp_path: Path) -> None:
    """A real inference is the test: with nothing at Triton's address, /ready says why not (and /health is up)."""
    nowhere = TritonServer("", f"127.0.0.1:{free_port()}", "", tmp_path / "none.log", None)  # type: ignore[arg-type]
    dead = start_gateway(nowhere, tmp_path / "gateway.log")
    try:
        status, _, reply = call_json(dead, "/ready", None, method="GET")
        assert status == 503 and reply["status"] == "not ready" and "probe inference failed" in reply["detail"]
        status, headers, reply = call_json(dead, "/v1/systemone", BODY)  # retryable, and names nothing internal
        assert status == 503 and headers["retry-after"] == "1", reply
        assert reply["detail"].startswith("the model server could not answer this request now (request id ")
        assert "127.0.0.1" not in reply["detail"] and "connect" not in reply["detail"]
        assert error_count(gateway_metrics(dead), "unavailable") == 1
    finally:
        stop_gateway(dead)


def test_metrics_count_each_reason(gateway: Gateway) -> None:
    before = gateway_metrics(gateway)
    call(gateway, "/v1/systemone", b'{"state": "x"}')  # invalid (422)
    call(gateway, "/v1/systemone", b"\xff\xfe not json")  # invalid (400 or 422)
    call(gateway, "/v1/systemone", b" " * (LIMIT + 1))  # too_large
    call(gateway, "/v1/systemone", BODY, {"content-encoding": "br"})  # unsupported_encoding
    call(gateway, "/v1/systemone", b"junk", {"content-encoding": "zstd"})  # bad_encoding
    call(gateway, "/v1/systemone", BODY, key="wrong")  # unauthorized
    call(gateway, "/v1/systemone", BODY, key=None)  # unauthorized
    call(gateway, "/v1/systemone", BODY)  # answered
    after = gateway_metrics(gateway)
    counted = {reason: error_count(after, reason) - error_count(before, reason) for reason in REASONS}
    assert counted == {
        **dict.fromkeys(REASONS, 0),
        "invalid": 2,
        "too_large": 1,
        "unsupported_encoding": 1,
        "bad_encoding": 1,
        "unauthorized": 2,
    }

    def delta(status: int) -> float:
        return request_count(after, "/v1/systemone", status) - request_count(before, "/v1/systemone", status)

    assert (delta(413), delta(415), delta(401), delta(200)) == (1, 1, 2, 1)
    assert delta(400) + delta(422) == 3
    # Unknown paths share one label, whatever they are.
    call(gateway, f"/nothing/{uuid.uuid4().hex}", None, key=None, method="GET")
    assert request_count(gateway_metrics(gateway), "other", 404) >= 1
    assert all("/nothing/" not in series for series in gateway_metrics(gateway))


def test_upstream_failures_are_json_and_counted(triton: TritonServer, tmp_path: Path) -> None:
    """Triton's refusals as the gateway's JSON errors: 429 at its own in-flight limit, 504 past its deadline."""
    limited = start_gateway(
        triton, tmp_path / "limited.log", KEV_GATEWAY_MAX_IN_FLIGHT="2", KEV_GATEWAY_TIMEOUT_S="0.05"
    )
    try:
        separate = json.dumps({"state": "x", "questions": QUESTIONS}).encode()  # 3 parts > 2 in flight
        status, headers, reply = call_json(limited, "/v1/systemone/separate", separate)
        assert status == 429 and headers["retry-after"] == "1" and reply["detail"].startswith("overloaded: ")
        status, _, reply = ask(limited, f"{uuid.uuid4().hex} " + "the refund is late " * 700)  # ~3,000 tokens
        assert status == 504 and error_detail(reply) == {"detail": "the model did not answer in time"}
        metrics = gateway_metrics(limited)
        assert (error_count(metrics, "overloaded"), error_count(metrics, "timeout")) == (1, 1)
        assert "Traceback" not in limited.log.read_text()
    finally:
        stop_gateway(limited)


def test_internal_errors_are_one_json_500_and_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """Anything a handler does not expect: a JSON 500 naming the request id (with CORS headers), counted, and one
    log line without a traceback."""
    app = create_app(GatewaySettings(triton_url="127.0.0.1:1"))

    @app.get("/v1/broken")
    async def broken() -> None:
        raise RuntimeError("boom")

    with TestClient(app) as client, caplog.at_level(logging.ERROR, logger="kev_backend.serve.gateway"):
        headers = {"authorization": "Bearer x", REQUEST_ID: "req-42", "origin": "https://app.example"}
        response = client.get("/v1/broken", headers=headers)
        assert response.status_code == 500 and response.json() == {
            "detail": "internal error (request id req-42)",
            "request_id": "req-42",
        }
        assert response.headers[REQUEST_ID] == "req-42" and response.headers["access-control-allow-origin"]
        metrics = client.get("/metrics").text
    assert 'kev_gateway_errors_total{reason="internal"} 1' in metrics.splitlines()
    assert 'kev_gateway_requests_total{route="/v1/broken",status="500"} 1' in metrics.splitlines()
    records = [r for r in caplog.records if r.name == "kev_backend.serve.gateway"]
    assert len(records) == 1 and records[0].exc_info is None
    assert records[0].getMessage() == "internal error (request id req-42) on GET /v1/broken: RuntimeError('boom')"


# --- clients that leave ----------------------------------------------------------------------------------------------


def raw_request(gateway: Gateway, path: str, body: dict) -> socket.socket:
    """A socket that has sent one whole request and will never read the answer."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: kev\r\nauthorization: Bearer {KEY}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    )
    url = urlsplit(gateway.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    sock.sendall(head.encode() + data)
    return sock


def test_clients_that_leave_are_not_scored(triton: TritonServer, gateway: Gateway) -> None:
    """While the model is busy with two large requests, 20 clients (single, /separate and /permute requests) send
    their request and close the socket. The gateway counts each as client_disconnected and cancels its Triton calls,
    every part of each: Triton and the model drop them as cancelled, and no state of theirs is computed. (The large
    requests stay under the scheduler's long-work threshold: short requests do not wait behind long work.)"""
    nonce = uuid.uuid4().hex  # fresh states: none is in the model's state bank
    mail = {"state": f"mail {nonce}", "questions": QUESTIONS}
    clients = [("/v1/systemone", {"state": f"order {i} {nonce}", "questions": {"urgent": URGENT}}) for i in range(14)]
    clients += [("/v1/systemone/separate", {"state": f"ticket {i} {nonce}", "questions": QUESTIONS}) for i in range(4)]
    clients += [("/v1/systemone/permute", {"request": mail, "question": "team", "seed": i}) for i in range(2)]
    calls = 14 + 4 * len(QUESTIONS) + 2 * 6  # /permute's n_perm defaults to 6

    def in_flight() -> float:
        return gateway_metrics(gateway)["kev_gateway_in_flight"]

    def disconnected() -> float:
        return error_count(gateway_metrics(gateway), "client_disconnected") - error_count(before, "client_disconnected")

    # Triton's queue and the model's pipeline are first in, first out: once a request is answered, every request
    # sent before it has been scored or dropped. One before the counts are read, one after.
    assert_answered(ask(gateway, f"before {nonce}"))
    before, triton_before = gateway_metrics(gateway), triton_metrics(triton)
    assert in_flight() == 0
    long_result: list = []
    # Each ~12,800 tokens (seconds of model work on the CPU), under LONG_WORK_TOKENS: normal batches, which the
    # clients' requests queue behind; and under PREPARE_APART_BYTES of JSON, so prepared on Triton's execute thread
    # and taken by the model before the next Triton batch forms (a larger one would be tokenized apart while the
    # clients' batch went first).
    long_states = [f"long {i} {nonce} " + "the refund is late " * 3200 for i in range(2)]
    assert all(len(json.dumps({"state": state, "questions": QUESTIONS})) < PREPARE_APART_BYTES for state in long_states)
    long_requests = [
        threading.Thread(target=lambda state=state: long_result.append(ask(gateway, state))) for state in long_states
    ]
    for long_request in long_requests:
        long_request.start()
    wait_until(lambda: in_flight() == 2, "the long requests to reach Triton")
    # Its batch must have left Triton's queue before any client's call arrives, or a call could share the long
    # request's batch and be scored with it before it is cancelled: Triton counts the batch once execute took it.
    executions = triton_before.get("nv_inference_exec_count", 0.0)
    wait_until(
        lambda: triton_metrics(triton).get("nv_inference_exec_count", 0.0) > executions, "the long request's batch"
    )
    sockets = [raw_request(gateway, path, body) for path, body in clients]
    wait_until(lambda: in_flight() == 2 + calls, "every client's Triton calls to be under way")
    for sock in sockets:
        sock.close()
    wait_until(lambda: disconnected() == len(clients), "the gateway to notice every client leaving")
    assert any(r.is_alive() for r in long_requests), "the large requests ended before the clients left"
    for long_request in long_requests:
        long_request.join()
    assert len(long_result) == 2
    for result in long_result:
        assert_answered(result)
    assert_answered(ask(gateway, f"after {nonce}"))
    assert in_flight() == 0

    after = settled(
        lambda: triton_metrics(triton),
        lambda v: v.get("kev_bank_misses_total", 0.0) - triton_before.get("kev_bank_misses_total", 0.0) >= 3,
        "the states computed",
    )

    def delta(name: str) -> float:
        return after.get(name, 0.0) - triton_before.get(name, 0.0)

    failures = sum(delta(name) for name in after if name.startswith("nv_inference_request_failure["))
    received = delta("nv_inference_request_success") + failures - 3  # the clients' calls Triton got
    cancelled = delta("nv_inference_request_failure[CANCELED]") + delta("kev_request_errors_total[cancelled]")
    computed = delta("kev_bank_misses_total")
    summary = f"{calls} calls sent, {received} received, {cancelled} cancelled, {computed} states computed"
    assert computed == 3, summary  # the large requests' states and the last one's: none of the clients'
    assert 0 < received <= calls and cancelled == received, summary  # every client call Triton saw was cancelled
    assert delta("nv_inference_request_success") < calls + 3, summary  # fewer executions than requests sent
    gateway_after = gateway_metrics(gateway)
    for path, n in (("/v1/systemone", 14), ("/v1/systemone/separate", 4), ("/v1/systemone/permute", 2)):
        assert request_count(gateway_after, path, 499) - request_count(before, path, 499) == n


def test_a_failed_call_cancels_the_others_before_its_admission_ends() -> None:
    """A /permute split over several calls (only where the model's limits need it) scores them at once. When one
    fails, the others are cancelled (and with them their Triton calls) before the failure reaches the handler, so
    none runs on once the request's slots are given back: orphaned calls would fill Triton's queue past the
    gateway's in-flight limit."""
    gateway = GatewayService(GatewaySettings(triton_url="127.0.0.1:1"))
    cancelled: list[int] = []

    async def run() -> None:
        others_started = asyncio.Event()
        started: list[int] = []

        async def call(i: int) -> bytes:
            if i == 0:
                await others_started.wait()
                raise KevError("invalid", "the model refused part 0")
            started.append(i)
            if len(started) == 2:
                others_started.set()
            try:
                await asyncio.Event().wait()  # a call that would never end by itself
            except asyncio.CancelledError:
                cancelled.append(i)
                raise
            return b""

        with gateway.admitted(3), pytest.raises(KevError):
            await gather_or_cancel([call(0), call(1), call(2)])
        assert sorted(cancelled) == [1, 2] and gateway.in_flight == 0  # before asyncio.run cancels leftovers

    asyncio.run(run())


def slow_request(gateway: Gateway, declared: int, sent: bytes = b"") -> socket.socket:
    """A socket whose request's head promises `declared` body bytes, of which only `sent` arrive (the rest later)."""
    head = (
        f"POST /v1/systemone HTTP/1.1\r\nhost: kev\r\ncontent-type: application/json\r\n"
        f"content-length: {declared}\r\nconnection: close\r\n\r\n"
    )
    url = urlsplit(gateway.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=60)
    sock.sendall(head.encode() + sent)
    return sock


def test_bodies_still_arriving_hold_no_in_flight_slot(triton: TritonServer, tmp_path: Path) -> None:
    """A client still sending its body holds no in-flight slot: with one slot, another request is answered while it
    sends. Arrivals are bounded apart, by count and by the body bytes they hold (a Content-Length counts at once):
    past either, 429 at once, the body unread; and the slow request is answered once its body is complete."""
    limited = start_gateway(
        triton,
        tmp_path / "limited.log",
        KEV_GATEWAY_MAX_IN_FLIGHT="1",
        KEV_GATEWAY_MAX_ARRIVING="3",
        KEV_GATEWAY_MAX_ARRIVING_BYTES="1500000",
    )
    sockets: list[socket.socket] = []
    try:
        data = json.dumps({"state": f"slow {uuid.uuid4().hex}", "questions": {"urgent": URGENT}}).encode()
        slow = slow_request(limited, len(data), data[:10])
        sockets.append(slow)
        wait_until(lambda: gateway_metrics(limited)["kev_gateway_arriving"] == 1, "the slow request to arrive")
        assert_answered(call_json(limited, "/v1/systemone", BODY, key=None))
        sockets.append(slow_request(limited, 1_000_000))  # holds a million bytes of the 1.5 million
        wait_until(lambda: gateway_metrics(limited)["kev_gateway_arriving_bytes"] >= 1_000_000, "the reservation")
        status, headers, reply = call_json(limited, "/v1/systemone", BODY + b" " * 600_000, key=None)
        assert status == 429 and headers["retry-after"] == "1", reply
        assert reply["detail"].startswith("overloaded: 3 requests arriving (limit 3) holding "), reply
        sockets.append(slow_request(limited, 100))
        wait_until(lambda: gateway_metrics(limited)["kev_gateway_arriving"] == 3, "the third arrival")
        status, headers, reply = call_json(limited, "/v1/systemone", BODY, key=None)
        assert status == 429 and reply["detail"].startswith("overloaded: 3 requests arriving (limit 3)"), reply
        slow.sendall(data[10:])
        answer = b""
        while chunk := slow.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        for sock in sockets[1:]:
            sock.close()
        wait_until(lambda: gateway_metrics(limited)["kev_gateway_arriving"] == 0, "the arrivals to end")
        metrics = gateway_metrics(limited)
        assert (metrics["kev_gateway_arriving_bytes"], metrics["kev_gateway_in_flight"]) == (0, 0)
    finally:
        for sock in sockets:
            sock.close()
        stop_gateway(limited)
