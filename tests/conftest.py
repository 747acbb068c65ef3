"""Shared fixtures: tiny Kev checkpoints built by the project's own builder, and helpers for HF references."""

from __future__ import annotations

import importlib
import os
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
from tokenizers import Tokenizer

from kev_backend.dev import synthetic
from kev_backend.dev.ports import free_port
from kev_backend.serve.client import prometheus

REPO = Path(__file__).resolve().parents[1]

# Our Triton kernels' tests (tests/gpu/kernels/test_*.py) run in the pytest process: compiled where CUDA is, else in
# Triton's interpreter. triton.jit picks the interpreter when it decorates a kernel, at its module's import, so it is
# set here, before any test module is imported; nothing imported above decorates one (a check, not a hope: below).
if not torch.cuda.is_available():
    if any(name.startswith("kev_backend.gpu.kernels") for name in sys.modules):
        raise RuntimeError("kev_backend.gpu.kernels was imported before tests/conftest.py set TRITON_INTERPRET=1")
    os.environ["TRITON_INTERPRET"] = "1"
KERNELS_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full-state", action="store_true", help="also answer a 65,536-token state on the CPU (1-2 min)")
    parser.addoption(
        "--parity-questions", type=int, default=1000, help="questions of the GPU fused-vs-fp32 parity test"
    )


def pytest_configure(config: pytest.Config) -> None:
    if KERNELS_INTERPRETED:  # the interpreter's own use of numpy (triton 3.6), warned at each launch
        config.addinivalue_line(
            "filterwarnings", "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
        )


@dataclass(frozen=True)
class KernelRun:
    """How tests/gpu/kernels/test_*.py run the kernels, and the tolerances that follow. In the interpreter everything is
    exact fp32; compiled on a GPU, tl.dot on fp32 runs in TF32 and norms use fast reciprocal square roots."""

    interpreted: bool
    tol: float  # largest absolute difference from the torch reference
    rel: float  # largest difference relative to the reference's largest magnitude


@pytest.fixture
def kernel_run() -> Iterator[KernelRun]:
    """Seeds torch; compiled, makes new tensors CUDA tensors for the test (torch.set_default_device)."""
    torch.manual_seed(0)
    if KERNELS_INTERPRETED:
        yield KernelRun(interpreted=True, tol=1e-5, rel=1e-6)
        return
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET is off and there is no CUDA device")
    torch.set_default_device("cuda")
    try:
        yield KernelRun(interpreted=False, tol=3e-3, rel=1e-5)
    finally:
        torch.set_default_device(None)


@pytest.fixture
def one_tile_size(kernel_run: KernelRun, monkeypatch: pytest.MonkeyPatch) -> None:
    """Interpreted, long new states attend in rows' tiles (kernels.attention.LONG_TILE_ROWS): there tl.dot is numpy's
    matmul, whose rows on some CPUs depend on how many rows it multiplies (the BLAS kernel it picks), so bits compared
    across tile sizes would compare BLAS kernels. Compiled, a row's arithmetic does not depend on its tile's other
    rows, and the long tiles stay."""
    if kernel_run.interpreted:
        from kev_backend.gpu.kernels import attention

        monkeypatch.setattr(attention, "LONG_TILE_ROWS", attention.TILE_ROWS)


@pytest.fixture(scope="session")
def parity_questions(request: pytest.FixtureRequest) -> int:
    """Questions of each GPU parity comparison (pytest --parity-questions; fewer only for a quick probe)."""
    return request.config.getoption("--parity-questions")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """base/, kev/ (LoRA) and kev-full/ checkpoints with random weights (kev_backend.dev.synthetic)."""
    out = tmp_path_factory.mktemp("tiny")
    synthetic.build(out)
    return out


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the `kernel` marker is given here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "kernel_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kernel)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (GPU machine only)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a keyword: tests/gpu/ holds CPU tests too
            item.add_marker(skip)


def hf_qwen35_torch_path() -> ModuleType:
    """transformers' Qwen3.5 modeling module bound to its pure-torch kernels.

    transformers picks fla's kernels at import whenever fla (and triton) import; on a CPU those crash, and on a
    GPU they are not the fp32 reference. Re-importing with fla and causal_conv1d hidden forces the torch path.
    """
    hidden = {name: sys.modules.get(name) for name in ("fla", "causal_conv1d")}
    sys.modules.update({name: None for name in hidden})  # None in sys.modules makes `import` raise ImportError
    try:
        import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

        modeling = importlib.reload(modeling)
    finally:
        for name, module in hidden.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return modeling


@dataclass
class TritonServer:
    http_url: str
    grpc_url: str
    metrics_url: str
    log: Path
    process: subprocess.Popen

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def start_triton(
    checkpoint: Path,
    log: Path,
    timeout_s: float = 180.0,
    repository: Path | None = None,
    wrapper: tuple[str, ...] = (),
    args: tuple[str, ...] = (),
    **extra_env: str,
) -> TritonServer:
    """The real tritonserver (build/serve.sh, as `make serve` runs it) on free loopback ports. `wrapper`: a command
    that runs build/serve.sh, its path given as the wrapper's last argument; `args`: build/serve.sh's arguments (extra
    arguments for tritonserver)."""
    if not (REPO / "build" / ".tritonserver" / "bin" / "tritonserver").exists():
        pytest.fail("tritonserver is not installed: run `make setup`")
    ports = [free_port() for _ in range(3)]
    env = {
        **os.environ,
        "KEV_VENV": sys.prefix,
        "KEV_CHECKPOINT": str(checkpoint),
        "BIND_ADDRESS": "127.0.0.1",
        "HTTP_PORT": str(ports[0]),
        "GRPC_PORT": str(ports[1]),
        "METRICS_PORT": str(ports[2]),
        "GATEWAY": "0",
        "MODEL_REPOSITORY": str(repository or REPO / "model_repository"),
        # The tests count requests and batches exactly: no inference probe from the supervisor (it still watches the
        # Python stub; tests/serve/supervisor/test_supervisor.py turns the probe on).
        "KEV_PROBE_INTERVAL_S": "0",
        **extra_env,
    }
    handle = log.open("wb")
    command = [*wrapper, str(REPO / "build" / "serve.sh"), *args]
    process = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT)
    server = TritonServer(f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[2]}", log, process)
    # Triton starts its metrics service after the HTTP one reports ready (~40 ms later on the CI machine): a test that
    # read the metrics at once was refused.
    for url in (f"http://{server.http_url}/v2/health/ready", f"http://{server.metrics_url}/metrics"):
        if not wait_ready(url, process, timeout_s):
            stop_triton(server)
            pytest.fail(f"tritonserver not ready (exit code {process.poll()}):\n{server.log_tail()}")
    return server


@pytest.fixture(scope="module")
def qwen_bpe() -> Tokenizer:
    """A byte-level BPE with Qwen's pre-tokenizer (tests/helpers.py), one per module: kev_tokenizer adds to it."""
    from tests.helpers import qwen_bpe as train  # helpers imports this module

    return train()


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Polls `condition` until it holds; fails naming `what` if it never does (a bound on hanging, not a speed
    check)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def metric_values(server: TritonServer) -> dict[str, float]:
    """Triton's Prometheus samples by name, summed over their labels."""
    with urllib.request.urlopen(f"http://{server.metrics_url}/metrics", timeout=10) as response:
        samples = prometheus.parse(response.read().decode())
    values: dict[str, float] = {}
    for name, _, value in samples:
        values[name] = values.get(name, 0.0) + value
    return values


def settled(read: Callable[[], dict], ready: Callable[[dict], bool], what: str) -> dict:
    """`read()` once `ready` holds for it and the model's own series (kev_*) stay the same across reads 50 ms apart:
    the model counts a batch just after its answers leave, so a client can have its answer a moment before."""
    found: dict = {}

    def check() -> bool:
        nonlocal found
        found = read()
        if not ready(found):
            return False
        time.sleep(0.05)
        again = read()
        same = all(again.get(k) == v for k, v in found.items() if str(k).startswith("kev_"))
        found = again
        return same

    wait_until(check, what, timeout_s=30.0)
    return found


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float) -> bool:
    """True once `url` answers 200; False if the process exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def stop_triton(server: TritonServer) -> None:
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout=45)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="session")
def triton(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    server = start_triton(tiny_dir / "kev", tmp_path_factory.mktemp("triton") / "tritonserver.log")
    yield server
    stop_triton(server)


@dataclass
class Gateway:
    url: str
    process: subprocess.Popen
    log: Path


def start_gateway(
    triton: TritonServer, log: Path, descriptors: int | None = None, metrics_url: str | None = None, **env: str
) -> Gateway:
    """The real `kev-gateway` (uvicorn) against `triton`, on a free loopback port. `descriptors`: its hard (and soft)
    RLIMIT_NOFILE, as a host with a lower limit would give it; `metrics_url`: where it reads Triton's metrics."""
    port = free_port()
    metrics = metrics_url or triton.metrics_url
    environment = {**os.environ, "TRITON_GRPC_URL": triton.grpc_url, "TRITON_METRICS_URL": metrics, **env}
    command = [str(Path(sys.prefix) / "bin" / "kev-gateway"), "--host", "127.0.0.1", "--port", str(port)]

    def limit_descriptors() -> None:
        if descriptors is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (descriptors, descriptors))

    process = subprocess.Popen(
        command, env=environment, stdout=log.open("wb"), stderr=subprocess.STDOUT, preexec_fn=limit_descriptors
    )
    gateway = Gateway(f"http://127.0.0.1:{port}", process, log)
    if not wait_ready(f"{gateway.url}/health", process, 60):
        process.kill()
        pytest.fail(f"kev-gateway did not start (exit code {process.poll()}):\n{log.read_text()[-3000:]}")
    return gateway


def stop_gateway(gateway: Gateway) -> None:
    gateway.process.terminate()
    try:
        gateway.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        gateway.process.kill()
