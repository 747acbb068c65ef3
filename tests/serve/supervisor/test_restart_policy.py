"""kev-serve restarts Triton only when it is dead or truly stuck, on the real tritonserver and gateway: valid work of
any length inside the limits is busy, not dead (two ~65,000-token states at once, a request of 16 bodies of 4 MiB);
other clients cannot poison the probe into restarts (malformed tensors, a full client queue, a small /dev/shm); a
stub that truly hangs mid-job is restarted after the progress timeout; and running out of restarts backs off and
goes on, the gateway untouched, a restart that does not become ready included.

The probe runs every second with a 3 s timeout in the servers here, so the old rule (three timed-out probes while
Triton completes nothing) would restart within about 12 s of a long request."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from kev_backend.dev.ports import free_port
from kev_backend.serve.stub.heartbeat import read as read_heartbeat
from kev_backend.serve.supervisor import procs, shm
from kev_backend.serve.supervisor.children import SHM_PREFIX, Child, shm_prefix, stop_children
from kev_backend.serve.supervisor.probe import QUEUE_FULL, Probe, answered
from kev_backend.serve.supervisor.progress import HEARTBEAT
from kev_backend.serve.supervisor.shm import SHM_DIR
from kev_backend.settings import ServeSettings
from tests.conftest import REPO, TritonServer, start_triton, stop_triton, wait_ready, wait_until
from tests.helpers import request_array
from tests.protocol.test_envelope import malformed_request
from tests.serve.supervisor.test_supervisor import child_named, gateway_child, health, wait_for_log

NOUL = {"urgent": {"type": "noul", "instructions": "does this need a reply today?"}}
RESTART = "TRITON RESTART"
SHM_FAILURE = "Failed to increase the shared memory pool size"


class Server:
    """A kev-serve under test: its tritonserver (conftest's TritonServer), its gateway's URL, its log."""

    def __init__(self, triton: TritonServer, gateway_url: str | None = None) -> None:
        self.triton, self.gateway_url = triton, gateway_url

    @property
    def pid(self) -> int:
        return self.triton.process.pid

    @property
    def grpc_url(self) -> str:
        return self.triton.grpc_url

    def log(self) -> str:
        return self.triton.log.read_text(errors="replace")

    def restarts(self) -> int:
        return self.log().count(RESTART)


def serve(tiny_dir: Path, log: Path, gateway: bool = False, **env: str) -> Server:
    port = free_port()
    settings = {"GATEWAY": "1", "GATEWAY_PORT": str(port)} if gateway else {}
    triton = start_triton(tiny_dir / "kev", log, **{"KEV_PROBE_INTERVAL_S": "1", **settings, **env})
    server = Server(triton, f"http://127.0.0.1:{port}" if gateway else None)
    if gateway and not wait_ready(f"{server.gateway_url}/health", triton.process, 60):
        stop_triton(triton)
        pytest.fail(f"gateway not ready:\n{triton.log_tail()}")
    wait_for_log(triton, "tritonserver ready after")
    return server


def infer(url: str, body: dict | bytes, timeout_s: float = 600) -> dict | str:
    """One request on its own connection: its response, or its error's status and message."""
    client = grpcclient.InferenceServerClient(url)
    tensor = grpcclient.InferInput("REQUEST", [1, 1], "BYTES")
    tensor.set_data_from_numpy(request_array(body))
    try:
        return json.loads(client.infer("kev", [tensor], client_timeout=timeout_s).as_numpy("RESPONSE")[0, 0])
    except InferenceServerException as error:
        return f"{error.status()} {error.message()}"
    finally:
        client.close()


def jobs(server: Server, instance: str = "kev_0_0") -> int:
    """Jobs the instance's heartbeat says it holds (0 before it has one)."""
    paths = list(SHM_DIR.glob(f"{SHM_PREFIX}{server.pid}_*_{HEARTBEAT}{instance}"))
    pulse = read_heartbeat(paths[0]) if len(paths) == 1 else None
    return pulse.jobs if pulse is not None else 0


def health_of(server: Server, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """The image's health check against `server`."""
    assert server.gateway_url is not None
    return health(server.triton, server.gateway_url, timeout_s)


# --- valid work of any length is busy, not dead ---------------------------------------------------------------


@pytest.fixture(scope="module")
def busy(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """kev-serve with the gateway, probing every second with a 3 s timeout."""
    server = serve(tiny_dir, tmp_path_factory.mktemp("busy") / "serve.log", gateway=True, KEV_PROBE_TIMEOUT_S="3")
    yield server
    stop_triton(server.triton)


def test_the_heartbeat_lives_in_the_starts_shared_memory(busy: Server) -> None:
    """tritonserver gets KEV_HEARTBEAT_PREFIX inside its start's region prefix; the stub writes its heartbeat there,
    holding no job between the supervisor's probes (one may be under way at any read: its job ends within seconds)."""
    triton = child_named(busy.pid, "tritonserver")
    environ = Path(f"/proc/{triton}/environ").read_bytes().split(b"\0")
    (prefix,) = [entry.split(b"=", 1)[1].decode() for entry in environ if entry.startswith(b"KEV_HEARTBEAT_PREFIX=")]
    assert prefix.startswith(f"{SHM_DIR}/{shm_prefix(busy.pid, 1)}"), prefix
    path = Path(f"{prefix}kev_0_0")
    assert (pulse := read_heartbeat(path)) is not None and not pulse.broken
    wait_until(lambda: (pulse := read_heartbeat(path)) is not None and pulse.jobs == 0, "the heartbeat to hold no job")


def test_two_long_states_at_once_are_answered_without_a_restart(busy: Server) -> None:
    """Two concurrent ~65,000-token states: minutes of work on a CPU with the probe's answer far behind them. The
    model beats after every layer of every chunk: busy, so no restart, and both are answered; the health check says
    healthy meanwhile."""
    restarts = busy.restarts()
    body = {"state": "word " * 65_000, "questions": NOUL}
    stub = child_named(child_named(busy.pid, "tritonserver"), procs.STUB_COMM)
    cpu = procs.cpu_seconds(stub) or 0.0
    with ThreadPoolExecutor(2) as pool:
        replies = [pool.submit(infer, busy.grpc_url, body) for _ in range(2)]
        wait_until(lambda: (procs.cpu_seconds(stub) or 0.0) - cpu >= 2, "the stub at work")
        time.sleep(10)  # past three of the old rule's timed-out probes
        check = health_of(busy, timeout_s=3)
        started = time.monotonic()
        answers = [reply.result() for reply in replies]
    print(
        f"\ntwo 65,000-word states answered {time.monotonic() - started:.0f} s after the health check: {check.stdout}"
    )
    for answer in answers:
        assert isinstance(answer, dict), answer
        assert 65_000 < answer["usage"]["input_tokens"] - 10 <= 65_536, answer["usage"]  # <state> and the state
    assert busy.restarts() == restarts, busy.log()[-3000:]
    assert check.returncode == 0 and check.stdout.startswith("healthy"), check


def test_a_request_of_large_bodies_is_not_a_restart(busy: Server) -> None:
    """One Triton request carrying 16 copies of a 4 MiB request (as /permute sent its orders through the gateway; any
    client of Triton's port may): the stub parses and tokenizes them all before the model takes them as a job, tens
    of seconds with no beat. The stub keeps a CPU busy meanwhile: working, not stuck. Answered, no restart."""
    restarts = busy.restarts()
    started = time.monotonic()
    outcome = infer_many(busy.grpc_url, large_body(), 16)
    print(f"\n16 x 4 MiB in one request: {outcome} after {time.monotonic() - started:.0f} s")
    assert outcome == "answered"
    assert busy.restarts() == restarts, busy.log()[-3000:]


def test_malformed_tensors_never_restart(busy: Server) -> None:
    """Clients sending BYTES tensors whose length prefix overruns their data, without pause, on Triton's port: every
    batch holding one fails whole with an untagged INVALID_ARGUMENT, kev-serve's probe among them. That says nothing
    of the model: no restart, and the health check stays healthy."""
    restarts = busy.restarts()
    stop = threading.Event()
    channel = grpc.insecure_channel(busy.grpc_url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

    def hostile() -> None:
        while not stop.is_set():
            try:
                stub.ModelInfer(malformed_request(), timeout=30)
            except grpc.RpcError:
                pass

    probe = Probe(busy.grpc_url, "kev")
    outcomes: Counter[str] = Counter()
    threads = [threading.Thread(target=hostile) for _ in range(8)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 15  # five times what three of the old rule's failed probes took
        while time.monotonic() < deadline:
            try:
                outcomes["answered" if answered(probe.infer(10).result()) else "no answer"] += 1
            except grpc.RpcError as error:
                outcomes[error.code().name] += 1
            time.sleep(0.2)
        check = health_of(busy, timeout_s=3)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        probe.close()
        channel.close()
    print(f"\nprobes sent beside the malformed tensors: {dict(outcomes)}; health check: {check.stdout}")
    assert outcomes["INVALID_ARGUMENT"] >= 3, outcomes  # the flood did fail probes' batches
    assert busy.restarts() == restarts, busy.log()[-3000:]
    assert check.returncode == 0 and check.stdout.startswith("healthy"), check
    assert isinstance(infer(busy.grpc_url, {"state": "hello", "questions": NOUL}, 60), dict)


def test_the_probe_is_answered_with_the_client_queue_full(busy: Server) -> None:
    """While the stub prepares a large batch (tens of seconds of tokenizing), clients fill Triton's queue: its 512
    places taken, the rest refused. The probe goes at priority 1, whose queue is its own (max_queue_size holds per
    priority level): queued, never refused, and answered in the first batch after. The clients' states are one
    60,000-letter word each (tens of milliseconds of tokenizing, a few tokens of model work), under
    PREPARE_APART_BYTES: each batch of them is prepared on Triton's execute thread, which the queue waits on (the large
    request is prepared apart, and tokenizing lets go of the GIL, so it alone would not hold the queue)."""
    stub = child_named(child_named(busy.pid, "tritonserver"), procs.STUB_COMM)
    cpu = procs.cpu_seconds(stub) or 0.0
    state = "a" * 60_000
    flood = Flood(busy.grpc_url, [{"state": f"{i} {state}", "questions": NOUL} for i in range(700)])
    probe = Probe(busy.grpc_url, "kev")
    with ThreadPoolExecutor(1) as pool:
        large = pool.submit(infer_many, busy.grpc_url, large_body(), 16)
        wait_until(lambda: (procs.cpu_seconds(stub) or 0.0) - cpu >= 2, "the stub preparing the large batch")
        flood.start()
        wait_until(lambda: flood.refused > 0, "the client queue full")
        refused, started = flood.refused, time.monotonic()
        try:
            outcome = "answered" if answered(probe.infer(300).result()) else "no answer"
        except grpc.RpcError as error:
            outcome = f"{error.code().name}: {error.details()}"
        waited = time.monotonic() - started
        probe.close()
        assert large.result() == "answered"
        flood.wait()
    print(
        f"\nthe probe with the client queue full ({refused} clients refused when it was sent, {flood.refused} in all):"
        f" {outcome} after {waited:.1f} s"
    )
    assert outcome == "answered"


def large_body() -> dict:
    """A request of 4 MiB that the model answers: a state the toy tokenizer reads in a few tokens, 2.3 s of
    tokenizing on one core."""
    question = {"type": "choice", "instructions": "which team?", "criteria": {"billing": None, "technical": None}}
    return {"state": "a" * ((4 << 20) - 1_000), "questions": {"team": question}}


def infer_many(url: str, body: dict, copies: int, timeout_s: float = 600) -> str:
    """One Triton request carrying `copies` of `body` (as /permute sends its orders): "answered" or the error."""
    channel = grpc.insecure_channel(url, options=[("grpc.max_send_message_length", -1)])
    raw = json.dumps(body).encode()
    request = service_pb2.ModelInferRequest(model_name="kev")
    tensor = request.inputs.add(name="REQUEST", datatype="BYTES")
    tensor.shape.extend([copies, 1])
    request.raw_input_contents.append(b"".join(struct.pack("<I", len(raw)) + raw for _ in range(copies)))
    try:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=timeout_s)
        return "answered"
    except grpc.RpcError as error:
        return f"{error.code().name}: {error.details()}"
    finally:
        channel.close()


class Flood:
    """Sends every body once, all at once; counts the ones refused for the full queue as their replies come."""

    def __init__(self, url: str, bodies: list[dict]) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.bodies = [request_array(body) for body in bodies]
        self.done: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.refused = 0  # Triton's metrics do not count these

    def start(self) -> None:
        for body in self.bodies:
            tensor = grpcclient.InferInput("REQUEST", [1, 1], "BYTES")
            tensor.set_data_from_numpy(body)
            self.client.async_infer("kev", [tensor], callback=lambda result, error: self.reply(error))

    def reply(self, error: InferenceServerException | None) -> None:
        if error is not None and QUEUE_FULL in error.message():
            with self.lock:
                self.refused += 1
        self.done.put(error)

    def wait(self) -> None:
        """Until every body is answered or refused."""
        try:
            for _ in self.bodies:
                self.done.get(timeout=600)
        finally:
            self.client.close()


# --- a stub that truly hangs ---------------------------------------------------------------------------------------


@pytest.fixture
def no_probe(tiny_dir: Path, tmp_path: Path) -> Iterator[Server]:
    """kev-serve without the inference probe: only its watches (the stubs, their heartbeats), a 5 s progress
    timeout."""
    server = serve(tiny_dir, tmp_path / "serve.log", KEV_PROBE_INTERVAL_S="0", KEV_PROGRESS_TIMEOUT_S="5")
    yield server
    stop_triton(server.triton)


def test_a_stub_stopped_mid_job_is_restarted_after_the_progress_timeout(no_probe: Server) -> None:
    """A stub stopped (SIGSTOP) while it holds a job: alive, its heartbeat frozen with jobs > 0. Restarted once its
    beats have not moved for KEV_PROGRESS_TIMEOUT_S; the request in flight gets an error; answering again after."""
    stub = child_named(child_named(no_probe.pid, "tritonserver"), procs.STUB_COMM)
    cpu = procs.cpu_seconds(stub) or 0.0
    with ThreadPoolExecutor(1) as pool:
        # ~30 s of model work on a CPU; stopped once the stub has spent 2 s of CPU on it (its parsing and tokenizing
        # take 0.1 s), well inside the job.
        reply = pool.submit(infer, no_probe.grpc_url, {"state": "word " * 30_000, "questions": NOUL}, 300)
        wait_until(lambda: (procs.cpu_seconds(stub) or 0.0) - cpu >= 2, "the stub at work", 120)
        os.kill(stub, signal.SIGSTOP)
        holding = jobs(no_probe)
        stopped = time.monotonic()
        log = wait_for_log(no_probe.triton, f"{RESTART} 1: no progress: model instance kev_0_0 holds 1 job(s)", 60)
        print(f"\nSIGSTOP mid-job to the restart: {time.monotonic() - stopped:.1f} s (progress timeout 5 s)")
        assert isinstance(reply.result(), str), reply.result()  # failed, not left hanging
    assert holding == 1  # its heartbeat said so when it was stopped
    wait_for_log(no_probe.triton, "tritonserver answering again after", 60)
    assert isinstance(infer(no_probe.grpc_url, {"state": "hello", "questions": NOUL}, 60), dict)
    assert log.count(RESTART) == 1


# --- a small /dev/shm ----------------------------------------------------------------------------------------------


@pytest.fixture
def small_shm(tiny_dir: Path, tmp_path: Path) -> Iterator[Server]:
    """kev-serve in a mount namespace of its own whose /dev/shm is a 64 MiB tmpfs (podman's default), probing every
    second with a 3 s timeout."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to give kev-serve a /dev/shm of its own")
    script = tmp_path / "small-shm.sh"
    script.write_text(f'#!/bin/sh\nmount -t tmpfs -o size=64m tmpfs /dev/shm && exec {REPO}/build/serve.sh "$@"\n')
    script.chmod(0o755)
    ports = [free_port() for _ in range(3)]
    env = {
        **os.environ,
        "KEV_VENV": sys.prefix,
        "KEV_CHECKPOINT": str(tiny_dir / "kev"),
        "HTTP_PORT": str(ports[0]),
        "GRPC_PORT": str(ports[1]),
        "METRICS_PORT": str(ports[2]),
        "GATEWAY": "0",
        "KEV_PROBE_INTERVAL_S": "1",
        "KEV_PROBE_TIMEOUT_S": "3",
    }
    log = tmp_path / "serve.log"
    command = ["unshare", "--mount", "--propagation", "private", str(script)]
    process = subprocess.Popen(command, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    triton = TritonServer(*(f"127.0.0.1:{port}" for port in ports), log, process)
    if not wait_ready(f"http://{triton.http_url}/v2/health/ready", process, 180):
        stop_triton(triton)
        pytest.fail(f"tritonserver not ready:\n{triton.log_tail()}")
    server = Server(triton)
    wait_for_log(triton, "tritonserver ready after")
    yield server
    stop_triton(triton)


def test_a_small_dev_shm_is_warned_of_and_never_a_restart(small_shm: Server) -> None:
    """With 64 MiB of /dev/shm, a request of 16 bodies of 4 MiB (inside the limits: Triton's batch holds 64) cannot
    fit the stub's pool: the Python backend fails its whole batch, the small requests batched with it included
    (measured and printed here). kev-serve warned at start, naming the size the limits need; the probe's failures for
    shared memory do not count while other batches get through: no restart."""
    assert f"WARNING: {SHM_DIR} has 64 MiB free" in small_shm.log()
    assert "need 832 MiB (1 instance(s) x a batch of 64 requests of 4 MiB" in small_shm.log()
    restarts = small_shm.restarts()
    small = {"state": "my card was charged twice", "questions": NOUL}
    outcomes: dict[str, Counter[str]] = {"16 x 4 MiB": Counter(), "small": Counter()}
    stop = threading.Event()

    def count(kind: str, outcome: str) -> None:
        outcomes[kind][SHM_FAILURE if SHM_FAILURE in outcome else outcome.split(" (", 1)[0][:60]] += 1

    def large_client() -> None:
        while not stop.is_set():
            count("16 x 4 MiB", infer_many(small_shm.grpc_url, large_body(), 16, timeout_s=60))

    def small_client() -> None:
        while not stop.is_set():
            reply = infer(small_shm.grpc_url, small, 60)
            count("small", "answered" if isinstance(reply, dict) else reply)

    # 16 small clients keep the stub busy, so requests queue between batches and a batch often holds a large one.
    threads = [threading.Thread(target=large_client) for _ in range(3)]
    threads += [threading.Thread(target=small_client) for _ in range(16)]
    for thread in threads:
        thread.start()
    time.sleep(20)  # past several of the old rule's failed probes
    stop.set()
    for thread in threads:
        thread.join()
    print(f"\n64 MiB /dev/shm, 20 s of 3 clients of 16 x 4 MiB and 16 small: {json.dumps(outcomes, indent=1)}")
    assert outcomes["16 x 4 MiB"][SHM_FAILURE] > 0, outcomes
    assert small_shm.restarts() == restarts, small_shm.log()[-3000:]
    assert isinstance(infer(small_shm.grpc_url, small, 60), dict)


# --- restarts back off and go on -----------------------------------------------------------------------------------


@pytest.fixture
def backoff(tiny_dir: Path, tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    """kev-serve with the gateway, no restart within its budget (KEV_MAX_RESTARTS=0), a backoff of 1 s doubling to
    4 s, serving a copy of the tiny checkpoint (which a test may take away)."""
    checkpoint = tmp_path / "kev"
    shutil.copytree(tiny_dir / "kev", checkpoint, symlinks=True)
    (tmp_path / "base").symlink_to(tiny_dir / "base")  # the LoRA checkpoint names its base beside it
    env = {"KEV_MAX_RESTARTS": "0", "KEV_RESTART_BACKOFF_S": "1", "KEV_RESTART_BACKOFF_MAX_S": "4"}
    server = serve(checkpoint.parent, tmp_path / "serve.log", gateway=True, **env)
    yield server, checkpoint
    stop_triton(server.triton)


def kill_stub(server: Server) -> int:
    stub = child_named(child_named(server.pid, "tritonserver"), procs.STUB_COMM)
    os.kill(stub, signal.SIGKILL)
    return stub


def test_spent_restarts_back_off_and_go_on(backoff: tuple[Server, Path]) -> None:
    """Past the restart budget each start waits a backoff that doubles up to its cap (each wait logged); kev-serve
    and its gateway go on, and the server answers again after each."""
    server, _ = backoff
    assert server.gateway_url is not None
    gateway = gateway_child(server.pid)
    for n, wait_s in enumerate((1, 2, 4, 4), start=1):
        kill_stub(server)
        wait_for_log(server.triton, f"{RESTART} {n}: ", 30)
        log = wait_for_log(server.triton, "tritonserver answering again after", 60, times=n)
        assert f"waiting {wait_s} s before starting it again" in log.split(f"{RESTART} {n}: ")[1].split("\n")[0]
        assert server.triton.process.poll() is None and gateway_child(server.pid) == gateway
        assert wait_ready(f"{server.gateway_url}/health", server.triton.process, 10)
    assert isinstance(infer(server.grpc_url, {"state": "hello", "questions": NOUL}, 60), dict)
    assert "EXITING" not in server.log()


def test_a_restart_that_does_not_become_ready_is_retried(backoff: tuple[Server, Path]) -> None:
    """A restart whose model cannot load (its checkpoint gone meanwhile) is not the end: retried after each backoff,
    the gateway up throughout, until the checkpoint is back and the server answers again."""
    server, checkpoint = backoff
    gateway = gateway_child(server.pid)
    aside = checkpoint.with_name("kev-aside")
    checkpoint.rename(aside)
    try:
        kill_stub(server)
        log = wait_for_log(server.triton, "before it was ready", 120, times=2)
        assert server.triton.process.poll() is None and gateway_child(server.pid) == gateway
    finally:
        aside.rename(checkpoint)
    wait_for_log(server.triton, "tritonserver answering again after", 120)
    print("\n" + "\n".join(line for line in log.splitlines() if RESTART in line))
    assert isinstance(infer(server.grpc_url, {"state": "hello", "questions": NOUL}, 60), dict)
    assert gateway_child(server.pid) == gateway and "EXITING" not in server.log()


# --- units ---------------------------------------------------------------------------------------------------------


def test_shm_need_follows_the_limits_and_the_instances() -> None:
    """832 MiB an instance by default (64 inputs of 4 MiB and their responses); per GPU in gpu.pbtxt; smaller with
    KEV_MAX_REQUEST_BYTES; the warning names the size."""
    repository = REPO / "model_repository"
    cpu = shm.need(shm.config_path(repository, "kev", None), lambda: pytest.fail("no GPU group to ask about"), {})
    assert (cpu.instances, cpu.max_batch, cpu.max_request_bytes, cpu.total) == (1, 64, 4 << 20, 832 << 20)
    assert shm.need(shm.config_path(repository, "kev", "gpu"), lambda: 4, {}).total == 4 * (832 << 20)
    smaller = shm.need(shm.config_path(repository, "kev", None), lambda: 0, {"KEV_MAX_REQUEST_BYTES": str(1 << 20)})
    assert smaller.total == 64 * (3 << 20) + 64 * shm.MIB
    assert shm.check(cpu, 2 << 30) is None
    assert "need 832 MiB (1 instance(s) x a batch of 64 requests of 4 MiB" in (shm.check(cpu, 64 << 20) or "")


def test_serve_settings_of_supervision() -> None:
    settings = ServeSettings.read({"KEV_PROGRESS_TIMEOUT_S": "30", "KEV_RESTART_BACKOFF_S": "10"})
    assert settings.progress_timeout_s == 30 and settings.restart_backoff_s == 10
    assert settings.restart_backoff_max_s == 300
    assert ServeSettings.read({"KEV_RESTART_BACKOFF_S": "600"}).restart_backoff_max_s == 600  # never below the first
    assert ServeSettings().progress_timeout_s == 120


def test_probe_request_asks_for_priority_and_tagged_errors() -> None:
    probe = Probe("127.0.0.1:1", "kev")
    try:
        parameters = probe.request.parameters
        assert parameters["priority"].uint64_param == 1 and parameters["kev_tagged_errors"].bool_param is True
    finally:
        probe.close()


def test_a_stop_names_the_children_it_had_to_kill() -> None:
    """SIGTERM to each child; at the deadline SIGKILL to the groups still running, named for the stop's log line."""
    env = dict(os.environ)
    polite = Child("polite", [sys.executable, "-c", "import time; time.sleep(60)"], env)
    stubborn_code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    stubborn = Child("stubborn", [sys.executable, "-c", stubborn_code], env)
    time.sleep(1.0)  # both running, the stubborn one ignoring SIGTERM
    assert stop_children([polite, stubborn], time.monotonic() + 1.5, lambda: False) == ["stubborn"]
    assert polite.process.returncode == -signal.SIGTERM and stubborn.process.returncode == -signal.SIGKILL
    assert stop_children([polite], time.monotonic() + 1.0, lambda: False) == []
