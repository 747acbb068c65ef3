"""The request parameters our doors send beside a System One body, on the real tritonserver: each question's own usage
(what /separate reports), errors the model tags as being about the request itself (and a batch-mate's fault that it
does not), and the routing key's header read alike by Triton's HTTP and gRPC doors."""

from __future__ import annotations

import http.client
import json
import struct
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from kev_backend.protocol import envelope
from kev_backend.protocol.request import STATE_KEY_HEADER
from tests.conftest import TritonServer
from tests.helpers import request, request_array

QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "is this urgent ?"},
    "team": {"type": "choice", "instructions": "route it", "criteria": {"billing": "refunds", "tech": None}},
    "tone": {"type": "score", "instructions": "sentiment", "criteria": ["angry", "neutral", "happy"]},
}


def test_state_keys_and_tags() -> None:
    assert envelope.check_state_key(None) is None
    assert envelope.check_state_key("") is None
    assert envelope.check_state_key("  ") is None  # Triton's HTTP door forwards an empty header as " "
    assert envelope.check_state_key(" 0123abcd ") == "0123abcd"
    for bad in ("a b", "é", "x" * 129, 7, "\x7f"):
        with pytest.raises(envelope.BadParameter, match="visible ASCII"):
            envelope.check_state_key(bad)
    detail = [{"loc": ["body", "state"], "msg": "Field required"}]
    for status, body in ((422, "state is 70,000 tokens"), (422, detail), (500, "kev internal error: x")):
        assert envelope.read_tagged(envelope.tag_error(status, body)) == (status, body)
    for untagged in ("incomplete string data for inference input 'REQUEST'", "kev-error: {not json", "kev-error: 3"):
        assert envelope.read_tagged(untagged) is None
    with pytest.raises(envelope.BadParameter, match="UTF-8"):
        envelope.read_parameters(lambda: b"\xff".decode())


def infer(server: TritonServer, body: dict, **parameters: object) -> dict:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        inp = grpcclient.InferInput("REQUEST", [1, 1], "BYTES")
        inp.set_data_from_numpy(request_array(body))
        return json.loads(client.infer("kev", [inp], parameters=parameters or None).as_numpy("RESPONSE")[0, 0])
    finally:
        client.close()


def test_usage_by_question_is_each_question_asked_alone(triton: TritonServer) -> None:
    body = request("I was charged twice for one order", QUESTIONS)
    whole = infer(triton, body, **{envelope.USAGE_BY_QUESTION: True})
    plain = infer(triton, body)
    assert "questions" not in plain["usage"]
    assert whole["answers"] == plain["answers"]
    by_question = whole["usage"].pop("questions")
    assert whole["usage"] == plain["usage"]
    assert list(by_question) == list(QUESTIONS)
    for qid, question in QUESTIONS.items():
        alone = infer(triton, request("I was charged twice for one order", {qid: question}))
        assert alone["answers"][qid] == whole["answers"][qid]
        assert by_question[qid] == alone["usage"], qid


def tagged_error(server: TritonServer, body: dict | bytes, tagged: bool = True) -> str:
    with pytest.raises(InferenceServerException) as caught:
        infer(server, body, **({envelope.TAGGED_ERRORS: True} if tagged else {}))
    assert str(caught.value.status()) == "StatusCode.INVALID_ARGUMENT"
    return caught.value.message()


def test_the_models_own_refusals_are_tagged_for_a_door_that_asks(triton: TritonServer) -> None:
    missing = {"questions": QUESTIONS}
    status, detail = envelope.read_tagged(tagged_error(triton, missing))
    assert status == 422 and isinstance(detail, list) and detail[0]["loc"] == ["body", "state"]
    assert envelope.read_tagged(tagged_error(triton, missing, tagged=False)) is None  # plain Triton clients: Kev's text
    long_state = request("word " * 70_000, QUESTIONS)
    status, detail = envelope.read_tagged(tagged_error(triton, long_state))
    assert status == 422 and detail.startswith("state is at least")


def malformed_request() -> service_pb2.ModelInferRequest:
    """A BYTES tensor whose length prefix claims more bytes than it holds: Triton accepts it at its door and fails
    the whole batch it lands in while gathering the batch's input."""
    raw = struct.pack("<I", 1_000_000) + b'{"state": "x"}'
    request = service_pb2.ModelInferRequest(model_name="kev")
    tensor = request.inputs.add(name="REQUEST", datatype="BYTES")
    tensor.shape.extend([1, 1])
    request.raw_input_contents.append(raw)
    return request


def test_a_batch_mates_malformed_tensor_is_not_tagged_as_the_requests_own(triton: TritonServer) -> None:
    """Blast radius of Triton 2.51's own failure: good requests batched with the malformed one fail with its message,
    as INVALID_ARGUMENT. They are not tagged, so our doors do not blame the requests for it."""
    channel = grpc.insecure_channel(triton.grpc_url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    good = service_pb2.ModelInferRequest(model_name="kev")
    good.parameters[envelope.TAGGED_ERRORS].bool_param = True
    tensor = good.inputs.add(name="REQUEST", datatype="BYTES")
    tensor.shape.extend([1, 1])
    body = json.dumps(request("hello", {"urgent": QUESTIONS["urgent"]})).encode()
    good.raw_input_contents.append(struct.pack("<I", len(body)) + body)

    def call(message: service_pb2.ModelInferRequest) -> str:
        try:
            stub.ModelInfer(message, timeout=60)
            return "ok"
        except grpc.RpcError as error:
            return error.details()

    try:
        failed: list[str] = []
        for _ in range(5):
            with ThreadPoolExecutor(25) as pool:
                futures = [pool.submit(call, good) for _ in range(12)]
                futures.append(pool.submit(call, malformed_request()))
                futures += [pool.submit(call, good) for _ in range(12)]
                failed += [f.result() for f in futures[:12] + futures[13:] if f.result() != "ok"]
    finally:
        channel.close()
    print(f"good requests failed by a malformed batch-mate: {len(failed)} of 120")
    assert failed, "no good request shared a batch with the malformed one: the blast radius was not exercised"
    assert all("incomplete string data" in message for message in failed), failed[:3]
    assert not any(envelope.read_tagged(message) for message in failed)


def post_infer(server: TritonServer, headers: dict[str, str]) -> tuple[int, dict]:
    host, port = server.http_url.split(":")
    body = json.dumps(request("hello", {"urgent": QUESTIONS["urgent"]}))
    payload = json.dumps({"inputs": [{"name": "REQUEST", "shape": [1, 1], "datatype": "BYTES", "data": [body]}]})
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("POST", "/v2/models/kev/infer", payload, headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_the_routing_key_header_reads_alike_at_every_door(triton: TritonServer) -> None:
    """An empty header is no key at Triton's HTTP and gRPC doors alike; a bad one is refused with the same message at
    both, and one that is not UTF-8 (only HTTP can carry it) with a clean message, not a codec's."""
    assert post_infer(triton, {STATE_KEY_HEADER: ""})[0] == 200
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    inp = grpcclient.InferInput("REQUEST", [1, 1], "BYTES")
    inp.set_data_from_numpy(np.array([[json.dumps(request("hello", QUESTIONS)).encode()]], dtype=np.object_))
    try:
        assert client.infer("kev", [inp], headers={STATE_KEY_HEADER: ""}).as_numpy("RESPONSE") is not None
        with pytest.raises(InferenceServerException) as caught:
            client.infer("kev", [inp], headers={STATE_KEY_HEADER: "a b"})
    finally:
        client.close()
    status, body = post_infer(triton, {STATE_KEY_HEADER: "a b"})
    assert status == 400 and body["error"] == caught.value.message()
    status, body = post_infer(triton, {STATE_KEY_HEADER: "\xff\xfe"})  # http.client sends latin-1 bytes
    assert status == 400 and body["error"] == envelope.UNREADABLE
