"""The gateway's access log (kev_backend/serve/gateway/access.py) and request ids, against the real gateway and
Triton: one JSON line a request when its response is sent, with the request id the client sent (or a fresh one), the
route (never a path that is not one), status, latency, bytes in and out and the state's routing key; every JSON error
body names its request id; KEV_GATEWAY_ACCESS_LOG=0 turns the lines off."""

from __future__ import annotations

import json
import time
from pathlib import Path

from kev_backend.protocol.request import state_key_of
from kev_backend.serve.gateway.replies import REQUEST_ID
from tests.conftest import TritonServer, start_gateway, stop_gateway
from tests.helpers import post

BODY = {"state": "access log: my card was charged twice", "questions": {"q": {"type": "noul", "instructions": "?"}}}


def access_lines(log: Path, count: int) -> list[dict]:
    """The log's access lines (JSON objects with a request_id), once there are `count` of them."""
    deadline = time.monotonic() + 30
    while True:
        lines = [json.loads(line) for line in log.read_text(errors="replace").splitlines() if line.startswith("{")]
        found = [line for line in lines if "request_id" in line]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_every_request_gets_its_line_and_every_error_its_id(triton: TritonServer, tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    gateway = start_gateway(triton, log)
    try:
        raw = json.dumps(BODY).encode()
        status, headers, _ = post(gateway, "/v1/systemone", raw, **{REQUEST_ID: "acc-1"})
        assert status == 200 and headers[REQUEST_ID] == "acc-1"
        status, headers, reply = post(
            gateway, "/v1/systemone", {"state": "x", "questions": {}}, **{REQUEST_ID: "acc-2"}
        )
        assert status == 422 and reply["request_id"] == "acc-2" and reply["detail"]
        status, headers, reply = post(gateway, "/v1/secret-path-9f3", raw)
        assert status == 404 and reply["request_id"] == headers[REQUEST_ID] and len(reply["request_id"]) == 32
        lines = {line["request_id"]: line for line in access_lines(log, 3)}
    finally:
        stop_gateway(gateway)
    answered = lines["acc-1"]
    assert answered["route"] == "/v1/systemone" and answered["status"] == 200 and answered["method"] == "POST"
    assert answered["bytes_in"] == len(raw) and answered["bytes_out"] > 0 and answered["latency_ms"] > 0
    assert answered["state_key"] == state_key_of(BODY) and answered["time"].endswith("Z")
    refused = lines["acc-2"]
    assert refused["status"] == 422 and refused["state_key"] is None and refused["bytes_out"] > 0
    # start_gateway's readiness checks (GET /health) have lines too; the unknown path is the one "other"
    (other,) = [line for line in lines.values() if line["route"] == "other"]
    assert other["status"] == 404 and other["method"] == "POST"
    assert "secret-path-9f3" not in log.read_text(errors="replace")


def test_the_access_log_can_be_turned_off(triton: TritonServer, tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    gateway = start_gateway(triton, log, KEV_GATEWAY_ACCESS_LOG="0")
    try:
        assert post(gateway, "/v1/systemone", BODY, **{REQUEST_ID: "quiet-1"})[0] == 200
    finally:
        stop_gateway(gateway)
    assert "quiet-1" not in log.read_text(errors="replace")
