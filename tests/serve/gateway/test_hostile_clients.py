"""The System One gateway against hostile or unlucky clients, on the real stack (tritonserver + kev-gateway, tiny
checkpoint): compression bombs, corrupt and oversized bodies, unsupported encodings, CORS with a key, metrics by
reason, readiness and failures as JSON (clients that leave: test_departing_clients.py)."""

from __future__ import annotations

import json
import logging
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from backports.zstd import ZstdCompressor, compress
from starlette.testclient import TestClient

from kev_backend.dev.ports import free_port
from kev_backend.serve.gateway import create_app
from kev_backend.serve.gateway.bodies import MAX_FRAMES, decompress
from kev_backend.serve.gateway.replies import REASONS, Refused
from kev_backend.settings import GatewaySettings
from tests.conftest import Gateway, TritonServer, start_gateway, stop_gateway
from tests.helpers import error_detail
from tests.serve.gateway.clients import (
    BODY,
    KEY,
    QUESTIONS,
    REQUEST_ID,
    URGENT,
    ask,
    assert_answered,
    call,
    call_json,
    error_count,
    gateway_metrics,
    in_parallel,
    peak_rss_bytes,
    request_count,
    sender,
)

LIMIT = 4 << 20  # the default for both byte limits


@pytest.fixture(scope="module")
def gateway(triton: TritonServer, tmp_path_factory: pytest.TempPathFactory):
    server = start_gateway(triton, tmp_path_factory.mktemp("hostile") / "gateway.log", KEV_API_KEY=KEY)
    yield server
    stop_gateway(server)


# --- compressed bodies as bombs --------------------------------------------------------------------------------


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
