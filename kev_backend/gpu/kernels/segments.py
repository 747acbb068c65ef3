"""Which varlen segment a token belongs to, found on the device: a binary search in the offsets `cu` ([N + 1],
segment n holds tokens [cu[n], cu[n + 1])). Kernels tile their input by token position and look each token (or
each tile's first token) up, so their grids depend only on the input's size, never on the segments' lengths: no
host-side maps, capturable in a CUDA graph for any lengths."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# At most 2^16 segments per call.
MAX_SEGMENTS = 2**16


def search_steps(n: int) -> int:
    """Halvings that find one of n segments (or none past them): each is a dependent load, so a call searches
    only as deep as its own segment count needs (a constant 16 cost ~6x on a single long state's conv). The count
    is the segments tensor's length, a shape, hence fixed inside a captured graph."""
    assert n < MAX_SEGMENTS
    return max(1, n.bit_length())


@triton.jit
def segment_of(cu, N, t, steps):
    """The first segment n whose end cu[n + 1] is past token t (its own segment when cu[n] <= t; empty segments
    are passed over), N when t is at or past cu[N]; `steps` from search_steps(N). t: a scalar or a block of token
    positions (int64)."""
    lo = t * 0
    hi = t * 0 + N
    for _ in range(steps):
        active = lo < hi
        mid = (lo + hi) // 2
        right = tl.load(cu + mid + 1, mask=active, other=0).to(tl.int64) <= t
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    return lo


# Plain torch references (tests/gpu/kernels/test_segments.py), and the segments' bounds the other kernels' references
# walk.


def reference_segment_of(cu: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """segment_of in torch: for each token position in t, the first segment whose end cu[n + 1] is past it (N past
    cu[N])."""
    return torch.searchsorted(cu[1:].contiguous(), t, right=True)


def segment_bounds(cu: torch.Tensor) -> list[tuple[int, int]]:
    """Each segment's [start, end) token offsets, from cu [N + 1]."""
    offsets = cu.tolist()
    return list(zip(offsets[:-1], offsets[1:]))
