"""The measured GPU stack (kev_backend/gpu/stack.py) and the pins GPU installs take (requirements-gpu.txt) name the
same libraries, at the versions a GPU run installed; setup's requirement lines on a GPU machine take the GPU stack's
torch over the CPU build's; the start-up line says when a process runs on another stack."""

from __future__ import annotations

import re
import subprocess
import sys

from kev_backend.gpu import stack
from tests.conftest import REPO


def pins(text: str) -> dict[str, str]:
    found = (re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line) for line in text.splitlines())
    return {match[1].lower(): match[2] for match in found if match}


def test_the_gpu_pins_are_the_measured_stack() -> None:
    gpu = pins((REPO / "requirements-gpu.txt").read_text())
    assert gpu["torch"] == stack.MEASURED["torch"] and gpu["triton"] == stack.MEASURED["triton"]
    # cuBLAS's wheel 13.1.0.3 carries cuBLASLt 13.1.0; the CUDA runtime's 13.0.x is the CUDA torch was built for.
    assert gpu["nvidia-cublas"].rsplit(".", 1)[0] == stack.MEASURED["cublaslt"]
    assert gpu["nvidia-cuda-runtime"].startswith(stack.MEASURED["cuda"] + ".")


def test_every_gpu_pin_is_what_the_kept_gpu_run_installed() -> None:
    """bench/gpu.sh keeps each GPU run's `pip freeze` (packages.txt); the newest one kept under bench/results/ holds
    every project requirements-gpu.txt pins, at the pinned version."""
    runs = sorted((REPO / "bench" / "results").glob("*-packages.txt"))
    assert runs, "no GPU run's packages.txt kept under bench/results/"
    ran = {name.replace("_", "-"): version.split("+", 1)[0] for name, version in pins(runs[-1].read_text()).items()}
    gpu = pins((REPO / "requirements-gpu.txt").read_text())
    assert {name: (pin, ran.get(name)) for name, pin in gpu.items() if ran.get(name) != pin} == {}


def torch_lines(*files: str) -> list[str]:
    """The torch lines setup installs from these requirement files (build/requirements.py)."""
    lines = subprocess.run(
        [sys.executable, "build/requirements.py", *files], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return [line for line in lines if re.match(r"^torch\b", line)]


def test_setup_on_a_gpu_machine_takes_the_measured_torch() -> None:
    assert torch_lines("requirements.txt", "requirements-gpu.txt") == [f"torch=={stack.MEASURED['torch']}"]
    cpu_build = pins((REPO / "requirements.txt").read_text())["torch"]
    assert torch_lines("requirements.txt", "requirements-cpu.txt") == [f"torch=={cpu_build}"]


def test_the_start_up_line_names_a_stack_that_was_not_measured() -> None:
    measured = dict(stack.MEASURED)
    assert stack.differences(measured) == {}
    assert stack.summary(measured).endswith("(the measured stack)")
    other = measured | {"torch": "2.13.0", "cublaslt": "13.4.1"}
    assert stack.differences(other) == {"torch": ("2.13.0", "2.11.0"), "cublaslt": ("13.4.1", "13.1.0")}
    said = stack.summary(other)
    assert said.startswith("torch 2.13.0, cuda 13.0, cublaslt 13.4.1, triton 3.6.0: NOT the stack")
    assert "measured on (torch 2.11.0, cublaslt 13.1.0)" in said


def test_setup_keeps_every_extra_of_a_project_named_twice() -> None:
    """requirements.txt's tritonclient[grpc] and requirements-test.txt's tritonclient[http] install both clients."""
    lines = subprocess.run(
        [sys.executable, "build/requirements.py", "requirements.txt", "requirements-test.txt"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    version = re.search(r"^tritonclient\[grpc\]==(\S+)", (REPO / "requirements.txt").read_text(), re.MULTILINE)[1]
    assert [line for line in lines if line.startswith("tritonclient")] == [f"tritonclient[grpc,http]=={version}"]
