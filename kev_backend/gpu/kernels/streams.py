"""Two launches at once on the GPU: one on the current stream, the rest on a side stream (a fork and a join, which a
captured CUDA graph keeps as parallel branches). Used where one kernel of a pass leaves most of the GPU idle: a lone
long state's delta-rule chain (kernels.delta_rule.chunked_rows' `lead_apart`) and the rows' attention over a long
prefix beside the new states' own (fused.FusedQwen35.attention)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch


@contextlib.contextmanager
def beside(device: torch.device) -> Iterator[Callable[[Callable[[], object]], None]]:
    """Work queued inside the block runs on a side stream, at the same time as the launch given to `lead`, which the
    current stream makes first (in a captured graph: a fork and a join); both after the current stream's work and
    before anything queued after the block. Without CUDA, the lead and then the block, in order."""
    if device.type != "cuda":
        yield lambda launch: launch()
        return
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
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
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)
