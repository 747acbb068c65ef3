"""How the fused path divides a GPU's memory: the weights, the working memory of the largest pass, the CUDA graphs'
pool, and the state bank in what is left.

The bank is preallocated (gpu/pool.py), so what passes need beyond it must stay free. The largest passes
(FusedScorer.plan) are a new state of max_state_tokens with questions up to Kev's row limit, and pass_tokens of
questions over such a state once banked. Their working memory is measured at start, on a bank that holds just one
such state, before the real bank is made (FusedScorer.plan_memory); so is a pass of the graphs' largest bucket,
which their shared pool holds once captured. The bank then takes a fifth of the GPU, as on a GPU with room to
spare, or what is left after those and a margin where less. Where not even one state of max_state_tokens fits, the
start fails at once, saying what is needed, what the GPU has and what to change; so does a load that runs out of
memory before that (refusing_out_of_memory: a GPU other processes fill).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .pool import slots_for

GIB = 1 << 30
# Beyond the two measured passes: cuBLAS's and cuDNN's workspaces, the caching allocator's rounding and the head.
MARGIN_BYTES = GIB
BANK_SHARE = 5  # the bank's default share of the GPU: a fifth, where the rest leaves room for it


class GpuMemoryError(RuntimeError):
    """The model cannot be served on this GPU: the message says why and what to change."""


@dataclass(frozen=True)
class MemoryPlan:
    """What the bank may take on one GPU. `working` and `graphs` are measured peaks of the largest passes and of the
    graphs' largest bucket; `minimum` is a bank of one state of `max_state_tokens`."""

    total: int  # the GPU's memory
    free: int  # free once the weights are in place (and nothing else of the path's)
    weights: int  # the model's tensors
    working: int
    graphs: int
    minimum: int
    max_state_tokens: int
    largest_pass_tokens: int

    @property
    def left(self) -> int:
        return self.free - self.working - self.graphs - MARGIN_BYTES

    def bank_bytes(self) -> int:
        """The bank: a fifth of the GPU, or what is left if less; GpuMemoryError where one state does not fit."""
        if self.left < self.minimum:
            raise GpuMemoryError(self.too_small())
        return min(self.total // BANK_SHARE, self.left)

    def too_small(self) -> str:
        short = self.minimum - self.left
        return (
            f"the model does not fit this GPU: its weights take {gib(self.weights)} of {gib(self.total)}, leaving "
            f"{gib(self.free)}; the largest pass, {self.largest_pass_tokens:,} tokens (a "
            f"{self.max_state_tokens:,}-token state and its questions to Kev's row limit), needs {gib(self.working)}, "
            f"the CUDA graphs {gib(self.graphs)}, workspaces {gib(MARGIN_BYTES)}, and the state bank at least "
            f"{gib(self.minimum)} (one state of {self.max_state_tokens:,} tokens): {gib(short)} short. Serve it on "
            "a GPU with more memory, or lower max_state_tokens and max_row_tokens (KEV_MAX_STATE_TOKENS, "
            "KEV_MAX_ROW_TOKENS: a pass and a banked state shrink with them), or graph_max_tokens "
            "(KEV_GRAPH_MAX_TOKENS)"
        )


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def states_held(slots: int, pages: int, page_size: int, length: int) -> int:
    """How many states of `length` tokens a pool of `slots` slots and `pages` pages holds at once, each with the
    point it keeps (gpu/pool.py: a slot more from POINT_MIN_TOKENS)."""
    return min(slots // slots_for(length, page_size), pages // max(1, math.ceil(length / page_size)))


@contextlib.contextmanager
def refusing_out_of_memory(device: torch.device) -> Iterator[None]:
    """The model's load on `device` (its weights, their fused forms, the measured passes): the GPU running out of
    memory on the way is GpuMemoryError, saying what was free when the load began and what it had taken by then,
    instead of the allocator's message about one allocation."""
    if device.type != "cuda":
        yield
        return
    free, total = torch.cuda.mem_get_info(device)
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        raise GpuMemoryError(out_of_memory(free, total, torch.cuda.max_memory_reserved(device))) from None


def out_of_memory(free: int, total: int, taken: int) -> str:
    return (
        f"the model does not fit this GPU: it ran out of memory while loading, having taken {gib(taken)} of the "
        f"{gib(free)} free when it began ({gib(total)} in all), and needs more. Serve it on a GPU with more memory, "
        "or free this one of other processes; the largest pass and the state bank shrink with max_state_tokens and "
        "max_row_tokens (KEV_MAX_STATE_TOKENS, KEV_MAX_ROW_TOKENS; docs/operations.md, GPU memory)"
    )
