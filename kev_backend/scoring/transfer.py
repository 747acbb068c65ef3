"""Host↔device copies that do not wait for the GPU. A pass's inputs go up, and the head's probabilities come down,
while earlier work is still running: the model thread can enqueue the next batch before this one has finished (a
copy from pageable memory waits for everything queued on the stream: torch synchronizes after it)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def device_ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 `values` on `device`; on CUDA through pinned memory, copied without waiting for the stream (torch's
    pinned-memory cache keeps the buffer until the copy has read it)."""
    return device_int_fields([values], device)[0]


# int64s per 16 bytes. Triton specialises a kernel on whether each pointer argument is 16-byte aligned (and compiles
# it again when that changes): fields that are views of one buffer start on 16 bytes, as torch's own allocations do,
# or a pass's field lengths would decide which variant runs, compiling new ones on requests
# (tests/gpu/test_fused_gpu.py's no-compile check holds it).
ALIGNED_INTS = 2


def aligned_size(n: int) -> int:
    """n int64s rounded up to whole 16 bytes."""
    return -(-n // ALIGNED_INTS) * ALIGNED_INTS


def device_int_fields(fields: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """Each of `fields` as an int64 tensor on `device`: views of one tensor, each starting on 16 bytes, filled through
    one pinned host buffer and one copy that does not wait for the stream (torch's pinned-memory cache keeps the
    buffer until the copy has read it). numpy converts a list of ints ~3x faster than torch.tensor, and one pinned
    buffer and copy a pass, not one a field, keeps the model thread's share of a busy batch small (a batch of 22 long
    states has ~58k tokens)."""
    starts = [0]
    for field in fields:
        starts.append(starts[-1] + aligned_size(len(field)))
    pinned = device.type == "cuda" and starts[-1] > 0
    host = torch.empty(starts[-1], dtype=torch.int64, pin_memory=pinned)
    array = host.numpy()  # the same memory
    for field, start in zip(fields, starts[:-1], strict=True):
        array[start : start + len(field)] = np.asarray(field, dtype=np.int64)
    flat = host.to(device, non_blocking=True) if pinned else host.to(device)
    return [flat[start : start + len(field)] for field, start in zip(fields, starts[:-1], strict=True)]


class HostCopy:
    """A device tensor on its way to the host: `get()` waits for its copy (and what was queued before it) alone."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.ready: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":
            self.host = tensor
            return
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.host.copy_(tensor, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record()

    def get(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()  # releases the GIL while it waits
        return self.host
