"""Work beside a lead launch: a side stream forked from the current one and joined back (in a captured CUDA graph, a
fork and a join), so that independent launches share the GPU with one that leaves most of it idle."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

# Side streams by purpose, so that nested forks never queue behind each other's work: the long new states' first
# segment apart from the rest of their group (kernels.delta_rule.LEAD_APART), and a pass's other groups beside its
# long new states (FusedQwen35.beside_long).
LEAD_SEGMENT, OTHER_GROUPS = 0, 1


@contextlib.contextmanager
def beside(device: torch.device, lane: int) -> Iterator[Callable[[Callable[[], object]], None]]:
    """Work queued inside the block runs on side stream `lane`, at the same time as the launches given to `lead`,
    which the current stream makes first; both after the current stream's work and before anything queued after the
    block. Without CUDA, the lead and then the block, in order."""
    if device.type != "cuda":
        yield lambda launch: launch()
        return
    main = torch.cuda.current_stream(device)
    side = _side_stream(device, lane)
    ready = torch.cuda.Event()
    ready.record(main)
    side.wait_event(ready)
    try:
        with torch.cuda.stream(side):
            # The lead is launched before the side stream's work so that its programs are placed first.
            yield lambda launch: _on(main, launch)
    finally:
        main.wait_stream(side)  # the join


def _on(stream: torch.cuda.Stream, launch: Callable[[], object]) -> None:
    with torch.cuda.stream(stream):
        launch()


@functools.cache
def _side_stream(device: torch.device, lane: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)
