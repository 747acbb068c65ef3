"""The gateway's connections against slow, idle and oversized clients, on the real stack (tritonserver + kev-gateway,
real sockets): head and URL limits before the key, the request id's bounds, deadlines for heads, bodies and idle
connections, the connection limit that closes the connection idle longest, and ordinary clients served throughout
a small-scale version of loadtest/slowclients.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import REPO, Gateway, TritonServer, start_gateway, stop_gateway, wait_until
from tests.helpers import error_detail
from tests.serve.gateway.clients import BODY, KEY, REQUEST_ID, call_json, gateway_metrics

EVENT = 'kev_gateway_connection_events_total{{event="{}"}}'


def connect(gateway: Gateway) -> socket.socket:
    url = urlsplit(gateway.url)
    return socket.create_connection((url.hostname, url.port), timeout=30)


def read_all(sock: socket.socket) -> bytes:
    """Everything until the gateway closes or ends the connection (a reset ends it too)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response[9:12])


def detail_of(response: bytes) -> str:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])["detail"]


def event_count(gateway: Gateway, event: str) -> float:
    return gateway_metrics(gateway)[EVENT.format(event)]


@pytest.fixture(scope="module")
def gateway(triton: TritonServer, tmp_path_factory: pytest.TempPathFactory):
    """A keyed gateway with short deadlines (seconds, so the test waits little; the defaults are 10, 10, 60, 5)."""
    server = start_gateway(
        triton,
        tmp_path_factory.mktemp("front") / "gateway.log",
        KEV_API_KEY=KEY,
        KEV_GATEWAY_HEADER_TIMEOUT_S="1",
        KEV_GATEWAY_BODY_IDLE_TIMEOUT_S="1",
        KEV_GATEWAY_BODY_TIMEOUT_S="3",
        KEV_GATEWAY_KEEPALIVE_TIMEOUT_S="1",
    )
    yield server
    stop_gateway(server)


def send_head(gateway: Gateway, head: bytes, chunk: int = 64 << 10) -> bytes:
    """Sends `head` in chunks from a thread while reading the answer: the gateway may answer (and stop reading)
    before the client is done sending."""
    sock = connect(gateway)

    def send() -> None:
        try:
            for start in range(0, len(head), chunk):
                sock.sendall(head[start : start + chunk])
        except OSError:  # the gateway closed: it had read enough
            pass

    sender = threading.Thread(target=send)
    sender.start()
    try:
        return read_all(sock)
    finally:
        sender.join()
        sock.close()


def test_oversized_heads_and_urls_are_refused_before_the_key(gateway: Gateway) -> None:
    """A 4 MiB header and a 100 KB URL: 431 and 414 with JSON bodies, without the bearer key (answered before any
    middleware), and other clients answered meanwhile."""
    big = b"GET /v1/models HTTP/1.1\r\nhost: kev\r\nx-big: " + b"a" * (4 << 20) + b"\r\n\r\n"
    answer = send_head(gateway, big)
    assert status_of(answer) == 431 and detail_of(answer) == "the request's head is over the 32,768-byte limit"
    long_url = b"GET /v1/models?" + b"q" * 100_000 + b" HTTP/1.1\r\nhost: kev\r\n\r\n"
    answer = send_head(gateway, long_url)
    assert status_of(answer) == 414 and detail_of(answer) == "the request's URL is over the 8,192-byte limit"
    assert call_json(gateway, "/v1/systemone", BODY)[0] == 200
    assert event_count(gateway, "header_too_large") >= 1 and event_count(gateway, "url_too_long") >= 1


def test_a_malformed_request_id_is_refused_never_echoed(gateway: Gateway) -> None:
    """A request id of 1 to 128 visible ASCII characters is echoed; a longer one or one with other characters is a
    400 whose response carries a fresh id, and it reaches neither the log nor Triton."""
    status, headers, _ = call_json(gateway, "/v1/systemone", BODY, {REQUEST_ID: "r" * 128})
    assert status == 200 and headers[REQUEST_ID] == "r" * 128
    for bad in ("x" * 129, "a b", "id\xe9"):
        status, headers, reply = call_json(gateway, "/v1/systemone", BODY, {REQUEST_ID: bad})
        assert status == 400 and error_detail(reply) == {
            "detail": f"the {REQUEST_ID} header must be 1 to 128 visible ASCII characters"
        }, reply
        assert headers[REQUEST_ID] != bad and len(headers[REQUEST_ID]) == 32
    assert "x" * 129 not in gateway.log.read_text()


def test_slow_heads_bodies_and_idle_connections_are_timed_out(gateway: Gateway) -> None:
    """A head that stops (408), a body that stops (408 from the app, JSON), a body that keeps trickling past the
    total deadline (408), a connection that never sends (closed): each bounded by its own deadline."""
    before = {event: event_count(gateway, event) for event in ("header_timeout", "body_timeout", "idle_closed")}
    head = connect(gateway)
    head.sendall(b"POST /v1/systemone HTTP/1.1\r\nhost: kev\r\n")
    stalled = connect(gateway)
    stalled.sendall(
        f"POST /v1/systemone HTTP/1.1\r\nhost: kev\r\nauthorization: Bearer {KEY}\r\n"
        f"content-length: {len(BODY)}\r\n\r\n".encode()
        + BODY[:10]
    )
    idle = connect(gateway)
    trickling = connect(gateway)
    trickling.sendall(
        f"POST /v1/systemone HTTP/1.1\r\nhost: kev\r\nauthorization: Bearer {KEY}\r\n"
        f"content-length: {len(BODY)}\r\n\r\n".encode()
    )
    stop = threading.Event()

    def trickle() -> None:
        for byte in BODY[:-1]:  # never complete: a byte every 0.3 s (the idle deadline is 1 s, the total 3 s)
            if stop.wait(0.3):
                return
            try:
                trickling.sendall(bytes([byte]))
            except OSError:
                return

    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        answer = read_all(head)
        assert status_of(answer) == 408 and detail_of(answer) == "the request's head did not arrive within 1 s"
        answer = read_all(stalled)
        assert status_of(answer) == 408 and b"content-type: application/json" in answer.lower()
        assert detail_of(answer) == "the request body stopped arriving for 1 s"
        assert read_all(idle) == b""  # closed by the gateway, nothing said
        answer = read_all(trickling)
        assert status_of(answer) == 408 and detail_of(answer) == "the request body did not arrive within 3 s"
    finally:
        stop.set()
        sender.join()
        for sock in (head, stalled, idle, trickling):
            sock.close()
    after = {event: event_count(gateway, event) for event in before}
    assert after["header_timeout"] - before["header_timeout"] >= 1
    assert after["body_timeout"] - before["body_timeout"] >= 2
    assert after["idle_closed"] - before["idle_closed"] >= 1
    metrics = gateway_metrics(gateway)
    assert metrics['kev_gateway_errors_total{reason="timeout"}'] >= 2
    assert metrics["kev_gateway_arriving"] == 0 and metrics["kev_gateway_arriving_bytes"] == 0


def test_the_connection_limit_closes_the_connection_idle_longest(triton: TritonServer, tmp_path: Path) -> None:
    """At the limit, a new client is admitted by closing the connection idle longest; when every connection has a
    request in progress, a new one is refused with 503 and retry-after."""
    limited = start_gateway(triton, tmp_path / "gateway.log", KEV_GATEWAY_MAX_CONNECTIONS="20")
    sockets: list[socket.socket] = []
    try:
        for _ in range(20):
            sockets.append(connect(limited))
            time.sleep(0.01)  # opened in order: the first is idle longest
        status, _, reply = call_json(limited, "/v1/systemone", BODY, key=None)
        assert status == 200, reply
        assert read_all(sockets[0]) == b""  # the oldest idle connection made room
        for sock in sockets[1:]:  # every other connection now has a request in progress (a head begun)
            sock.sendall(b"POST /v1/systemone HTTP/1.1\r\n")
        busy = connect(limited)
        busy.sendall(b"POST /v1/systemone HTTP/1.1\r\n")
        sockets.append(busy)
        # 19 heads in progress, `busy` and the connection below: one over the limit, none idle.
        refused = connect(limited)
        sockets.append(refused)
        answer = read_all(refused)
        assert status_of(answer) == 503 and b"retry-after: 1" in answer.lower()
        assert detail_of(answer) == "too many connections; retry later"
        metrics = gateway_metrics_of(limited, sockets)
        assert metrics[EVENT.format("evicted")] >= 1 and metrics[EVENT.format("refused")] >= 1
    finally:
        for sock in sockets:
            sock.close()
        stop_gateway(limited)


def gateway_metrics_of(gateway: Gateway, sockets: list[socket.socket]) -> dict[str, float]:
    """The gateway's metrics once room is made for the scrape's own connection (busy connections closed)."""
    for sock in sockets[:3]:
        sock.close()
    found: list[dict[str, float]] = []

    def scraped() -> bool:
        try:
            found.append(gateway_metrics(gateway))
        except (OSError, ValueError, KeyError):
            return False
        return True

    wait_until(scraped, "a scrape of the gateway's metrics")
    return found[0]


def test_slow_and_idle_clients_at_small_scale(triton: TritonServer, tmp_path: Path) -> None:
    """loadtest/slowclients.py at a small scale against a gateway whose descriptor limit is 1,024 (so its connection
    limit is 896): 2,000 idle sockets (reopened when closed) and 200 slow bodies, half of them stalled. Every
    ordinary request is answered, the stalled bodies are refused with 408, and idle connections are closed or made
    room with; the gateway holds no slot and no arriving body afterwards."""
    limited = start_gateway(
        triton,
        tmp_path / "gateway.log",
        descriptors=1024,
        KEV_GATEWAY_BODY_IDLE_TIMEOUT_S="2",
        KEV_GATEWAY_BODY_TIMEOUT_S="6",
        KEV_GATEWAY_KEEPALIVE_TIMEOUT_S="3",
    )
    out = tmp_path / "slowclients.json"
    try:
        command = [
            sys.executable,
            str(REPO / "loadtest" / "slowclients.py"),
            "--url",
            limited.url,
            "--idle",
            "2000",
            "--slow",
            "200",
            "--processes",
            "2",
            "--clients",
            "2",
            "--reconnect-s",
            "1",
            "--baseline-s",
            "3",
            "--attack-s",
            "10",
            "--out",
            str(out),
        ]
        subprocess.run(command, check=True, timeout=240, capture_output=True)
        result = json.loads(out.read_text())
        print(json.dumps({k: result[k] for k in ("baseline", "attack", "attackers", "gateway_connection_events")}))
        assert result["baseline"]["failures"] == 0 and result["attack"]["failures"] == 0, result
        assert result["attack"]["answered"] > 0
        assert result["attackers"].get("slow answered 408", 0) >= 100  # every stalled body, at least
        events = result["gateway_connection_events"]
        assert events["body_timeout"] >= 100 and events["evicted"] + events["idle_closed"] >= 1000
        assert result["gateway_connections_peak"] < 1000  # under its descriptor limit, whatever the attackers hold
        metrics = gateway_metrics(limited)
        assert metrics["kev_gateway_in_flight"] == 0 and metrics["kev_gateway_arriving_bytes"] == 0
        assert limited.process.poll() is None and "Too many open files" not in limited.log.read_text()
    finally:
        stop_gateway(limited)
