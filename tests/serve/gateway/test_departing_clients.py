"""Clients that leave the gateway before their answer, on the real stack (tritonserver + kev-gateway, tiny
checkpoint): their Triton calls are cancelled and never scored, a failed call cancels its request's other calls, and
a client still sending its body holds no in-flight slot."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from kev_backend.engine.pipeline import PREPARE_APART_BYTES
from kev_backend.serve.client import KevError
from kev_backend.serve.gateway.answering import gather_or_cancel
from kev_backend.serve.gateway.service import Gateway as GatewayService
from kev_backend.settings import GatewaySettings
from tests.conftest import Gateway, TritonServer, settled, start_gateway, stop_gateway, wait_until
from tests.serve.gateway.clients import (
    BODY,
    KEY,
    QUESTIONS,
    URGENT,
    ask,
    assert_answered,
    call_json,
    error_count,
    gateway_metrics,
    request_count,
    triton_metrics,
)


@pytest.fixture(scope="module")
def gateway(triton: TritonServer, tmp_path_factory: pytest.TempPathFactory):
    server = start_gateway(triton, tmp_path_factory.mktemp("departing") / "gateway.log", KEV_API_KEY=KEY)
    yield server
    stop_gateway(server)


def open_request(
    gateway: Gateway, declared: int, sent: bytes = b"", path: str = "/v1/systemone", key: str | None = None
) -> socket.socket:
    """A socket whose request's head promises `declared` body bytes, of which `sent` have been sent."""
    head = f"POST {path} HTTP/1.1\r\nhost: kev\r\ncontent-type: application/json\r\ncontent-length: {declared}\r\n"
    if key:
        head += f"authorization: Bearer {key}\r\n"
    url = urlsplit(gateway.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=60)
    sock.sendall(head.encode() + b"connection: close\r\n\r\n" + sent)
    return sock


def raw_request(gateway: Gateway, path: str, body: dict) -> socket.socket:
    """A socket that has sent one whole request and will never read the answer."""
    data = json.dumps(body).encode()
    return open_request(gateway, len(data), data, path, KEY)


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
        slow = open_request(limited, len(data), data[:10])
        sockets.append(slow)
        wait_until(lambda: gateway_metrics(limited)["kev_gateway_arriving"] == 1, "the slow request to arrive")
        assert_answered(call_json(limited, "/v1/systemone", BODY, key=None))
        sockets.append(open_request(limited, 1_000_000))  # holds a million bytes of the 1.5 million
        wait_until(lambda: gateway_metrics(limited)["kev_gateway_arriving_bytes"] >= 1_000_000, "the reservation")
        status, headers, reply = call_json(limited, "/v1/systemone", BODY + b" " * 600_000, key=None)
        assert status == 429 and headers["retry-after"] == "1", reply
        assert reply["detail"].startswith("overloaded: 3 requests arriving (limit 3) holding "), reply
        sockets.append(open_request(limited, 100))
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
