"""The gateway's calls to Triton on the real stack (tritonserver + kev-gateway, tiny checkpoint): /separate and
/permute as one call each (the same answers, the state sent once, the gateway's memory back to its baseline after
large ones), Triton's failures reported to the request they are about, non-finite numbers in 422s, /permute's body
read as the other routes read theirs, and GET /v1/models cached and admitted."""

from __future__ import annotations

import http.server
import json
import os
import signal
import struct
import subprocess
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from kev_backend.serve.supervisor import procs
from tests.conftest import (
    Gateway,
    TritonServer,
    metric_values,
    start_gateway,
    start_triton,
    stop_gateway,
    stop_triton,
    wait_until,
)
from tests.helpers import error_detail
from tests.serve.gateway.clients import call_json, gateway_metrics

URGENT = {"type": "noul", "instructions": "is this urgent ?", "criteria": {"true": "reply today"}}
TEAM = {"type": "choice", "instructions": "route it", "criteria": {"billing": "refunds", "tech": None, "sales": "x"}}
TONE = {"type": "score", "instructions": "sentiment", "criteria": ["angry", "neutral", "happy"]}
QUESTIONS = {"urgent": URGENT, "team": TEAM, "tone": TONE}
STATE = "my card was charged twice for the same order , please refund"


@pytest.fixture(scope="module")
def gateway(triton: TritonServer, tmp_path_factory: pytest.TempPathFactory):
    server = start_gateway(triton, tmp_path_factory.mktemp("calls") / "gateway.log")
    yield server
    stop_gateway(server)


def post(gateway: Gateway, path: str, body: bytes | dict, headers: dict[str, str] | None = None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return call_json(gateway, path, data, headers, key=None)


def triton_calls(triton: TritonServer) -> float:
    return metric_values(triton).get("nv_inference_request_success", 0.0)


def rss_bytes(gateway: Gateway) -> int:
    for line in Path(f"/proc/{gateway.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc status")


def close(a: object, b: object) -> bool:
    """Equal, but for probabilities (rounded to Kev's 4 decimals) that may differ by one in the last: on the CPU's
    reference path a state's questions asked together run padded into one pass, alone each in its own, and fp32 sums
    in another order can move a rounded digit (the fused GPU path gives the same bits either way:
    tests/gpu/test_determinism.py)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1.5e-4
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    return a == b


# --- one call each ----------------------------------------------------------------------------------------------------


def test_separate_and_permute_are_one_triton_call(triton: TritonServer, gateway: Gateway) -> None:
    """/separate's three questions and /permute's five orders each reach Triton as one request, with the answers and
    usage of each question asked alone."""
    state = f"{STATE} {uuid.uuid4().hex}"
    body = {"state": state, "questions": QUESTIONS}
    alone = {
        qid: post(gateway, "/v1/systemone", {"state": state, "questions": {qid: q}})[2] for qid, q in QUESTIONS.items()
    }
    before = triton_calls(triton)
    status, _, separate = post(gateway, "/v1/systemone/separate", body)
    assert status == 200 and triton_calls(triton) - before == 1, separate
    assert list(separate["answers"]) == list(QUESTIONS) and list(separate) == [
        "model",
        "answers",
        "usage",
        "latency_ms",
    ]
    for qid, reply in alone.items():
        assert close(separate["answers"][qid], reply["answers"][qid]), (qid, separate["answers"][qid], reply)
    # Kev counts output tokens of the answers' text: an answer whose rounded last digit moved (above) may count one
    # token more or less, so those answers' counts may differ by one each.
    moved = sum(separate["answers"][qid] != reply["answers"][qid] for qid, reply in alone.items())
    assert separate["usage"]["input_tokens"] == sum(r["usage"]["input_tokens"] for r in alone.values())
    output = sum(r["usage"]["output_tokens"] for r in alone.values())
    assert abs(separate["usage"]["output_tokens"] - output) <= moved, (separate["usage"], output, moved)
    before = triton_calls(triton)
    status, _, permuted = post(gateway, "/v1/systemone/permute", {"request": body, "question": "team", "n_perm": 5})
    assert status == 200 and triton_calls(triton) - before == 1, permuted
    assert len(permuted["runs"]) == 5 and len({run["latency_ms"] for run in permuted["runs"]}) == 1
    for run in permuted["runs"]:  # each order asked alone gets the same answer
        order = {k: TEAM["criteria"][k] for k in run["order"]}
        reply = post(gateway, "/v1/systemone", {"state": state, "questions": {"team": {**TEAM, "criteria": order}}})[2]
        assert close(run["probabilities"], reply["answers"]["team"]["probabilities"])
        assert run["choice"] == reply["answers"]["team"]["choice"]


def test_large_separates_leave_the_gateways_memory_at_its_baseline(triton: TritonServer, tmp_path: Path) -> None:
    """21 /separate requests of 3.9 MB with 256 questions each, whose state the model refuses (over 65,536 tokens):
    each a 422, and the gateway's resident memory back within 10 % of its baseline after them. (Sent one by one,
    and stopped early past 2 GB of growth: one request per question with the whole state took the gateway from 0.7
    to 4.0 GB.)"""
    gateway = start_gateway(triton, tmp_path / "gateway.log")
    try:
        small = {"state": STATE, "questions": QUESTIONS}
        assert post(gateway, "/v1/systemone/separate", small)[0] == 200  # the first call's one-time costs
        assert post(gateway, "/v1/systemone/permute", {"request": small, "question": "team"})[0] == 200
        time.sleep(0.5)
        baseline = rss_bytes(gateway)
        questions = {f"q{i}": {"type": "noul", "instructions": f"question {i} ?"} for i in range(256)}
        body = json.dumps({"state": "refund " * 560_000, "questions": questions}).encode()
        assert 3_900_000 < len(body) < 4 << 20
        peak = baseline
        for i in range(21):
            status, _, reply = post(gateway, "/v1/systemone/separate", body)
            assert status == 422 and "over the 65,536-token limit" in reply["detail"], reply
            peak = max(peak, rss_bytes(gateway))
            assert peak < baseline + (2 << 30), f"request {i}: {peak / 2**20:.0f} MiB from {baseline / 2**20:.0f} MiB"
        settled: list[int] = []

        def back() -> bool:
            settled.append(rss_bytes(gateway))
            return settled[-1] <= baseline * 1.10

        wait_until(back, "the gateway's memory to return to its baseline", timeout_s=15)
        print(
            f"\ngateway RSS: baseline {baseline / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB over 21 x 3.9 MB "
            f"/separate, then {settled[-1] / 2**20:.1f} MiB"
        )
    finally:
        stop_gateway(gateway)


# --- Triton's failures ------------------------------------------------------------------------------------------------


def test_the_models_own_refusal_keeps_its_status(triton: TritonServer, tmp_path: Path) -> None:
    """A gateway that takes 8 MiB bodies in front of a model that takes 4 MiB: the model's 413 (tagged as the
    request's own) is the client's 413 with the model's message."""
    wide = start_gateway(
        triton, tmp_path / "gateway.log", KEV_GATEWAY_MAX_BODY_BYTES="8388608", KEV_GATEWAY_MAX_DECODED_BYTES="8388608"
    )
    try:
        body = json.dumps({"state": "refund " * 750_000, "questions": {"urgent": URGENT}}).encode()
        status, _, reply = post(wide, "/v1/systemone", body)
        assert status == 413 and error_detail(reply) == {
            "detail": f"request body is {len(body):,} bytes, over the 4,194,304-byte limit"
        }
        status, _, reply = post(wide, "/v1/systemone", {"questions": {"urgent": URGENT}})  # the gateway's own 422
        assert status == 422 and reply["detail"][0]["loc"] == ["body", "state"]
    finally:
        stop_gateway(wide)


def malformed_request() -> service_pb2.ModelInferRequest:
    """A BYTES tensor whose length prefix claims more bytes than it holds: Triton fails the whole batch it lands in,
    every request of it with this request's message (tests/protocol/test_envelope.py)."""
    request = service_pb2.ModelInferRequest(model_name="kev")
    tensor = request.inputs.add(name="REQUEST", datatype="BYTES")
    tensor.shape.extend([1, 1])
    request.raw_input_contents.append(struct.pack("<I", 1_000_000) + b'{"state": "secret of another client"}')
    return request


def test_a_batch_mates_fault_is_a_neutral_503(triton: TritonServer, gateway: Gateway) -> None:
    """Gateway requests batched with another client's malformed tensor (sent to Triton's gRPC port) fail with Triton's
    INVALID_ARGUMENT quoting that tensor: the gateway answers them 503 with retry-after and a message of its own."""
    channel = grpc.insecure_channel(triton.grpc_url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

    def bad() -> str:
        try:
            stub.ModelInfer(malformed_request(), timeout=60)
        except grpc.RpcError as error:
            return error.details()
        return "ok"

    body = json.dumps({"state": "hello", "questions": {"urgent": URGENT}}).encode()
    failed: list[tuple[int, dict, dict]] = []
    try:
        for _ in range(10):
            with ThreadPoolExecutor(25) as pool:
                good = [pool.submit(post, gateway, "/v1/systemone", body) for _ in range(12)]
                malformed = pool.submit(bad)
                good += [pool.submit(post, gateway, "/v1/systemone", body) for _ in range(12)]
                results = [future.result() for future in good]
            assert "incomplete string data" in malformed.result()
            failed += [result for result in results if result[0] != 200]
            if failed:
                break
    finally:
        channel.close()
    assert failed, "no gateway request shared a batch with the malformed one: the blast radius was not exercised"
    for status, headers, reply in failed:
        assert status == 503 and headers["retry-after"] == "1", reply
        assert reply["detail"].startswith("the model server could not answer this request now (request id ")
        assert "secret" not in reply["detail"] and "incomplete" not in reply["detail"]
    assert "incomplete string data" in gateway.log.read_text()  # the real message is logged


def test_a_dead_stub_and_a_restarting_triton_are_503s(tiny_dir: Path, tmp_path: Path) -> None:
    """The Python stub killed: kev-serve restarts Triton. Every request the gateway could not answer meanwhile is a
    503 with retry-after (the stub not healthy, then Triton unreachable), never a 500."""
    server = start_triton(tiny_dir / "kev", tmp_path / "triton.log")
    gateway = start_gateway(server, tmp_path / "gateway.log")
    try:
        body = {"state": "hello", "questions": {"urgent": URGENT}}
        assert post(gateway, "/v1/systemone", body)[0] == 200
        stub = procs.descendant_named(server.process.pid, procs.STUB_COMM)
        assert stub is not None
        os.kill(stub, signal.SIGKILL)
        failures: list[tuple[int, dict, dict]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            result = post(gateway, "/v1/systemone", body)
            if result[0] == 200 and failures:
                break
            if result[0] != 200:
                failures.append(result)
            time.sleep(0.05)
        print(f"\n{len(failures)} requests refused while the stub was dead or Triton restarting")
        assert failures, "no request was sent while the stub was dead"
        for status, headers, reply in failures:
            assert status == 503 and headers["retry-after"] == "1", reply
            assert reply["detail"].startswith("the model server could not answer this request now")
        assert gateway_metrics(gateway)['kev_gateway_errors_total{reason="unavailable"}'] == len(failures)
    finally:
        stop_gateway(gateway)
        stop_triton(server)


# A tritonserver in a mount namespace of its own whose /dev/shm is a small tmpfs: the Python backend's shared memory
# runs out for a large request, as it does on a host or pod whose /dev/shm is full.
SMALL_SHM = ("unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=4m tmpfs /dev/shm && exec "$0"')


def test_shared_memory_exhaustion_is_a_neutral_503(tiny_dir: Path, tmp_path: Path) -> None:
    """Triton's "Failed to increase the shared memory pool size for key '<region>'" (untagged): the request that hit
    it is answered 503 with retry-after and a message that names no region; a small request is answered."""
    probe = subprocess.run([*SMALL_SHM, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here (unshare needs CAP_SYS_ADMIN): {probe.stderr.decode()[:200]}")
    server = start_triton(tiny_dir / "kev", tmp_path / "triton.log", wrapper=SMALL_SHM)
    gateway = start_gateway(server, tmp_path / "gateway.log")
    try:
        assert post(gateway, "/v1/systemone", {"state": "hello", "questions": {"urgent": URGENT}})[0] == 200
        body = json.dumps({"state": "refund " * 550_000, "questions": {"urgent": URGENT}}).encode()  # 3.85 MB
        status, headers, reply = post(gateway, "/v1/systemone", body)
        assert status == 503 and headers["retry-after"] == "1", reply
        assert reply["detail"].startswith("the model server could not answer this request now (request id ")
        assert "kev_serve" not in reply["detail"] and "shared memory" not in reply["detail"]
        assert "Failed to increase the shared memory pool size" in gateway.log.read_text()  # logged as it was
        assert post(gateway, "/v1/systemone", {"state": "hello again", "questions": {"urgent": URGENT}})[0] == 200
    finally:
        stop_gateway(gateway)
        stop_triton(server)


# --- bodies -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_echoed_in_a_422_are_null(gateway: Gateway, value: str) -> None:
    """Python's JSON reads NaN and ±Infinity; a 422 that echoes one in its `input` writes it as null (pydantic's JSON
    mode), never a 500 for a body that cannot be written."""
    bodies = [
        ("/v1/systemone", f'{{"state": "x", "questions": {value}}}'),
        ("/v1/systemone", f'{{"state": "x", "questions": {{"q": {{"type": "noul", "criteria": {value}}}}}}}'),
        ("/v1/systemone", f'{{"state": "x", "model": {value}, "questions": {{"q": {{"type": "noul"}}}}}}'),
        ("/v1/systemone", f'{{"state": "x", "questions": {{"q": {{"type": "score", "criteria": {value}}}}}}}'),
        ("/v1/systemone", value),
        ("/v1/systemone/separate", f'{{"state": "x", "questions": {{"q": [{value}, 1.5]}}}}'),
        ("/v1/systemone/permute", f'{{"request": {value}, "question": "q"}}'),
        (
            "/v1/systemone/permute",
            f'{{"request": {{"state": "x", "questions": {{}}}}, "question": "q", "n_perm": {value}}}',
        ),
    ]
    for path, body in bodies:
        status, _, reply = post(gateway, path, body.encode())
        assert status == 422, (path, body, reply)
        text = json.dumps(reply)
        assert "NaN" not in text and "Infinity" not in text and "null" in text, (path, body, reply)


def test_permute_reads_its_body_as_the_other_routes(gateway: Gateway) -> None:
    """A UTF-8 BOM, UTF-16 and UTF-32 bodies are read as Starlette reads them, as /v1/systemone does; n_perm and seed
    are JSON integers only (422 in FastAPI's shape for "6", 6.0, true)."""
    envelope = {"request": {"state": STATE, "questions": QUESTIONS}, "question": "team", "n_perm": 3, "seed": 1}
    encodings = {
        "utf-8 with a BOM": lambda text: b"\xef\xbb\xbf" + text.encode(),
        "utf-16": lambda text: text.encode("utf-16"),
        "utf-16-be": lambda text: text.encode("utf-16-be"),
        "utf-32": lambda text: text.encode("utf-32"),
    }
    for name, encode in encodings.items():
        assert post(gateway, "/v1/systemone", encode(json.dumps(envelope["request"])))[0] == 200, name
        status, _, reply = post(gateway, "/v1/systemone/permute", encode(json.dumps(envelope)))
        assert status == 200 and len(reply["runs"]) == 3, (name, reply)
    for field in ("n_perm", "seed"):
        for value in ("6", 6.0, True):
            status, _, reply = post(gateway, "/v1/systemone/permute", {**envelope, field: value})
            assert status == 422, (field, value, reply)
            error = reply["detail"][0]
            assert error["loc"] == ["body", field] and error["type"] == "int_type" and error["input"] == value
            assert error["msg"] == "Input should be a valid integer"


# --- GET /v1/models ---------------------------------------------------------------------------------------------------


class CountingMetrics(http.server.ThreadingHTTPServer):
    """Triton's metrics text as served once by the real port, served again slowly and counted: a stand-in metrics
    port for the gateway's /v1/models."""

    def __init__(self, text: bytes, delay_s: float) -> None:
        self.text, self.delay_s, self.scrapes = text, delay_s, 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.scrapes += 1
                time.sleep(outer.delay_s)
                self.send_response(200)
                self.send_header("content-length", str(len(outer.text)))
                self.end_headers()
                self.wfile.write(outer.text)

            def log_message(self, *_: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def test_models_is_cached_and_admitted(triton: TritonServer, tmp_path: Path) -> None:
    """200 GET /v1/models, 50 at a time, cost a few scrapes of Triton's metrics, not one each; and with 8 in-flight
    slots, /v1/models is admitted like other work (429 while they are taken)."""
    with urllib.request.urlopen(f"http://{triton.metrics_url}/metrics", timeout=10) as response:
        metrics = CountingMetrics(response.read(), delay_s=0.5)
    server = threading.Thread(target=metrics.serve_forever, daemon=True)
    server.start()
    url = f"127.0.0.1:{metrics.server_address[1]}"
    gateway = start_gateway(triton, tmp_path / "gateway.log", metrics_url=url, KEV_GATEWAY_MAX_IN_FLIGHT="8")
    try:

        def models() -> int:
            status, _, reply = call_json(gateway, "/v1/models", None, key=None, method="GET")
            assert status in (200, 429), reply
            if status == 200:
                assert reply["models"][0]["serving"]["bank_misses"] >= 0
            return status

        started = time.monotonic()
        with ThreadPoolExecutor(50) as pool:
            statuses = list(pool.map(lambda _: models(), range(200)))
        elapsed = time.monotonic() - started
        print(f"\n200 GET /v1/models: {metrics.scrapes} scrapes in {elapsed:.1f} s; {statuses.count(429)} refused 429")
        assert metrics.scrapes <= elapsed / 1.0 + 2  # at most one a second (MODELS_FRESH_S), one at a time
        assert 200 in statuses and 429 in statuses  # refused while 8 calls held the slots, waiting on a scrape
    finally:
        stop_gateway(gateway)
        metrics.shutdown()
