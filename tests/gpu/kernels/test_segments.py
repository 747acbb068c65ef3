"""kernels.segments.segment_of (the device-side binary search the scanning conv and the chunked delta rule's prep
use) against its torch reference, through a small test kernel: in Triton's interpreter on a CPU, compiled on a GPU
(tests/conftest.py). And kernels.grid's launch spans."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kev_backend.gpu.kernels.grid import segment_spans
from kev_backend.gpu.kernels.segments import (
    MAX_SEGMENTS,
    reference_segment_of,
    search_steps,
    segment_bounds,
    segment_of,
)


@triton.jit
def _segment_of_kernel(cu, N, t, out, steps, BLOCK: tl.constexpr, SCALAR: tl.constexpr):
    """segment_of for BLOCK token positions a program, as a block or one scalar at a time."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if SCALAR:
        for i in range(BLOCK):
            tok = tl.load(t + tl.program_id(0) * BLOCK + i).to(tl.int64)
            tl.store(out + tl.program_id(0) * BLOCK + i, segment_of(cu, N, tok, steps))
    else:
        tl.store(out + o, segment_of(cu, N, tl.load(t + o).to(tl.int64), steps))


def lookup(cu: torch.Tensor, t: torch.Tensor, scalar: bool) -> torch.Tensor:
    block = 16
    assert t.shape[0] % block == 0
    n = cu.shape[0] - 1
    out = torch.full_like(t, -1)
    _segment_of_kernel[(t.shape[0] // block,)](cu, n, t, out, search_steps(n), BLOCK=block, SCALAR=scalar)
    return out


CUS = {
    "one": [0, 20],
    "empty-segments": [0, 0, 3, 3, 3, 7, 8, 8],  # empty first, middle and last segments
    "inside-a-wider-input": [5, 8, 24, 41, 42, 42, 75, 77],  # tokens before the first and after the last
    "many": None,  # 300 random lengths, zeros among them: a deeper search
}


@pytest.mark.parametrize("scalar", [False, True], ids=["block", "scalar"])
@pytest.mark.parametrize("case", list(CUS))
def test_segment_of(kernel_run, case: str, scalar: bool) -> None:
    offsets = CUS[case]
    if offsets is None:
        offsets = [0, *torch.randint(0, 4, (300,)).cumsum(0).tolist()]
    cu = torch.tensor(offsets)
    t = torch.arange(((offsets[-1] + 3) // 16 + 1) * 16)  # every token, and some past the last segment
    got = lookup(cu, t, scalar)
    ref = reference_segment_of(cu, t)
    assert torch.equal(got, ref), (got - ref).nonzero().flatten()[:10].tolist()
    for n, (a, b) in enumerate(segment_bounds(cu)):  # the reference is the contract: a token's own segment
        assert (ref[a:b] == n).all(), n
    assert (ref[t >= offsets[-1]] == len(offsets) - 1).all()


def test_search_steps() -> None:
    assert [search_steps(n) for n in (0, 1, 2, 3, 4, 7, 8, 300)] == [1, 1, 2, 2, 3, 3, 4, 9]
    with pytest.raises(AssertionError):
        search_steps(MAX_SEGMENTS)


def test_segment_spans(monkeypatch) -> None:
    assert segment_spans(5, 32) == [(0, 5)]
    monkeypatch.setattr("kev_backend.gpu.kernels.grid.MAX_GRID_Y", 64)
    assert segment_spans(5, 32) == [(0, 2), (2, 4), (4, 5)]
    assert segment_spans(3, 100) == [(0, 1), (1, 2), (2, 3)]  # at least one segment a launch
    assert segment_spans(0, 4) == []
