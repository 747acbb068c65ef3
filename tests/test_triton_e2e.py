"""End to end on the real tritonserver: concurrent tritonclient calls over HTTP and gRPC, answers equal to the
in-process engine's, real dynamic batches, and bad requests failing alone inside a batch."""

from __future__ import annotations

import asyncio
import json
import queue
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from tritonclient.utils import InferenceServerException

from kev_backend.engine import Engine

from .conftest import TritonServer

TEAMS = {"billing": "payments and refunds", "technical": None, "sales": {"covers": ["plans", "upgrade"]}}
STATES = [
    "my card was charged twice for the same order , please refund one payment",
    {"log": "timeout on login page", "status": 504, "retries": [1, 2.5, None]},
    ["password reset email never arrived", {"customer": "pro plan", "months": 14}],
    "the app crash after the last update , data lost",
    " ".join(["the invoice total was wrong and the refund is late"] * 40),  # ~400 tokens
]


def make_request(i: int) -> dict:
    questions = {
        "urgent": {"type": "noul", "instructions": "is this urgent ?", "criteria": {"true": "reply today"}},
        "team": {"type": "choice", "instructions": f"route ticket {i}", "criteria": TEAMS},
        "tone": {"type": "score", "instructions": "sentiment", "criteria": ["angry", "neutral", "happy"]},
    }
    keep = list(questions)[: 1 + i % 3]  # 1 to 3 questions, states shared between requests
    return {"state": STATES[i % len(STATES)], "model": f"kev-{i}", "questions": {k: questions[k] for k in keep}}


BAD = {
    "missing state": ({"questions": {"q": {"type": "noul"}}}, "state: Field required"),
    "no questions": ({"state": "x", "questions": {}}, "Dictionary should have at least 1 item"),
    "empty choice": (
        {"state": "x", "questions": {"c": {"type": "choice", "criteria": {}}}},
        "criteria must have 1..255 options",
    ),
    "256 levels": (
        {"state": "x", "questions": {"s": {"type": "score", "criteria": list(range(256))}}},
        "List should have at most 255 items",
    ),
}


@pytest.fixture(scope="module")
def expected(tiny_dir: Path) -> list[dict]:
    engine = Engine.from_checkpoint(tiny_dir / "kev")
    return [engine.answer([make_request(i)])[0] for i in range(48)]


def assert_same_answer(actual: dict, expected: dict) -> None:
    """Equal to the in-process engine: the same fields, keys, choices and usage; probabilities may differ only by
    one unit of the 4th decimal (a different batch shape can move fp32 sums across a rounding boundary)."""
    assert actual["model"] == expected["model"] and actual["usage"] == expected["usage"]
    assert set(actual) == {"model", "answers", "usage", "latency_ms"}
    for qid, want in expected["answers"].items():
        got = actual["answers"][qid]
        assert list(got) == list(want)
        for key, value in want.items():
            if isinstance(value, float):
                assert abs(got[key] - value) <= 1.00001e-4, (qid, key)
            elif key == "probabilities":
                assert list(got[key]) == list(value)
                assert all(abs(got[key][k] - v) <= 1.00001e-4 for k, v in value.items()), qid
            else:
                assert got[key] == value, (qid, key)


def request_array(body: dict | bytes) -> np.ndarray:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return np.array([[raw]], dtype=np.object_)


def http_all(server: TritonServer, bodies: list) -> list:
    """All bodies in flight at once over HTTP (asyncio client); each result is a response dict or the exception."""

    async def run() -> list:
        client = httpaio.InferenceServerClient(server.http_url)

        async def one(body: dict | bytes) -> dict | InferenceServerException:
            inp = httpclient.InferInput("REQUEST", [1, 1], "BYTES")
            inp.set_data_from_numpy(request_array(body))
            try:
                result = await client.infer("kev", [inp])
            except InferenceServerException as error:
                return error
            return json.loads(result.as_numpy("RESPONSE")[0, 0])

        try:
            return await asyncio.gather(*(one(body) for body in bodies))
        finally:
            await client.close()

    return asyncio.run(run())


def grpc_all(server: TritonServer, bodies: list) -> list:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    done: queue.Queue = queue.Queue()
    try:
        for i, body in enumerate(bodies):
            inp = grpcclient.InferInput("REQUEST", [1, 1], "BYTES")
            inp.set_data_from_numpy(request_array(body))
            client.async_infer("kev", [inp], callback=lambda result, error, i=i: done.put((i, result, error)))
        results: list = [None] * len(bodies)
        for _ in bodies:
            i, result, error = done.get(timeout=120)
            results[i] = error if error is not None else json.loads(result.as_numpy("RESPONSE")[0, 0])
        return results
    finally:
        client.close()


def batch_sizes(server: TritonServer) -> dict[int, int]:
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        stats = client.get_inference_statistics("kev")["model_stats"][0]
    finally:
        client.close()
    return {s["batch_size"]: int(s["compute_infer"]["count"]) for s in stats["batch_stats"]}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_concurrent_answers_equal_the_engine(triton: TritonServer, expected: list[dict], protocol: str) -> None:
    send = http_all if protocol == "http" else grpc_all
    before = batch_sizes(triton)
    results = send(triton, [make_request(i) for i in range(len(expected))])
    for result, want in zip(results, expected, strict=True):
        assert isinstance(result, dict), result
        assert_same_answer(result, want)
    ran = {size: n - before.get(size, 0) for size, n in batch_sizes(triton).items() if n > before.get(size, 0)}
    print(protocol, "batch sizes", ran)
    assert any(size > 1 for size in ran), f"no batch larger than 1 ran: {ran}"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_requests_fail_alone_inside_batches(triton: TritonServer, expected: list[dict], protocol: str) -> None:
    send = http_all if protocol == "http" else grpc_all
    bad = list(BAD.values()) + [(b'{"state": "x", "questions": ', "JSON decode error")]
    bodies: list = [make_request(i) for i in range(32)]
    positions = [3, 9, 15, 21, 27]
    for position, (body, _) in zip(positions, bad):
        bodies.insert(position, body)
    results = send(triton, bodies)
    for position, (_, message) in zip(positions, bad):
        error = results[position]
        assert isinstance(error, InferenceServerException), error
        assert message in error.message()
        assert str(error.status()) in ("400", "StatusCode.INVALID_ARGUMENT")
    good = [r for i, r in enumerate(results) if i not in positions]
    for result, want in zip(good, expected[:32], strict=True):
        assert_same_answer(result, want)
    # The server keeps serving.
    assert_same_answer(send(triton, [make_request(40)])[0], expected[40])


def test_several_requests_in_one_call(triton: TritonServer, expected: list[dict]) -> None:
    client = httpclient.InferenceServerClient(triton.http_url)
    try:
        array = np.array([[json.dumps(make_request(i)).encode()] for i in range(3)], dtype=np.object_)
        inp = httpclient.InferInput("REQUEST", list(array.shape), "BYTES")
        inp.set_data_from_numpy(array)
        out = client.infer("kev", [inp]).as_numpy("RESPONSE")
        assert out.shape == (3, 1)
        for i in range(3):
            assert_same_answer(json.loads(out[i, 0]), expected[i])
        # One bad element fails that call, and says which element.
        array[1, 0] = b'{"state": "x"}'
        inp.set_data_from_numpy(array)
        with pytest.raises(InferenceServerException, match=r"REQUEST\[1\]: questions: Field required"):
            client.infer("kev", [inp])
    finally:
        client.close()


def test_admin_apis_are_restricted(triton: TritonServer) -> None:
    client = httpclient.InferenceServerClient(triton.http_url)
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_model_repository_index()
        with pytest.raises(InferenceServerException):
            client.unload_model("kev")
        assert client.is_model_ready("kev")
    finally:
        client.close()
