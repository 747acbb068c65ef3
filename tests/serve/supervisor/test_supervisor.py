"""kev-serve (kev_backend/serve/supervisor/, run by build/serve.sh) around the real tritonserver and gateway: a killed
Python stub or gateway is restarted and answering again, with errors (not silence) meanwhile; SIGTERM stops
everything within seconds and leaves no shared memory; Triton binds loopback only; a start that never becomes ready
exits non-zero with the reason."""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from ctypes.util import find_library
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from kev_backend.dev.ports import free_port
from kev_backend.protocol import envelope
from kev_backend.serve.stub.heartbeat import Heartbeat
from kev_backend.serve.supervisor import procs, supervisor
from kev_backend.serve.supervisor.children import SHM_PREFIX, remove_stale_shm, shm_prefix
from kev_backend.serve.supervisor.probe import QUEUE_FULL
from kev_backend.serve.supervisor.procs import children
from kev_backend.serve.supervisor.progress import Watch
from kev_backend.serve.supervisor.shm import SHM_DIR
from kev_backend.serve.supervisor.supervisor import RestartBudget
from kev_backend.settings import ServeSettings
from tests.conftest import REPO, TritonServer, metric_values, start_triton, stop_triton, wait_ready, wait_until

API_KEY = f"bearer-{secrets.token_hex(8)}"
BODY = {"state": "my card was charged twice", "questions": {"urgent": {"type": "noul", "instructions": "urgent ?"}}}


@dataclass
class Served:
    triton: TritonServer
    gateway_url: str
    admin_key: str

    @property
    def pid(self) -> int:
        return self.triton.process.pid


@pytest.fixture(scope="module")
def served(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """build/serve.sh with the gateway and the inference probe on, Triton on its default address."""
    tmp = tmp_path_factory.mktemp("supervisor")
    key = f"chosen-{secrets.token_hex(8)}"
    (tmp / "admin-key").write_text(key + "\n")
    port = free_port()
    server = start_triton(
        tiny_dir / "kev",
        tmp / "serve.log",
        GATEWAY="1",
        GATEWAY_PORT=str(port),
        KEV_PROBE_INTERVAL_S="1",
        TRITON_ADMIN_KEY_FILE=str(tmp / "admin-key"),
        KEV_API_KEY=API_KEY,
    )
    served = Served(server, f"http://127.0.0.1:{port}", key)
    if not wait_ready(f"{served.gateway_url}/health", server.process, 60):
        stop_triton(server)
        pytest.fail(f"gateway not ready:\n{server.log_tail()}")
    wait_for_log(server, "tritonserver ready after")  # the supervisor has seen it ready (and found its stub)
    yield served
    stop_triton(server)


def child_named(pid: int, comm: str) -> int:
    (found,) = [child for child, name in children(pid).items() if name == comm]
    return found


def gateway_child(pid: int) -> int:
    """The gateway among the supervisor's children: a python running `-m kev_backend.serve.gateway`."""
    (found,) = [
        child for child in children(pid) if b"kev_backend.serve.gateway" in Path(f"/proc/{child}/cmdline").read_bytes()
    ]
    return found


def gone(pid: int) -> bool:
    stat = procs.proc_stat(pid)
    return stat is None or stat[1] == "Z"


def infer(url: str, timeout_s: float) -> tuple[dict | None, str | None, float]:
    """One request on a fresh connection: (answer, None, seconds) or (None, error, seconds)."""
    client = grpcclient.InferenceServerClient(url)
    tensor = grpcclient.InferInput("REQUEST", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[json.dumps(BODY).encode()]], dtype=object))
    started = time.monotonic()
    try:
        result = client.infer("kev", [tensor], client_timeout=timeout_s)
        return json.loads(result.as_numpy("RESPONSE")[0, 0]), None, time.monotonic() - started
    except InferenceServerException as error:
        return None, f"{error.status()} {error.message()}", time.monotonic() - started
    finally:
        client.close()


def wait_for_log(server: TritonServer, text: str, timeout_s: float = 15.0, times: int = 1) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = server.log.read_text(errors="replace")
        if log.count(text) >= times:
            return log
        time.sleep(0.2)
    pytest.fail(f"{text!r} not logged:\n{server.log_tail()}")


def listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} writes them) of the sockets listening on `port`."""
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, local_port = fields[1].split(":")
            if int(local_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                addresses.append(address)
    return addresses


LOOPBACK = {
    "0100007F",  # 127.0.0.1
    "0000000000000000FFFF00000100007F",  # ::ffff:127.0.0.1
    "00000000000000000000000001000000",  # ::1
}


def test_ports_bind_loopback_only(served: Served) -> None:
    ports = [int(url.rsplit(":", 1)[1]) for url in (served.triton.http_url, served.triton.grpc_url)]
    ports += [int(served.triton.metrics_url.rsplit(":", 1)[1]), int(served.gateway_url.rsplit(":", 1)[1])]
    for port in ports:
        addresses = listening(port)
        assert addresses and set(addresses) <= LOOPBACK, (port, addresses)


def test_admin_key_from_file_only_in_tritonservers_argv(served: Served) -> None:
    own = Path(f"/proc/{served.pid}/cmdline").read_bytes()
    assert served.admin_key.encode() not in own and b"admin-key" not in own
    triton = child_named(served.pid, "tritonserver")
    assert f"admin-key={served.admin_key}".encode() in Path(f"/proc/{triton}/cmdline").read_bytes()
    url = f"http://{served.triton.http_url}/v2/repository/index"
    with pytest.raises(urllib.request.HTTPError):
        urllib.request.urlopen(urllib.request.Request(url, data=b"{}"), timeout=10)
    request = urllib.request.Request(url, data=b"{}", headers={"admin-key": served.admin_key})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.loads(response.read())[0]["name"] == "kev"


def test_stale_regions_are_those_of_no_running_supervisor() -> None:
    """At start, kev-serve removes the regions of supervisors no longer running: their pid gone, or now another
    process's (in a container every supervisor has the same pid, and a pod's /dev/shm outlives its container)."""
    me, tag = os.getpid(), secrets.token_hex(4)
    mine = SHM_DIR / f"{shm_prefix(me, 1)}{tag}"
    earlier = SHM_DIR / f"{SHM_PREFIX}{me}_{procs.process_start(me) - 1}_1_{tag}"  # this pid, an earlier process
    gone = SHM_DIR / f"{SHM_PREFIX}{(1 << 22) + 1}_5_1_{tag}"  # past Linux's largest pid
    regions = (mine, earlier, gone)
    try:
        for region in regions:
            region.write_bytes(b"")
        removed = remove_stale_shm()
        assert earlier.name in removed and gone.name in removed and mine.name not in removed and mine.exists()
    finally:
        for region in regions:
            region.unlink(missing_ok=True)


def test_bearer_key_only_in_the_gateways_environment(served: Served) -> None:
    """KEV_API_KEY reaches the gateway, which checks it, and neither tritonserver nor its Python stub, which parse
    what clients send."""

    def environment(pid: int) -> list[bytes]:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")

    assert f"KEV_API_KEY={API_KEY}".encode() in environment(gateway_child(served.pid))
    triton = child_named(served.pid, "tritonserver")
    for pid in (triton, child_named(triton, procs.STUB_COMM)):
        assert not [entry for entry in environment(pid) if entry.startswith(b"KEV_API_KEY=")], pid


def test_the_servers_allocate_with_jemalloc(served: Served) -> None:
    """The default KEV_HOST_ALLOCATOR: where the loader finds jemalloc, tritonserver, its Python stub and the gateway
    run on it (preloaded, in their memory maps), the supervisor itself does not, and the log says so."""
    if find_library("jemalloc") is None:
        pytest.skip("jemalloc is not installed here (apt-get install libjemalloc2; .ci/run installs it)")
    wait_for_log(served.triton, "host allocator: jemalloc (libjemalloc")
    triton = child_named(served.pid, "tritonserver")
    for pid in (triton, child_named(triton, procs.STUB_COMM), gateway_child(served.pid)):
        assert "/libjemalloc.so" in Path(f"/proc/{pid}/maps").read_text(), pid
    assert "/libjemalloc.so" not in Path(f"/proc/{served.pid}/maps").read_text()


def test_killed_stub_is_restarted_and_answers_again(served: Served) -> None:
    before, error, _ = infer(served.triton.grpc_url, 30)
    assert before is not None, error
    triton = child_named(served.pid, "tritonserver")
    stub = child_named(triton, procs.STUB_COMM)
    os.kill(stub, signal.SIGKILL)
    killed = time.monotonic()
    failures: list[tuple[str, float]] = []
    while time.monotonic() < killed + 120:
        after, error, elapsed = infer(served.triton.grpc_url, 5)
        if after is not None:
            break
        failures.append((error, elapsed))
        time.sleep(0.1)
    recovery = time.monotonic() - killed
    print(f"\nkill -9 of the stub to the first answer: {recovery:.1f} s; {len(failures)} requests failed meanwhile")
    assert after is not None, f"no answer {recovery:.0f} s after the stub was killed:\n{served.triton.log_tail()}"
    # Meanwhile every request got an error before its timeout: no silence.
    assert failures
    assert all(elapsed < 5 + 1 and "DEADLINE_EXCEEDED" not in error for error, elapsed in failures), failures
    after.pop("latency_ms"), before.pop("latency_ms")
    assert after == before  # the same model answers
    assert child_named(served.pid, "tritonserver") != triton
    log = wait_for_log(served.triton, "tritonserver answering again after")
    assert re.search(rf"TRITON RESTART 1: .*(kev_0_0 \(pid {stub}\) died|'kev_0_0' is not healthy)", log), log
    assert not list(SHM_DIR.glob(f"{shm_prefix(served.pid, 1)}*"))  # the first start's regions are gone


def health(triton: TritonServer, gateway_url: str, timeout_s: float = 3) -> subprocess.CompletedProcess[str]:
    """`python -m kev_backend.serve.supervisor.probe` (the image's HEALTHCHECK) against this server, as its settings
    say."""
    ports = {
        "HTTP_PORT": triton.http_url.rsplit(":", 1)[1],
        "GRPC_PORT": triton.grpc_url.rsplit(":", 1)[1],
        "GATEWAY_PORT": gateway_url.rsplit(":", 1)[1],
    }
    command = [sys.executable, "-m", "kev_backend.serve.supervisor.probe", "--timeout", str(timeout_s)]
    return subprocess.run(command, env={**os.environ, **ports}, capture_output=True, text=True, timeout=60)


def test_hung_stub_is_restarted_by_the_probe(served: Served) -> None:
    """A stopped stub is alive, so only the inference probe can tell: Triton refuses it as not healthy. The health
    check (kev_backend.serve.supervisor.probe) says unhealthy meanwhile, though Triton's process is up, and healthy
    after."""
    assert (result := health(served.triton, served.gateway_url)).returncode == 0 and result.stdout.startswith(
        "healthy"
    ), result
    log = served.triton.log.read_text(errors="replace")  # the module's earlier tests may have restarted it already
    restarts, answering = log.count("TRITON RESTART "), log.count("tritonserver answering again after")
    triton = child_named(served.pid, "tritonserver")
    os.kill(child_named(triton, procs.STUB_COMM), signal.SIGSTOP)
    stopped = time.monotonic()
    result = health(served.triton, served.gateway_url)
    assert result.returncode == 1 and result.stdout.startswith("unhealthy: "), result
    restart = f"TRITON RESTART {restarts + 1}: probe: INTERNAL: Stub process 'kev_0_0' is not healthy"
    wait_for_log(served.triton, restart, 30)
    wait_for_log(served.triton, "tritonserver answering again after", 60, times=answering + 1)
    print(f"\nSIGSTOP of the stub to answering again: {time.monotonic() - stopped:.1f} s; health: {result.stdout}")
    assert infer(served.triton.grpc_url, 30)[0] is not None
    deadline = time.monotonic() + 10  # the gateway's /ready: its own inference within its last 2 s
    while (result := health(served.triton, served.gateway_url)).returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert result.returncode == 0, result


def test_a_saturated_server_is_busy_not_unhealthy(served: Served) -> None:
    """With Triton's queue full of work, the health check's probe (at priority 1, ahead of the queue) is answered
    within a few batches, or waits past its timeout while other inferences complete: healthy either way (a liveness
    probe must not restart a server for being saturated; the gateway's own inference, queued behind the clients',
    is not asked of a busy server), and kev-serve restarts nothing. tests/serve/supervisor/test_restart_policy.py
    measures the probe with the queue kept full."""
    # ~200-token states, 700 of them: past the 512 Triton queues, and seconds of work on a CPU, batches completing
    # every second or two meanwhile (the probe's timeout here is the Kubernetes probes' 5 s).
    state = " ".join(["the invoice total was wrong and the refund is late"] * 20)
    bodies = [{"state": f"{i} {state}", "questions": BODY["questions"]} for i in range(700)]
    restarts = served.triton.log.read_text(errors="replace").count("TRITON RESTART ")
    client = grpcclient.InferenceServerClient(served.triton.grpc_url)
    done: queue.Queue = queue.Queue()
    try:
        for body in bodies:
            tensor = grpcclient.InferInput("REQUEST", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[json.dumps(body).encode()]], dtype=object))
            client.async_infer("kev", [tensor], callback=lambda result, error: done.put(error))
        wait_until(lambda: metric_values(served.triton).get("nv_inference_pending_request_count", 0) >= 200, "a queue")
        result = health(served.triton, served.gateway_url, timeout_s=5)
        for _ in bodies:
            done.get(timeout=300)  # the flood drains (the requests past the queue's 512 were refused)
    finally:
        client.close()
    assert result.returncode == 0, result
    assert result.stdout.startswith(("healthy: Triton busy: ", "healthy: Triton ready, a real inference answered")), (
        result
    )
    assert served.triton.log.read_text(errors="replace").count("TRITON RESTART ") == restarts


def test_killed_gateway_is_restarted(served: Served) -> None:
    gateway = gateway_child(served.pid)
    os.kill(gateway, signal.SIGKILL)
    deadline, back = time.monotonic() + 60, False
    while not back and time.monotonic() < deadline:
        back = wait_ready(f"{served.gateway_url}/health", served.triton.process, 1)
    assert back, f"the gateway did not answer again within 60 s:\n{served.triton.log_tail()}"
    assert gateway_child(served.pid) != gateway
    assert f"GATEWAY RESTART 1: gateway pid {gateway} was killed by SIGKILL" in served.triton.log.read_text()


def test_sigterm_stops_everything_and_removes_shared_memory(served: Served) -> None:
    """Runs last in this module: it stops the module's server."""
    triton = child_named(served.pid, "tritonserver")
    processes = [triton, *children(triton), *children(served.pid)]
    assert list(SHM_DIR.glob(f"{SHM_PREFIX}{served.pid}_*"))  # the running start's regions exist
    served.triton.process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    code = served.triton.process.wait(timeout=30)
    elapsed = time.monotonic() - started
    print(f"\nSIGTERM to exit: {elapsed:.1f} s")
    assert code == 0, served.triton.log_tail()
    assert elapsed < ServeSettings().stop_timeout_s + 1  # the stop timeout's promise (SIGKILL at its deadline)
    assert all(gone(pid) for pid in processes)
    assert not list(SHM_DIR.glob(f"{SHM_PREFIX}{served.pid}_*"))
    assert "SIGTERM received: stopping" in served.triton.log.read_text()


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"KEV_CHECKPOINT": "/nonexistent/kev"}, "tritonserver did not become ready: tritonserver pid"),
        ({"KEV_START_TIMEOUT_S": "0.5"}, "tritonserver not ready within 0.5 s"),
    ],
    ids=["model-fails-to-load", "start-timeout"],
)
def test_start_that_never_becomes_ready_exits_nonzero(
    tiny_dir: Path, tmp_path: Path, env: dict[str, str], reason: str
) -> None:
    environment = {
        **os.environ,
        "KEV_VENV": sys.prefix,
        "KEV_CHECKPOINT": str(tiny_dir / "kev"),
        "HTTP_PORT": str(free_port()),
        "GRPC_PORT": str(free_port()),
        "METRICS_PORT": str(free_port()),
        "GATEWAY": "0",
        **env,
    }
    log = tmp_path / "serve.log"
    with log.open("wb") as handle:
        process = subprocess.Popen(
            [str(REPO / "build" / "serve.sh")], env=environment, stdout=handle, stderr=subprocess.STDOUT
        )
        try:
            code = process.wait(timeout=180)
        finally:
            process.kill()
    text = log.read_text(errors="replace")
    assert code == 1, text[-3000:]
    assert f"kev-serve: EXITING: {reason}" in text, text[-3000:]
    assert not list(SHM_DIR.glob(f"{SHM_PREFIX}{process.pid}_*"))


def test_a_port_in_use_refuses_the_start_at_once(tiny_dir: Path, tmp_path: Path) -> None:
    """A port held by another process (here a listening socket on the gRPC port) ends the start before anything is
    started, with a message naming the port and its setting: no bind error in a restart loop, and no readiness read
    from the other server's port."""
    ports = {name: free_port() for name in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT")}
    holder = socket.create_server(("127.0.0.1", ports["GRPC_PORT"]))
    environment = {
        **os.environ,
        **{name: str(port) for name, port in ports.items()},
        "KEV_VENV": sys.prefix,
        "KEV_CHECKPOINT": str(tiny_dir / "kev"),
        "GATEWAY": "0",
    }
    try:
        done = subprocess.run(
            [str(REPO / "build" / "serve.sh")], env=environment, capture_output=True, text=True, timeout=60
        )
    finally:
        holder.close()
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"kev-serve: EXITING: cannot bind 127.0.0.1:{ports['GRPC_PORT']} (GRPC_PORT): in use." in done.stderr
    assert "HTTP_PORT): in use" not in done.stderr  # the free ones are not named
    assert "tritonserver pid" not in done.stderr, done.stderr[-3000:]  # nothing was started


class Reply:
    """A finished gRPC future: a reply, or an error with its status code."""

    def __init__(self, code: grpc.StatusCode | None, details: str = "") -> None:
        self.code, self.details = code, details

    def done(self) -> bool:
        return True

    def result(self) -> object:
        if self.code is None:
            reply = service_pb2.ModelInferResponse()
            body = b'{"answers": {"ok": {"type": "noul", "noul": 0.5}}}'
            reply.raw_output_contents.append(struct.pack("<I", len(body)) + body)
            return reply
        error = grpc.RpcError()
        error.code, error.details = (lambda: self.code), (lambda: self.details)
        raise error


def judging(tmp_path: Path, **settings: float) -> tuple[supervisor.Supervisor, list[str], Heartbeat]:
    """A supervisor that judges probes without a server: its restarts recorded, one instance (kev_0_0, a pid that
    never exists) whose heartbeat the test writes."""
    config = ServeSettings(**{"probe_timeout_s": 10, "probe_failures": 3, "progress_timeout_s": 60, **settings})
    sup = supervisor.Supervisor(config, {}, "key")
    restarts: list[str] = []
    sup.restart_triton = restarts.append  # type: ignore[method-assign]
    sup.ready = True
    prefix = f"{tmp_path}/heartbeat_"
    sup.watch = Watch(prefix, config.progress_timeout_s, keep_s=30)
    sup.stubs = {1 << 23: "kev_0_0"}  # past Linux's largest pid: no CPU time to read
    return sup, restarts, Heartbeat(Path(f"{prefix}kev_0_0"))


def test_probe_verdicts(tmp_path: Path) -> None:
    """Failures restart only in a row and while the model shows no progress; a stub not healthy restarts at once; a
    probe whose batch failed for another request's sake (a batch-mate's malformed tensor: an untagged
    INVALID_ARGUMENT; a pool too small for the batch) never counts, a tagged refusal does."""
    sup, restarts, pulse = judging(tmp_path)
    timeout, full = Reply(grpc.StatusCode.DEADLINE_EXCEEDED), Reply(grpc.StatusCode.UNAVAILABLE, QUEUE_FULL)
    poisoned = Reply(grpc.StatusCode.INVALID_ARGUMENT, "incomplete string data for inference input 'REQUEST'")
    no_room = Reply(grpc.StatusCode.INTERNAL, "Failed to increase the shared memory pool size for key 'kev_serve_1'")
    tagged = Reply(grpc.StatusCode.INVALID_ARGUMENT, envelope.tag_error(422, "state: Field required"))
    sup.watch.observe(sup.stubs, 0.0)
    sup.successes.extend([(80.0, 5), (91.0, 9), (99.0, 12)])  # Triton completing inferences: busy, not failing
    for reply in (timeout, full, timeout, full):
        sup.judge(reply, 95.0, 100.0)
    assert sup.failures == 0 and not restarts
    sup.successes.extend([(100.0, 12)] * 20)  # nothing completed since
    sup.judge(timeout, 105.0, 120.0)
    sup.judge(Reply(grpc.StatusCode.INTERNAL, "kev engine error"), 120.0, 121.0)
    for reply in (poisoned, no_room) * 3:
        sup.judge(reply, 121.0, 121.5)  # its batch failed for another request's sake: neither a failure nor an answer
    assert sup.failures == 2 and not restarts
    sup.judge(Reply(None), 122.0, 122.0)  # an answer ends the run
    assert sup.failures == 0
    for _ in range(2):
        sup.judge(full, 123.0, 123.0)
    sup.judge(tagged, 123.0, 123.5)
    assert restarts == [
        "3 probes failed in a row while the model made no progress and Triton completed no inference, the last:"
        f" INVALID_ARGUMENT: {tagged.details}"
    ]
    sup.judge(Reply(grpc.StatusCode.INTERNAL, "Stub process 'kev_0_0' is not healthy."), 124.0, 124.0)
    assert restarts[-1] == "probe: INTERNAL: Stub process 'kev_0_0' is not healthy."
    # A unit of work under way (a job whose beats moved within the progress timeout): failures do not count, and
    # progress ends a run.
    restarts.clear()
    sup.failures = 0  # as a restart's fresh start does
    sup.judge(timeout, 125.0, 140.0)
    pulse.started()
    sup.watch.observe(sup.stubs, 141.0)
    for now in (150.0, 170.0, 190.0, 200.0):  # no beat for up to 59 s: one layer may take that long
        sup.watch.observe(sup.stubs, now)
        sup.judge(timeout, now - 12, now)
    assert sup.failures == 0 and not restarts
    pulse.finished()  # answered: idle, and its beats moved during the next probe's wait
    sup.watch.observe(sup.stubs, 201.0)
    sup.judge(timeout, 195.0, 207.0)
    assert sup.failures == 0
    for now in (230.0, 250.0, 270.0):  # idle, nothing completes
        sup.judge(timeout, now - 12, now)
    assert len(restarts) == 1 and restarts[0].startswith("3 probes failed in a row")


def test_heartbeat_verdicts(tmp_path: Path) -> None:
    """An instance holding jobs whose beats do not move for the progress timeout is hung, one that says it is broken
    is restarted at once; an idle instance is neither, however long it stays idle."""
    sup, restarts, pulse = judging(tmp_path, progress_timeout_s=30)
    sup.watch.observe(sup.stubs, 0.0)
    assert not sup.step_heartbeats(1000.0)  # idle: never hung
    pulse.started()
    for now in (1001.0, 1020.0, 1030.9):
        assert not sup.step_heartbeats(now)
    pulse.beat()
    assert not sup.step_heartbeats(1040.0)  # a beat: the 30 s start again
    assert sup.step_heartbeats(1070.0) and restarts == [
        "no progress: model instance kev_0_0 holds 1 job(s) and its beats have not moved for 30 s"
        " (KEV_PROGRESS_TIMEOUT_S=30)"
    ]
    pulse.broken()
    assert sup.step_heartbeats(1071.0) and restarts[-1] == "model instance kev_0_0 reports its engine broken"


def test_restart_budget() -> None:
    """Within the budget restarts are at once; past it, and after a start that failed, each waits a backoff that
    doubles up to its cap, until a whole window passes without a restart."""
    budget = RestartBudget(limit=2, window_s=100, backoff_s=5, max_backoff_s=20)
    assert [budget.spend(t) for t in (0, 1)] == [(1, 0), (2, 0)]
    assert [budget.spend(t) for t in (2, 3, 4, 5, 6)] == [(3, 5), (4, 10), (5, 20), (6, 20), (7, 20)]
    assert budget.spend(106) == (1, 0)  # 100 s without a restart: the loop is over
    assert budget.spend(107) == (2, 0)
    assert budget.spend(108, failed_start=True) == (3, 5)  # a start that failed is not retried at once
    assert budget.spend(109) == (4, 10)
    assert "waiting 10 s before starting it again" in budget.describe(4, 10)


def test_descendants_are_a_process_tree_below_its_root() -> None:
    """procs.descendants (what the scale-out measurement kills to lose a server): children and grandchildren, not
    the root itself."""
    shell = subprocess.Popen(["bash", "-c", "sleep 30 & bash -c 'sleep 30 & wait' & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(procs.descendants(shell.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        below = procs.descendants(shell.pid)
        assert shell.pid not in below and os.getpid() not in below
        assert sorted(procs.proc_stat(pid)[0] for pid in below) == ["bash", "sleep", "sleep"]
    finally:
        for pid in [*procs.descendants(shell.pid), shell.pid]:
            os.kill(pid, signal.SIGKILL)
        shell.wait()
