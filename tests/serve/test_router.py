"""State-affinity routing: two real tritonservers (kev-serve, tiny model, each with its own state bank) behind the real
Envoy configured by kev_backend.serve.router. A repeated state reaches the server that banked it (read from each
server's kev_bank_hits_total / kev_bank_misses_total), keys spread over both, and a server that dies takes only its
own keys with it: they are answered by the other, the rest stay where they were banked."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kev_backend.dev.ports import free_port
from kev_backend.protocol.request import STATE_KEY_CHARS, state_key, state_key_of
from kev_backend.serve.client import KevClient, prometheus
from kev_backend.serve.router import Server, config
from tests.conftest import REPO, TritonServer, start_triton, stop_triton, wait_ready, wait_until

ENVOY = shutil.which("envoy") or str(Path(sys.prefix) / "bin" / "envoy")


def request(i: int, question: str = "Is it urgent?") -> dict:
    return {
        "state": {"ticket": f"Order {i} arrived broken.", "plan": "pro"},
        "questions": {"q": {"type": "noul", "instructions": question}},
    }


def test_the_state_key_follows_the_rendered_state() -> None:
    body = request(1)
    key = state_key_of(body)
    assert key is not None and re.fullmatch(r"[0-9a-f]{16}", key)
    assert state_key_of(json.dumps(body, indent=4).encode()) == key, "JSON whitespace is not part of the state"
    assert state_key_of(request(1, "Which team?")) == key, "the questions are not part of the state"
    assert state_key_of({**body, "questions": {}}) == key
    # Kev renders keys in order and the model reads them so: another order is another state, in the bank as here.
    assert state_key_of({"state": {"plan": "pro", "ticket": "Order 1 arrived broken."}}) != key
    assert state_key_of(request(2)) != key
    assert state_key_of(b"{not json") is None and state_key_of({"questions": {}}) is None
    # A state that grows at its end keeps its key once past its first STATE_KEY_CHARS characters.
    opening = " ".join(f"message {i} about the late refund" for i in range(60))
    assert len(opening) > STATE_KEY_CHARS
    assert state_key(opening + " and one more") == state_key(opening) != state_key("A reply. " + opening)
    assert state_key_of({"state": [opening, "more"]}) == state_key_of({"state": [opening]})
    keys = [state_key(f"Ticket {i}") for i in range(4096)]
    assert len(set(keys)) == len(keys)
    first = Counter(int(k[0], 16) for k in keys)  # 16 buckets of 256 expected: a uniform hash stays near
    assert max(first.values()) < 330 and min(first.values()) > 190, first


def test_the_clusters_router_config_is_the_generators() -> None:
    """deploy/base/envoy.yaml (the router's ConfigMap in Kubernetes) is what kev_backend.serve.router writes."""
    deployed = yaml.safe_load((REPO / "deploy" / "base" / "envoy.yaml").read_text())
    server = Server("kev-triton.kev.svc.cluster.local", 8001, 8000)
    assert deployed == config(("0.0.0.0", 8001), [server], True, ("127.0.0.1", 9901), ("0.0.0.0", 9902))


@dataclass
class Routed:
    servers: list[TritonServer]
    url: str  # Envoy's listener
    admin: str
    envoy: subprocess.Popen


@pytest.fixture(scope="module")
def routed(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routed]:
    tmp = tmp_path_factory.mktemp("router")
    servers = [start_triton(tiny_dir / "kev", tmp / f"server{i}.log") for i in range(2)]
    listen, admin = free_port(), free_port()
    config = tmp / "envoy.json"
    specs = [f"--server={s.grpc_url}/{s.http_url.rsplit(':', 1)[1]}" for s in servers]
    command = [sys.executable, "-m", "kev_backend.serve.router", f"--listen=127.0.0.1:{listen}", *specs]
    subprocess.run([*command, f"--admin=127.0.0.1:{admin}", f"--out={config}"], check=True)
    log = (tmp / "envoy.log").open("wb")
    envoy = subprocess.Popen(
        [ENVOY, "-c", str(config), "--base-id", str(listen), "-l", "warning"], stdout=log, stderr=subprocess.STDOUT
    )
    routed = Routed(servers, f"127.0.0.1:{listen}", f"http://127.0.0.1:{admin}", envoy)
    try:
        assert wait_ready(f"{routed.admin}/ready", envoy, 30), (tmp / "envoy.log").read_text()
        wait_healthy(routed, 2)
        yield routed
    finally:
        envoy.send_signal(signal.SIGTERM)
        envoy.wait(timeout=10)
        for server in servers:
            if server.process.poll() is None:
                stop_triton(server)


def wait_healthy(routed: Routed, count: int, timeout_s: float = 20) -> float:
    """Seconds until Envoy counts `count` healthy servers."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        with urllib.request.urlopen(f"{routed.admin}/clusters", timeout=10) as reply:
            healthy = sum(
                1
                for line in reply.read().decode().splitlines()
                if line.startswith("kev-triton::") and line.endswith("::health_flags::healthy")
            )
        if healthy == count:
            return time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError(f"Envoy never counted {count} healthy servers")


def bank(server: TritonServer) -> Counter:
    with urllib.request.urlopen(f"http://{server.metrics_url}/metrics", timeout=10) as reply:
        samples = prometheus.parse(reply.read().decode())
    return Counter(
        {name: int(prometheus.total(samples, f"kev_bank_{name}_total")) for name in ("hits", "misses", "prefix_hits")}
    )


def send(routed: Routed, kev: KevClient, i: int | dict) -> int:
    """Sends request i (or this body) through Envoy; the index of the server whose bank saw it (a hit or a miss)."""
    before = [bank(s) for s in routed.servers]
    kev.score(request(i) if isinstance(i, int) else i)
    changed: list[int] = []

    def counted() -> bool:  # the model counts a batch just after its answer leaves
        changed[:] = [n for n, (server, b) in enumerate(zip(routed.servers, before)) if bank(server) != b]
        return bool(changed)

    wait_until(counted, f"request {i} counted by a server's bank", timeout_s=30.0)
    assert len(changed) == 1, changed
    return changed[0]


def test_a_repeated_state_reaches_the_server_that_banked_it(routed: Routed) -> None:
    states = range(100, 160)
    with KevClient(routed.url) as kev:
        first = {i: send(routed, kev, i) for i in states}
        before = [bank(s) for s in routed.servers]
        again = {i: send(routed, kev, i) for i in states}
    after = [bank(s) for s in routed.servers]  # send() waited for each request's count
    assert again == first
    assert sum(a["hits"] - b["hits"] for a, b in zip(after, before)) == len(states), (before, after)
    assert all(a["misses"] == b["misses"] for a, b in zip(after, before))
    share = Counter(first.values())
    # 60 keys over 2 servers: each takes a fair share (a server given none is absent from the counter, so ask each).
    assert all(share[server] >= 0.3 * len(states) for server in range(len(routed.servers))), share


def test_a_growing_conversation_stays_where_its_prefix_is_banked(routed: Routed) -> None:
    """Each turn's state is the turn before's plus a message: its key (the state's beginning) stays, so every turn
    reaches the server that banked the turn before, which computes it from that turn's point (scoring/growth.py)."""
    text = " ".join(f"message {i} about the late refund" for i in range(900))  # past the first 4,096-token chunk
    turns = []
    for turn in range(6):
        text += f" and message {turn} of the conversation asks again about the invoice"
        turns.append({"state": text, "questions": {"q": {"type": "noul", "instructions": "Is it urgent?"}}})
    assert len({state_key_of(body) for body in turns}) == 1
    before = [bank(s) for s in routed.servers]
    with KevClient(routed.url) as kev:
        homes = [send(routed, kev, body) for body in turns]
    assert len(set(homes)) == 1, homes
    after = [bank(s) for s in routed.servers]
    home = homes[0]
    assert after[home]["prefix_hits"] - before[home]["prefix_hits"] == len(turns) - 1
    assert after[home]["misses"] - before[home]["misses"] == len(turns)  # each turn a new state, from a point


def test_a_dead_server_takes_only_its_own_keys(routed: Routed) -> None:
    states = range(200, 260)
    with KevClient(routed.url) as kev:
        home = {i: send(routed, kev, i) for i in states}
        dead = routed.servers[1]
        stop_triton(dead)
        stopped = time.monotonic()
        ejected_after = wait_healthy(routed, 1)
        survivor = routed.servers[0]
        before = bank(survivor)
        for i in states:
            kev.score(request(i))  # every key is answered, the dead server's by the survivor
        answered_after = time.monotonic() - stopped
    wanted = before["hits"] + before["misses"] + len(states)
    wait_until(lambda: sum(bank(survivor).values()) >= wanted, "the survivor's bank counts", timeout_s=30.0)
    after = bank(survivor)
    kept = sum(1 for server in home.values() if server == 0)
    moved = len(states) - kept
    assert kept and moved
    # The survivor's own keys are still banked there: hits. The dead server's keys came over: misses, once each.
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (kept, moved), (before, after)
    print(
        f"\nserver gone: out of Envoy after {ejected_after:.1f} s; its {moved} keys answered by {answered_after:.1f} s"
    )
    assert ejected_after < 5
