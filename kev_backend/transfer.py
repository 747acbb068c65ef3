"""Host↔device copies that do not wait for the GPU. A pass's inputs go up, and the head's probabilities come down,
while earlier work is still running: the model thread can enqueue the next batch before this one has finished (a
copy from pageable memory waits for everything queued on the stream: torch synchronizes after it)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 `values` on `device`; on CUDA through pinned memory, copied without waiting for the stream (torch's
    pinned-memory cache keeps the buffer until the copy has read it)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda" or not values:
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


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
