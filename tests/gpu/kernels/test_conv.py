"""kernels.conv (conv_rows: a program per segment; conv_tokens: token slices scanned in parallel) against their torch
reference: in Triton's interpreter on a CPU, compiled on a GPU (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kev_backend.gpu.kernels import conv as conv_kernels
from kev_backend.gpu.kernels import grid
from kev_backend.gpu.kernels.conv import conv_rows, conv_tokens, reference_conv_rows

C = 300  # channels: a partial last block of 256
ROWS_CU = [0, 7, 27, 28]


def strided_input(T: int) -> torch.Tensor:
    """[T, C] read in place from a wider projection."""
    return torch.randn(T, C + 5)[:, 2 : 2 + C]


def test_conv_rows_continue_windows_in_the_pool(kernel_run) -> None:
    """Rows' conv continuing the window held in a pool (two rows on one slot), and the same answers when every launch
    is split into one launch per segment (kernels.grid: CUDA caps the grid's second dimension)."""
    cu = torch.tensor(ROWS_CU)
    x, w, pool, slots = strided_input(28), torch.randn(C, 4), torch.randn(5, C, 4), torch.tensor([3, 0, 3])
    before = pool.clone()
    y = conv_rows(x, w, pool, slots, cu)
    ref = reference_conv_rows(x, w, pool.clone(), slots, cu)
    for n in range(3):
        a, b = ROWS_CU[n], ROWS_CU[n + 1]
        seq = torch.cat([pool[slots[n]][:, 1:], x[a:b].T], dim=1)  # the reference is the formula
        formula = torch.nn.functional.silu(torch.nn.functional.conv1d(seq[None], w[:, None, :], groups=C))[0].T
        assert torch.allclose(ref[a:b], formula, atol=1e-6), n
        assert (y[a:b] - ref[a:b]).abs().max() < kernel_run.tol, n
    assert torch.equal(pool, before)


def test_conv_rows_in_one_segment_launches(kernel_run, monkeypatch) -> None:
    cu = torch.tensor(ROWS_CU)
    x, w, pool, slots = strided_input(28), torch.randn(C, 4), torch.randn(5, C, 4), torch.tensor([3, 0, 3])
    whole = conv_rows(x, w, pool, slots, cu)
    monkeypatch.setattr(grid, "MAX_GRID_Y", 1)
    assert torch.equal(whole, conv_rows(x, w, pool, slots, cu))


def test_conv_rows_new_states_write_their_windows(kernel_run) -> None:
    """New states from a zero window, each writing its last 4 inputs into its slot (NaN until written)."""
    cu, slots = torch.tensor(ROWS_CU), torch.tensor([1, 4, 0])
    x, w = strided_input(28), torch.randn(C, 4)
    windows = torch.full((5, C, 4), float("nan"))
    y = conv_rows(x, w, windows, slots, cu, new_states=True)
    ref_windows = torch.full((5, C, 4), float("nan"))
    ref = reference_conv_rows(x, w, ref_windows, slots, cu, new_states=True)
    for n, slot in enumerate(slots.tolist()):
        a, b = ROWS_CU[n], ROWS_CU[n + 1]
        assert (y[a:b] - ref[a:b]).abs().max() < kernel_run.tol, n
        seq = torch.cat([torch.zeros(C, 4), x[a:b].T], dim=1)
        assert torch.equal(windows[slot], seq[:, -4:]) and torch.equal(windows[slot], ref_windows[slot]), n


# The pass's conv in 32- and in 4-token slices, and in a small pass's (SCAN_SMALL): segments crossing many slices,
# scans starting inside a segment.
SCANS = [(0, 32), (0, 4), (108, 32)]
SCAN_IDS = ["32-token-slices", "4-token-slices", "small-pass"]
LONG_CU = [0, 37, 38, 108, 108]  # an empty last segment


@pytest.fixture(params=SCANS, ids=SCAN_IDS)
def scan(request, monkeypatch) -> None:
    small_tokens, tokens = request.param
    monkeypatch.setattr(conv_kernels, "SCAN_SMALL_TOKENS", small_tokens)
    monkeypatch.setattr(conv_kernels, "SCAN_TOKENS", tokens)


def test_conv_tokens_rows_as_conv_rows(kernel_run, scan) -> None:
    """conv_tokens (each slice finding its first segment) answers as the token-by-token kernel, rows from their
    windows. Compiled, the two sum the window in different orders (fused multiply-adds): equal to rounding."""
    cu, slots = torch.tensor(LONG_CU), torch.tensor([3, 0, 3, 5])
    x, w, pool = strided_input(108), torch.randn(C, 4), torch.randn(6, C, 4)
    y = conv_tokens(x, w, pool, slots, cu)
    assert (y - conv_rows(x, w, pool, slots, cu)).abs().max() < kernel_run.tol
    assert (y - reference_conv_rows(x, w, pool.clone(), slots, cu)).abs().max() < kernel_run.tol


def test_conv_tokens_new_states_as_conv_rows(kernel_run, scan) -> None:
    cu, slots = torch.tensor(LONG_CU), torch.tensor([1, 4, 0, 2])
    x, w = strided_input(108), torch.randn(C, 4)
    windows_a, windows_b = torch.full((6, C, 4), float("nan")), torch.full((6, C, 4), float("nan"))
    ya = conv_tokens(x, w, windows_a, slots, cu, new_states=True)
    yb = conv_rows(x, w, windows_b, slots, cu, new_states=True)
    assert (ya - yb).abs().max() < kernel_run.tol
    ref_windows = torch.full((6, C, 4), float("nan"))
    assert (ya - reference_conv_rows(x, w, ref_windows, slots, cu, new_states=True)).abs().max() < kernel_run.tol
    # the empty segment (slot 2) writes no window
    assert torch.equal(windows_a[[1, 4, 0]], windows_b[[1, 4, 0]])
    assert torch.equal(windows_a[[1, 4, 0]], ref_windows[[1, 4, 0]])


def test_conv_tokens_segments_inside_a_wider_input(kernel_run, scan) -> None:
    """Segments that start after the input's first token and end before its last (a captured pass's long group):
    tokens 0-4 and 100-107 in none, an empty segment in between."""
    x, w, pool = strided_input(108), torch.randn(C, 4), torch.randn(6, C, 4)
    inner, slots = torch.tensor([5, 42, 42, 100]), torch.tensor([3, 0, 5])
    ya = conv_tokens(x, w, pool, slots, inner)
    yb = conv_rows(x[5:], w, pool, slots, inner - 5)
    assert (ya[5:100] - yb[:95]).abs().max() < kernel_run.tol
    assert (ya[5:100] - reference_conv_rows(x, w, pool, slots, inner)[5:100]).abs().max() < kernel_run.tol


def test_conv_tokens_extensions_continue_their_point(kernel_run, scan) -> None:
    """New states continuing a point (`extend`: the window copied into their slot) over their tokens after it: the
    outputs and end windows of the states whole, bit for bit (the same sums of the same inputs). An extension's end
    window goes into the slot its first tokens read the point from: compiled, launched again and again (programs run
    in any order), the first tokens never see the end window."""
    lengths, points = [300, 37, 520], [128, 32, 256]
    x, w = strided_input(sum(lengths)), torch.randn(C, 4)
    cu = torch.tensor([0, 300, 337, 857])
    windows = torch.full((6, C, 4), float("nan"))
    whole = conv_tokens(x, w, windows, torch.tensor([0, 1, 2]), cu, new_states=True)
    starts = [int(cu[n]) + points[n] for n in range(3)]
    tail = torch.cat([x[a : int(cu[n + 1])] for n, a in enumerate(starts)])
    tail_cu = torch.tensor([0, *torch.tensor([n - p for n, p in zip(lengths, points)]).cumsum(0).tolist()])
    at_points = torch.stack([x[a - 4 : a].T for a in starts])  # each point's window: its last 4 inputs
    for _ in range(1 if kernel_run.interpreted else 200):
        windows[3:6] = at_points
        grown = conv_tokens(tail, w, windows, torch.tensor([3, 4, 5]), tail_cu, new_states=True, extend=True)
        assert torch.equal(grown, torch.cat([whole[a : int(cu[n + 1])] for n, a in enumerate(starts)]))
        assert torch.equal(windows[3:6], windows[0:3])
