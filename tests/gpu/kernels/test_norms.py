"""kernels.norms (rms_norm, gated_rms_norm, rms_norm_rope, silu_mul, sigmoid_gate) against their torch references
(`reference_*` beside each kernel): in Triton's interpreter on a CPU, compiled on a GPU (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kev_backend.gpu.kernels.norms import (
    gated_rms_norm,
    reference_gated_rms_norm,
    reference_rms_norm,
    reference_rms_norm_rope,
    reference_sigmoid_gate,
    reference_silu_mul,
    rms_norm,
    rms_norm_rope,
    sigmoid_gate,
    silu_mul,
)
from kev_backend.model.qwen35 import apply_rope

EPS = 1e-6


def relative(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).abs().max() / ref.abs().max()).item()


def strided_rows(D: int, N: int) -> torch.Tensor:
    """[N, D] rows read in place from a wider projection (a strided view)."""
    return torch.randn(N, D + 7)[:, 3 : 3 + D]


def head_layout() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [q | gate] per-head projection of 9 tokens × 3 heads × 32: (the projection, q and gate as [9, 3, 32] views
    with token and head strides)."""
    proj = torch.randn(9, 3 * 2 * 32 + 5)
    heads = proj[:, : 3 * 2 * 32].view(9, 3, 2 * 32)
    return proj, heads[..., :32], heads[..., 32:]


@pytest.mark.parametrize(("D", "N"), [(64, 3), (256, 37)])
def test_rms_norm_with_the_fp32_residual_stream(kernel_run, D: int, N: int) -> None:
    x, residual, w = strided_rows(D, N), torch.randn(N, D), 1 + 0.1 * torch.randn(D)
    y, out = rms_norm(x, w, EPS, residual, store_residual=True)
    ref, ref_out = reference_rms_norm(x, w, EPS, residual, store_residual=True)
    assert torch.equal(out, x + residual) and torch.equal(out, ref_out)
    assert relative(y, ref) < kernel_run.rel


@pytest.mark.parametrize(("D", "N"), [(64, 3), (256, 37)])
def test_rms_norm_without_residual(kernel_run, D: int, N: int) -> None:
    x, w = strided_rows(D, N), 1 + 0.1 * torch.randn(D)
    y, none = rms_norm(x, w, EPS)
    assert none is None and relative(y, reference_rms_norm(x, w, EPS)[0]) < kernel_run.rel


@pytest.mark.parametrize(("D", "N"), [(64, 3), (256, 37)])
def test_gated_rms_norm(kernel_run, D: int, N: int) -> None:
    x, w, z = strided_rows(D, N), 1 + 0.1 * torch.randn(D), torch.randn(N, D)
    assert relative(gated_rms_norm(x, z, w, EPS), reference_gated_rms_norm(x, z, w, EPS)) < kernel_run.rel


def test_rms_norm_per_head_in_place(kernel_run) -> None:
    """Per-head norms read in place from a projection: [tokens, heads, D] views with token and head strides."""
    _, q, _ = head_layout()
    w = 1 + 0.1 * torch.randn(32)
    y, _ = rms_norm(q, w, EPS)
    assert y.is_contiguous() and relative(y, reference_rms_norm(q, w, EPS)[0]) < kernel_run.rel


def test_gated_rms_norm_gate_per_head_in_place(kernel_run) -> None:
    proj, _, _ = head_layout()
    w = 1 + 0.1 * torch.randn(32)
    x, z = torch.randn(9 * 3, 32), proj[:, 5 : 5 + 96].view(9, 3, 32)
    assert relative(gated_rms_norm(x, z, w, EPS), reference_gated_rms_norm(x, z, w, EPS)) < kernel_run.rel


def test_rms_norm_rope_in_place(kernel_run) -> None:
    """q's norm and partial RoPE in one kernel, read in place from the [q | gate] per-head layout."""
    _, q, _ = head_layout()
    w = 1 + 0.1 * torch.randn(32)
    angles = torch.rand(9, 4) * 6
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    y = rms_norm_rope(q, w, EPS, cos, sin)
    normed = reference_rms_norm(q, w, EPS)[0]
    formula = apply_rope(normed.transpose(0, 1), cos, sin).transpose(0, 1)  # the model's RoPE
    assert torch.allclose(reference_rms_norm_rope(q, w, EPS, cos, sin), formula, atol=1e-6)
    assert y.is_contiguous() and relative(y, reference_rms_norm_rope(q, w, EPS, cos, sin)) < kernel_run.rel * 4


def test_silu_mul_strided(kernel_run) -> None:
    gate_up = torch.randn(5, 2 * 1500 + 3)[:, : 2 * 1500]
    assert relative(silu_mul(gate_up), reference_silu_mul(gate_up)) < kernel_run.rel


def test_sigmoid_gate_in_place(kernel_run) -> None:
    """The attention output gate, the gate read in place from the [q | gate] per-head layout."""
    _, _, gate = head_layout()
    out = torch.randn(9, 3, 32)
    y = sigmoid_gate(out, gate)
    assert y.shape == (9, 96) and relative(y, reference_sigmoid_gate(out, gate)) < kernel_run.rel


def test_references_give_a_row_the_same_bits_beside_any_rows() -> None:
    """The fused pass's CPU stand-ins on 16 threads: each token's activations alone and among 1,031 tokens agree bit
    for bit (a CPU's threads cut an element-wise op into equal counts of elements, and a cut inside a row would
    round that row's tail apart: tests/dev/test_invariance.py)."""
    torch.manual_seed(0)
    T, threads = 1031, torch.get_num_threads()
    gate_up, out, gate = torch.randn(T, 256), torch.randn(T, 4, 32), torch.randn(T, 4, 64)[..., 32:]
    x, z, w = torch.randn(T * 4, 16), torch.randn(T, 4, 16), 1 + 0.1 * torch.randn(16)
    cases = {
        "silu_mul": lambda t: reference_silu_mul(gate_up[t]),
        "sigmoid_gate": lambda t: reference_sigmoid_gate(out[t], gate[t]),
        "gated_rms_norm": lambda t: reference_gated_rms_norm(x.view(T, 4, 16)[t].flatten(0, 1), z[t], w, EPS),
    }
    torch.set_num_threads(16)
    try:
        for name, op in cases.items():
            alone = torch.cat([op(slice(i, i + 1)) for i in range(T)])
            assert torch.equal(op(slice(None)), alone), name
    finally:
        torch.set_num_threads(threads)
