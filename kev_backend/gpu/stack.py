"""The GPU software stack every GPU figure, pre-tuned GEMM table and determinism result of this project was measured
on, and whether this process runs on it.

Answers are bit-identical alone and in any batch on any stack (the kernels and GEMMs never split a row's sums by the
batch), but which bits, how fast, and whether a packaged GEMM table applies are properties of the libraries: a torch
build brings its own cuBLAS, cuDNN and Triton compiler. GPU installs pin this stack (requirements-gpu.txt; a test holds
the two together). Moving it means measuring the new one on a GPU first (the GPU tests, determinism, a bench) and
saying so in docs/performance.md. Elsewhere the start-up line says the stack is not the measured one."""

from __future__ import annotations

import torch

# The measured stack: torch's release (its CUDA build's local tag aside), the CUDA it was built for, the cuBLASLt it
# loads, and the Triton compiler the kernels are compiled by.
MEASURED = {"torch": "2.11.0", "cuda": "13.0", "cublaslt": "13.1.0", "triton": "3.6.0"}


def running(device: torch.device) -> dict[str, str]:
    """This process's stack on a CUDA device, as MEASURED names it."""
    import triton

    from .cublaslt import library, version_text

    return {
        "torch": torch.__version__.split("+", 1)[0],
        "cuda": str(torch.version.cuda),
        "cublaslt": version_text(int(library(device).cublasLtGetVersion())),
        "triton": triton.__version__,
    }


def differences(have: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Each library whose version differs from the measured one: (this one's, the measured one's)."""
    return {name: (have.get(name, "none"), version) for name, version in MEASURED.items() if have.get(name) != version}


def summary(have: dict[str, str]) -> str:
    """For the start-up line: the stack, and whether it is the measured one."""
    stack = ", ".join(f"{name} {have.get(name, 'none')}" for name in MEASURED)
    differing = differences(have)
    if not differing:
        return f"{stack} (the measured stack)"
    measured = ", ".join(f"{name} {measured}" for name, (_, measured) in differing.items())
    return (
        f"{stack}: NOT the stack this project was measured on ({measured}): its figures and GEMM tables do not "
        "carry over; install requirements-gpu.txt's pins"
    )
