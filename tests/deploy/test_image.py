"""The container image against the real server in it (`make image-test`; marker `image`, left out of a plain run).

One container of the image (KEV_IMAGE, default localhost/kev-on-triton:latest) runs as shipped: only the gateway
published, on host loopback. Triton's ports stay on the container's loopback as in production, so the Triton HTTP and
gRPC requests are sent from inside the container (`podman exec`, with the image's own tritonclient and Python): the
test exercises the shipped topology rather than a TRITON_ADDRESS=0.0.0.0 variant we tell operators not to run.
PODMAN (default build/image/podman.sh) is the podman command. Measurements go to out/image-test.json.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kev_backend.dev.ports import free_port
from kev_backend.serve.supervisor.procs import STUB_COMM
from tests.helpers import README_ANSWERS, README_GRPC_REQUEST, README_REQUEST, TRITON_HTTP

pytestmark = pytest.mark.image

REPO = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("KEV_IMAGE", "localhost/kev-on-triton:latest")
PODMAN = shlex.split(os.environ.get("PODMAN", "build/image/podman.sh"))
KEY = "image-test-key"


TRITON_GRPC = """
import json, sys, numpy as np, tritonclient.grpc as grpcclient
client = grpcclient.InferenceServerClient("localhost:8001")
inp = grpcclient.InferInput("REQUEST", [1, 1], "BYTES")
inp.set_data_from_numpy(np.array([[sys.argv[1].encode()]], dtype=np.object_))
print(client.infer("kev", [inp]).as_numpy("RESPONSE")[0, 0].decode())
"""
STUB_PIDS = f"""
import os
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if open(f"/proc/{{pid}}/comm").read().strip() == "{STUB_COMM}":
            print(pid)
    except OSError:
        pass
"""
# LISTEN sockets as (address, port) from /proc/net/tcp and tcp6 (32-bit words in host order); an IPv4-mapped IPv6
# address (gRPC listens that way) as its IPv4 form.
LISTENING = """
import ipaddress, json
out = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state != "0A":
            continue
        address, port = local.split(":")
        raw = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, len(address), 8))
        ip = ipaddress.ip_address(raw)
        ip = getattr(ip, "ipv4_mapped", None) or ip
        out.append([str(ip), int(port, 16)])
print(json.dumps(out))
"""


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([*PODMAN, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {result.returncode}: {result.stderr[-2000:]}")
    return result


class Container:
    def __init__(self, name: str, port: int) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.metrics: dict[str, float | int | str] = {}

    def exec(self, *args: str, timeout: float = 60) -> str:
        return podman("exec", self.name, *args, timeout=timeout).stdout

    def python(self, code: str, *args: str) -> str:
        return self.exec("python", "-c", code, *args)

    def logs(self) -> str:
        result = podman("logs", self.name, check=False)
        return result.stdout + result.stderr

    def inspect(self, template: str) -> str:
        return podman("inspect", "--format", template, self.name).stdout.strip()


def gateway_post(container: Container, path: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    request = urllib.request.Request(container.url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def gateway_ready(container: Container) -> bool:
    try:
        with urllib.request.urlopen(container.url + "/ready", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def container():
    if podman("image", "exists", IMAGE, check=False).returncode != 0:
        pytest.fail(f"no image {IMAGE}: build it with `make image` (make image-test does)")
    name = f"kev-image-test-{os.getpid()}"
    port = free_port()
    c = Container(name, port)
    started = time.monotonic()
    podman("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8009", "-e", f"KEV_API_KEY={KEY}", IMAGE)
    try:
        deadline = started + 180
        while not gateway_ready(c):
            state = c.inspect("{{.State.Status}}")
            if state != "running" or time.monotonic() > deadline:
                raise AssertionError(
                    f"container {state}, not ready after {time.monotonic() - started:.0f} s:\n{c.logs()}"
                )
            time.sleep(0.1)
        c.metrics["start_to_ready_s"] = round(time.monotonic() - started, 2)
        c.metrics["image_bytes"] = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip())
        yield c
    finally:
        podman("rm", "-f", "-v", name, check=False)
        out = REPO / "out"
        out.mkdir(exist_ok=True)
        (out / "image-test.json").write_text(json.dumps({"image": IMAGE, **c.metrics}, indent=1) + "\n")


def answers_of(response: dict) -> tuple[dict, dict]:
    return response["answers"], response["usage"]


def assert_readme_answer(response: dict) -> None:
    assert response["model"] == "kev-latest"
    assert response["answers"] == README_ANSWERS
    assert response["usage"]["input_tokens"] > 0 and response["usage"]["output_tokens"] > 0


def test_dockerfile_is_hadolint_clean():
    hadolint = REPO / ".venv" / "bin" / "hadolint"
    result = subprocess.run([str(hadolint), "Dockerfile"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_runs_as_non_root_under_tini(container):
    assert container.exec("id", "-u").strip() != "0"
    pid1 = container.exec("cat", "/proc/1/cmdline").split("\0")
    assert pid1[0] == "/usr/bin/tini", pid1
    # the one place the server writes: the Triton kernel cache, a volume
    container.exec("touch", "/var/cache/kev/triton/.writable")
    mounts = json.loads(container.inspect("{{json .Mounts}}"))
    assert any(mount["Destination"] == "/var/cache/kev/triton" for mount in mounts), mounts


def image_env(container: Container) -> dict[str, str]:
    listed = container.inspect("{{range .Config.Env}}{{println .}}{{end}}")
    return dict(line.split("=", 1) for line in listed.splitlines() if line)


def test_the_first_line_names_the_path_and_a_missing_gpu_loudly(container):
    """kev-serve's first line says which path it serves; the GPU image (KEV_EXPECT_GPU=1) on a machine without a GPU
    serves on the CPU path and says so first, as a warning."""
    first = next(line for line in container.logs().splitlines() if " kev-serve: " in line)
    said = first.split(" kev-serve: ", 1)[1]
    gpu_image = image_env(container).get("KEV_EXPECT_GPU") == "1"
    container.metrics["gpu_image"] = gpu_image
    if gpu_image:
        assert said.startswith("WARNING: NO GPU. This is the GPU image"), first
    else:
        assert said.startswith("CPU path ("), first


# Each server process of the container (by its comm) and whether jemalloc is in its memory map.
ALLOCATORS = f"""
import pathlib
for proc in pathlib.Path("/proc").glob("[0-9]*"):
    try:
        comm, maps = (proc / "comm").read_text().strip(), (proc / "maps").read_text()
    except OSError:
        continue
    if comm in ("tritonserver", "{STUB_COMM}"):
        print(comm, "/libjemalloc.so" in maps)
"""


def test_triton_and_its_stub_run_on_jemalloc(container):
    """The base image installs libjemalloc2 and kev-serve preloads it (KEV_HOST_ALLOCATOR's default) into
    tritonserver and its Python stub, and says so."""
    assert " kev-serve: host allocator: jemalloc (libjemalloc.so.2)" in container.logs()
    seen = container.python(ALLOCATORS).split("\n")
    assert sorted(line for line in seen if line) == [f"{STUB_COMM} True", "tritonserver True"], seen


def test_the_image_installs_its_pins_exactly(container):
    """Every project the image's requirement files pin (build/requirements.py's lines, kept in the image) is installed
    at that version; the GPU image's torch stack is the measured one (kev_backend/gpu/stack.py). A GPU run records
    its own environment (bench/gpu.sh: packages.txt); where one is kept under bench/results/, the GPU image must
    match it on every project of the measured stack (those requirements-gpu.txt pins: torch, its CUDA libraries, the
    Triton compiler, fla-core). The rest of a GPU run's environment is its host's (numpy and the like, which the
    figures do not depend on) and may differ."""
    pinned = dict(
        line.split("==", 1)
        for line in container.exec("cat", "/opt/kev/build/requirements-installed.txt").splitlines()
        if "==" in line
    )
    frozen = dict(
        line.split("==", 1) for line in container.exec("python", "-m", "pip", "freeze").splitlines() if "==" in line
    )

    def key(name: str) -> str:
        return name.split("[", 1)[0].lower().replace("_", "-").replace(".", "-")

    installed = {key(name): version for name, version in frozen.items()}

    def matches(pin: str, version: str | None) -> bool:  # pip's ==: a pin without a local tag takes any (+cpu)
        return version is not None and (version == pin or ("+" not in pin and version.split("+", 1)[0] == pin))

    drift = {
        name: (pin, installed.get(key(name)))
        for name, pin in pinned.items()
        if not matches(pin, installed.get(key(name)))
    }
    assert not drift, f"pinned (version, installed): {drift}"
    container.metrics["packages"] = len(installed)
    if image_env(container).get("KEV_EXPECT_GPU") != "1":
        return
    from kev_backend.gpu.stack import MEASURED

    assert installed["torch"].split("+", 1)[0] == MEASURED["torch"] and installed["triton"] == MEASURED["triton"]
    runs = sorted((REPO / "bench" / "results").glob("*-packages.txt"))
    container.metrics["packages_match_gpu_run"] = None
    if runs:
        ran = {
            key(n): v for n, v in (line.split("==", 1) for line in runs[-1].read_text().splitlines() if "==" in line)
        }
        stack = {key(line.split("==", 1)[0]) for line in (REPO / "requirements-gpu.txt").read_text().splitlines()
                 if "==" in line and not line.startswith("#")}  # fmt: skip
        differ = {
            n: (installed.get(n), ran.get(n))
            for n in stack
            if installed.get(n, "").split("+", 1)[0] != ran.get(n, "").split("+", 1)[0]
        }
        container.metrics["packages_match_gpu_run"] = not differ
        assert not differ, f"the image against {runs[-1].name} (image, GPU run): {differ}"


def test_only_the_gateway_faces_the_network(container):
    listening = {(address, port) for address, port in json.loads(container.python(LISTENING))}
    for port in (8000, 8001, 8002):  # Triton's HTTP, gRPC and metrics ports: container loopback only
        assert ("127.0.0.1", port) in listening, listening
        assert {address for address, p in listening if p == port} == {"127.0.0.1"}, listening
    assert ("0.0.0.0", 8009) in listening, listening


def test_readme_request_over_triton_http(container):
    reply = json.loads(container.python(TRITON_HTTP, json.dumps(README_REQUEST)))
    assert reply["model_name"] == "kev" and reply["outputs"][0]["name"] == "RESPONSE"
    assert_readme_answer(json.loads(reply["outputs"][0]["data"][0]))


def test_readme_request_over_triton_grpc_matches_the_gateway(container):
    response = json.loads(container.python(TRITON_GRPC, json.dumps(README_GRPC_REQUEST)))
    tone = response["answers"]["tone"]
    assert tone["type"] == "score" and "legend" in tone and 0 <= tone["confidence"] <= 1
    assert len(tone["probabilities"]) == 3 and abs(sum(tone["probabilities"].values()) - 1) < 1e-3
    status, via_gateway = gateway_post(container, "/v1/systemone", README_GRPC_REQUEST)
    assert status == 200, via_gateway
    assert answers_of(via_gateway) == answers_of(response)
    # and the HTTP example over gRPC: the same answer as README prints
    assert_readme_answer(json.loads(container.python(TRITON_GRPC, json.dumps(README_REQUEST))))


def test_readme_request_through_the_gateway(container):
    status, response = gateway_post(container, "/v1/systemone", README_REQUEST)
    assert status == 200, response
    assert_readme_answer(response)
    status, refused = gateway_post(container, "/v1/systemone", README_REQUEST, key=None)
    assert status == 401, refused
    status, refused = gateway_post(container, "/v1/systemone", {"state": "x", "questions": {"q": {"type": "nope"}}})
    assert status == 422 and "detail" in refused, refused


def test_readme_typesafe_sdk_example(container):
    from typesafe_sdk import Choice, Noul, TypeSafeClient

    questions = {
        "billing": Noul(instructions="Is this about billing?"),
        "tone": Choice(instructions="What is the tone?", criteria={"calm": None, "angry": None}),
    }
    state = "I was charged twice. Please help."
    with TypeSafeClient(api_key=KEY, base_url=container.url) as client:
        result = client.system_one(state=state, questions=questions)
    raw = {
        "state": state,
        "questions": {
            "billing": {"type": "noul", "instructions": "Is this about billing?"},
            "tone": {"type": "choice", "instructions": "What is the tone?", "criteria": {"calm": None, "angry": None}},
        },
    }
    status, want = gateway_post(container, "/v1/systemone", raw)
    assert status == 200, want
    assert abs(result.nouls["billing"].noul - want["answers"]["billing"]["noul"]) <= 1e-4
    assert result.choices["tone"].choice == want["answers"]["tone"]["choice"]


def healthcheck(container: Container) -> subprocess.CompletedProcess[str]:
    return podman("healthcheck", "run", container.name, check=False, timeout=60)


# Signals the given pids (a stub restarted meanwhile is gone: not an error).
SIGNAL = """
import os, signal, sys
for pid in sys.argv[2:]:
    try:
        os.kill(int(pid), getattr(signal, sys.argv[1]))
    except ProcessLookupError:
        pass
"""


def test_healthcheck_needs_a_real_inference(container):
    result = healthcheck(container)
    assert result.returncode == 0 and "unhealthy" not in result.stdout, result.stdout + result.stderr
    # A stub that does not answer while Triton still says ready: the healthcheck says unhealthy (its inference
    # fails; kev-serve sees the same and restarts Triton), then healthy again once Triton answers.
    pids = [pid for pid in container.python(STUB_PIDS).split()]
    assert pids, "no Python stub in the container"
    ready = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready').status)"
    container.python(SIGNAL, "SIGSTOP", *pids)
    try:
        assert container.python(ready).strip() == "200"
        started = time.monotonic()
        result = healthcheck(container)
        assert result.returncode != 0 and "unhealthy" in result.stdout, result.stdout + result.stderr
        container.metrics["healthcheck_unhealthy_after_s"] = round(time.monotonic() - started, 2)
        log = container.inspect("{{json .State.Healthcheck.Log}}")
        assert "unhealthy: inference through Triton failed" in log, log
    finally:
        container.python(SIGNAL, "SIGCONT", *pids)
    started = time.monotonic()
    while (result := healthcheck(container)).returncode != 0:
        assert time.monotonic() < started + 90, result.stdout + result.stderr + container.logs()[-3000:]
        time.sleep(0.5)
    container.metrics["healthy_again_after_s"] = round(time.monotonic() - started, 2)
    assert "TRITON RESTART 1" in container.logs()
    while not gateway_ready(container):
        assert time.monotonic() < started + 90, container.logs()[-3000:]
        time.sleep(0.2)


def test_sigterm_stops_within_the_stop_timeout(container):
    """podman stop: kev-serve stops everything by its stop timeout (the image's KEV_STOP_TIMEOUT_S; SIGKILL at the
    deadline) and exits 0 on its own."""
    stop_timeout_s = float(image_env(container)["KEV_STOP_TIMEOUT_S"])
    assert gateway_ready(container)
    started = time.monotonic()
    podman("stop", "-t", "10", container.name)
    elapsed = time.monotonic() - started
    container.metrics["podman_stop_s"] = round(elapsed, 2)
    # kev-serve handles SIGTERM (tini forwards it) and exits 0; 143 would mean it was killed by the signal.
    assert container.inspect("{{.State.ExitCode}}") == "0"
    logs = container.logs()
    assert "SIGTERM received: stopping" in logs and "stopped in" in logs, logs[-3000:]
    assert elapsed < stop_timeout_s + 1, f"podman stop took {elapsed:.2f} s"  # + podman's own second at most
