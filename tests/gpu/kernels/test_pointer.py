"""kernels.pointer (the head's projection and the pointer softmax) against torch: in Triton's interpreter on a CPU,
compiled on a GPU (tests/conftest.py)."""

from __future__ import annotations

import torch

from kev_backend.gpu.kernels.pointer import (
    PROJECT_ROWS,
    pointer_project,
    pointer_softmax,
    reference_pointer_softmax,
)


def test_pointer_projection_is_the_same_for_a_row_in_any_batch(kernel_run) -> None:
    """Each pick's [q | k] is addmm's within fp32 rounding (no TF32 even compiled), and compiled, bit for bit the
    same alone, among other rows at any position and inside a batch of any size: the batch never changes a pick's
    numbers. (The interpreter runs a tile's dot through numpy, whose BLAS may sum a row by its place in the tile.)"""
    d, dp = 100, 40  # neither a multiple of the tiles
    weight_t, bias = torch.randn(d, 2 * dp) / d**0.5, torch.randn(2 * dp)
    hidden = torch.randn(3 * PROJECT_ROWS + 5, d)
    got = pointer_project(hidden, weight_t, bias)
    assert (got - torch.addmm(bias, hidden, weight_t)).abs().max() < 1e-5
    same = torch.equal if not kernel_run.interpreted else lambda a, b: (a - b).abs().max() < 1e-6
    for i in (0, 7, PROJECT_ROWS + 1, hidden.shape[0] - 1):
        assert same(pointer_project(hidden[i : i + 1], weight_t, bias), got[i : i + 1]), i
        moved = torch.cat([torch.randn(i % 5 + 2, d), hidden[i : i + 1], torch.randn(40, d)])
        assert same(pointer_project(moved, weight_t, bias)[i % 5 + 2], got[i]), i
    assert pointer_project(hidden[:0], weight_t, bias).shape == (0, 2 * dp)


def test_pointer_softmax(kernel_run) -> None:
    """Questions of 1 to 40 options (several of the kernel's 16-option steps), a head width that is no power of two,
    a temperature; each row zero past its question's options."""
    dp, widths, n_cols = 24, [2, 1, 40, 5, 17], 40
    decides = [sum(1 + n for n in widths[:i]) for i in range(len(widths))]
    projected = torch.randn(sum(1 + n for n in widths), 2 * dp)
    got = pointer_softmax(projected, torch.tensor(decides), torch.tensor(widths), n_cols, 2.0)
    ref = reference_pointer_softmax(projected, torch.tensor(decides), torch.tensor(widths), n_cols, 2.0)
    for i, (d, n) in enumerate(zip(decides, widths)):
        z = projected[d + 1 : d + 1 + n, dp:] @ projected[d, :dp] / dp**0.5 / 2.0
        assert torch.allclose(ref[i, :n], torch.softmax(z, 0)), i  # the reference is the formula
        assert (got[i, :n] - ref[i, :n]).abs().max() < 1e-6, i
        assert torch.equal(got[i, n:], torch.zeros(n_cols - n)), i
