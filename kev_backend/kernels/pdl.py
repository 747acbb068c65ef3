"""Programmatic dependent launch (PDL) for our kernels: KEV_PDL=1, on GPUs of compute capability 9.0 and later.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still running: its programs
wait (griddepcontrol.wait) until that kernel has finished and its writes are visible, then let the next kernel be
scheduled (griddepcontrol.launch_dependents). So the launch and the first programs' start of one kernel overlap
the previous kernel's last programs, where a captured pass of 400 kernels otherwise pays each one's start in
series. Every kernel waits before its first load or store, so the order of memory operations is what it was
without PDL: a kernel two places on can be scheduled only once the one between has passed its wait, which needs
the first one finished. A kernel not launched with PDL (cuBLAS, torch's) waits for everything before it, as ever.

Off under Triton's interpreter (the CPU tests), where the instructions do not exist."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def _setting() -> bool:
    setting = os.environ.get("KEV_PDL", "0")
    if setting not in ("0", "1"):
        raise ValueError(f"KEV_PDL must be 0 or 1, not {setting!r}")
    return setting == "1" and os.environ.get("TRITON_INTERPRET", "0") != "1"


ENABLED = _setting()


@functools.cache
def launch_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a launch of one of our kernels on `device`: the kernel's PDL constexpr and Triton's
    launch_pdl, or none (the kernels' PDL defaults to off)."""
    if ENABLED and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        return {"PDL": True, "launch_pdl": True}
    return {}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """A kernel's first step under PDL: wait for the previous kernel's completion and writes, then allow the next
    kernel to be scheduled (it waits likewise before touching memory). Nothing without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
