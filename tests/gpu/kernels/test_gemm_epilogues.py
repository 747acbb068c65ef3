"""The Triton GEMMs that `python -m bench.diag gemmepilogues` times against cuBLASLt (docs/kernels.md cites its
figures): each gives the product it is timed as, on shapes whose rows, columns and inner dimension all end inside
a tile, whether its grid is one program a tile or a persistent one walking several. Compiled, they run on bf16
operands as timed (Triton's interpreter has no bf16: there, fp32), against the fp32 product of the same values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.diag.gemm_epilogues import gemm, gemm_residual, interleaved, swiglu_interleaved

# (BM, BN, BK, stages, warps, group, programs): small tiles, so that every dimension ends mid-tile; 3 programs walk
# the tiles persistently, 0 gives each tile its own.
CONFIGS = [(32, 32, 32, 1, 4, 2, 0), (32, 32, 32, 1, 4, 2, 3), (64, 32, 32, 2, 4, 1, 0)]
M, K, WIDTH = 70, 96, 80


def _operands(kernel_run, *shapes: tuple[int, int]) -> list[torch.Tensor]:
    """Random operands (scaled to keep products near 1) in the kernels' dtype: bf16 compiled, fp32 interpreted."""
    dtype = torch.float32 if kernel_run.interpreted else torch.bfloat16
    return [(torch.randn(shape) / shape[1] ** 0.25).to(dtype) for shape in shapes]


def _assert_close(out: torch.Tensor, expected: torch.Tensor, kernel_run) -> None:
    """Within the interpreter's tolerance; compiled, within a bf16 output's rounding (2⁻⁸ of the value) and the fp32
    sums' order."""
    error = (out.float() - expected).abs()
    if kernel_run.interpreted:
        bound = kernel_run.tol + kernel_run.rel * expected.abs().max().item()
    else:
        bound = expected.abs() * 2**-8 + 1e-4 * expected.abs().max().item()
    assert (error <= bound).all(), f"largest error {error.max().item():.3g}"


@pytest.mark.parametrize("config", CONFIGS)
def test_plain_gemm_is_the_product(kernel_run, config) -> None:
    x, w = _operands(kernel_run, (M, K), (2 * WIDTH, K))
    y = torch.full((M, 2 * WIDTH), float("nan"), dtype=x.dtype)
    gemm(x, w, y, config)
    _assert_close(y, x.float() @ w.float().T, kernel_run)


@pytest.mark.parametrize("config", CONFIGS)
def test_interleaved_activation_is_silu_of_gate_times_up(kernel_run, config) -> None:
    x, gate_up = _operands(kernel_run, (M, K), (2 * WIDTH, K))
    y = torch.full((M, WIDTH), float("nan"), dtype=x.dtype)
    swiglu_interleaved(x, interleaved(gate_up), y, config)
    projected = x.float() @ gate_up.float().T
    _assert_close(y, F.silu(projected[:, :WIDTH]) * projected[:, WIDTH:], kernel_run)


def test_interleaved_rows_alternate_gate_and_up() -> None:
    gate_up = torch.arange(8.0).reshape(8, 1)
    assert interleaved(gate_up).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("config", CONFIGS)
def test_residual_epilogue_adds_into_the_stream(kernel_run, config) -> None:
    x, w = _operands(kernel_run, (M, K), (WIDTH, K))
    stream = torch.randn(M, WIDTH)
    before = stream.clone()
    product = x.float() @ w.float().T
    gemm_residual(x, w, stream, config)
    _assert_close(stream, before + product, kernel_run)
    gemm_residual(x, w, stream, config)  # a second projection adds again: nothing was overwritten
    _assert_close(stream, before + 2 * product, kernel_run)
