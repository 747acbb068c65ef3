"""Norms and the MLP activation, with fixed launch configurations.

fla's norm kernels autotune on a bucket of the row count (`NB`), so each new batch size compiles and benchmarks
them again on the request path (throughput collapses while batch sizes vary); these take the block
size from the row width alone. Statistics in fp32, as Qwen3.5's norms compute them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def _token_heads(x: torch.Tensor) -> torch.Tensor:
    """x as [tokens, heads, D] with a unit last stride (a view when possible)."""
    if x.dim() == 2:
        x = x.unsqueeze(1)
    elif x.dim() != 3:
        x = x.reshape(-1, 1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def _rms_norm_kernel(
    x,
    residual,
    residual_out,
    weight,
    y,
    D,
    eps,
    heads,
    stride_x,
    stride_xh,
    stride_r,
    stride_y,
    HAS_RESIDUAL: tl.constexpr,
    STORE_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    # Row `row` is head row % heads of token row // heads: a per-head view of a wider projection, read in place.
    h = tl.load(x + (row // heads) * stride_x + (row % heads) * stride_xh + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual + row * stride_r + cols, mask=mask, other=0.0)
    if STORE_RESIDUAL:
        tl.store(residual_out + row * D + cols, h, mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(weight + cols, mask=mask, other=0.0)
    tl.store(y + row * stride_y + cols, (h * rstd * w).to(y.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    store_residual: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y = RMSNorm(x + residual) · weight over the last dim (weight already 1 + w, fp32). With `store_residual`
    also returns x + residual in fp32 (the residual stream). x: [rows, D], or [tokens, heads, D] with any token and
    head strides (e.g. per-head q or k sliced from a projection), read in place; y is contiguous."""
    x3 = _token_heads(x)
    D = x.shape[-1]
    rows = x3.shape[0] * x3.shape[1]
    y = torch.empty(rows, D, device=x.device, dtype=x.dtype)
    res_out = torch.empty(rows, D, device=x.device, dtype=torch.float32) if store_residual else None
    res = residual.reshape(-1, D) if residual is not None else None
    assert res is None or x3.shape[1] == 1
    if rows:
        _rms_norm_kernel[(rows,)](
            x3,
            res if res is not None else y,
            res_out if res_out is not None else y,
            weight,
            y,
            D,
            eps,
            x3.shape[1],
            x3.stride(0),
            x3.stride(1),
            res.stride(0) if res is not None else 0,
            y.stride(0),
            HAS_RESIDUAL=res is not None,
            STORE_RESIDUAL=store_residual,
            BLOCK=triton.next_power_of_2(D),
        )
    return y.view(x.shape), (res_out.view(x.shape) if res_out is not None else None)


# Rows (token × head) per program of the per-head norms: a head's row is 128 or 256 values, too little for a
# program of its own (a 2,200-token DeltaNet pass has 70,400 such rows per layer).
NORM_ROPE_ROWS = 4
GATED_NORM_ROWS = 8


# The row count varies per pass: one compiled variant for any (no specialisation on its value).
@triton.jit(do_not_specialize=["rows"])
def _rms_norm_rope_kernel(
    x,
    weight,
    cos,
    sin,
    y,
    rows,
    D,
    eps,
    heads,
    stride_x,
    stride_xh,
    stride_c,
    ROT: tl.constexpr,
    BLOCK: tl.constexpr,
    R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    m_r = row < rows
    token = row // heads
    cols = tl.arange(0, BLOCK)
    mask = m_r[:, None] & (cols < D)[None, :]
    src = x + (token * stride_x + (row % heads) * stride_xh)[:, None]
    h = tl.load(src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / D + eps)
    out = h * rstd[:, None] * tl.load(weight + cols, mask=cols < D, other=0.0)[None, :]
    # NeoX RoPE on the first ROT dims: out_c = y_c cos_c - y_{c+ROT/2} sin_c (first half), y_c cos_c + y_{c-ROT/2}
    # sin_c (second half), the partner read again from the row (same statistics).
    half = ROT // 2
    rot = cols < ROT
    m_rot = m_r[:, None] & rot[None, :]
    partner = tl.where(cols < half, cols + half, cols - half)
    y_partner = tl.load(src + partner[None, :], mask=m_rot, other=0.0).to(tl.float32) * rstd[:, None]
    y_partner = y_partner * tl.load(weight + partner, mask=rot, other=0.0)[None, :]
    c = tl.load(cos + (token * stride_c)[:, None] + cols[None, :], mask=m_rot, other=1.0)
    s = tl.load(sin + (token * stride_c)[:, None] + cols[None, :], mask=m_rot, other=0.0)
    out = tl.where(rot[None, :], out * c + tl.where(cols < half, -y_partner, y_partner) * s, out)
    tl.store(y + row[:, None] * D + cols[None, :], out.to(y.dtype.element_ty), mask=mask)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """Per-head RMSNorm (weight already 1 + w, fp32) then NeoX RoPE on the first cos.shape[-1] dims, in one read:
    Qwen3.5's q and k. x: [tokens, heads, D] with any token and head strides (read in place); cos, sin: [tokens,
    rotary dims] fp32. Returns y [tokens, heads, D] contiguous, in x's dtype (one rounding)."""
    x3 = _token_heads(x)
    T, H, D = x3.shape
    rot = cos.shape[-1]
    assert cos.shape == sin.shape == (T, rot) and cos.stride() == sin.stride() and cos.stride(-1) == 1
    assert rot % 2 == 0 and rot <= D
    y = torch.empty(T, H, D, device=x.device, dtype=x.dtype)
    if T * H:
        _rms_norm_rope_kernel[(triton.cdiv(T * H, NORM_ROPE_ROWS),)](
            x3,
            weight,
            cos,
            sin,
            y,
            T * H,
            D,
            eps,
            H,
            x3.stride(0),
            x3.stride(1),
            cos.stride(0),
            ROT=rot,
            BLOCK=triton.next_power_of_2(D),
            R=NORM_ROPE_ROWS,
        )
    return y


@triton.jit(do_not_specialize=["rows"])
def _gated_rms_norm_kernel(
    x, z, weight, y, rows, D, eps, heads, stride_x, stride_z, stride_zh, stride_y, BLOCK: tl.constexpr, R: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    cols = tl.arange(0, BLOCK)
    mask = (row < rows)[:, None] & (cols < D)[None, :]
    h = tl.load(x + row[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g_rows = z + ((row // heads) * stride_z + (row % heads) * stride_zh)[:, None]
    g = tl.load(g_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / D + eps)
    w = tl.load(weight + cols, mask=cols < D, other=0.0)
    out = h * rstd[:, None] * w[None, :] * (g * tl.sigmoid(g))
    tl.store(y + row[:, None] * stride_y + cols[None, :], out.to(y.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeltaNet output norm: RMSNorm(x) · weight · silu(z), per row of the last dim. x: [rows, D] or
    [tokens, heads, D]; z likewise, with any token and head strides (the z slice of the projection, read in
    place). Returns y shaped like x, contiguous."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    z3 = _token_heads(z)
    rows = x2.shape[0]
    assert z3.shape[0] * z3.shape[1] == rows
    y = torch.empty(rows, D, device=x.device, dtype=x.dtype)
    if rows:
        _gated_rms_norm_kernel[(triton.cdiv(rows, GATED_NORM_ROWS),)](
            x2,
            z3,
            weight,
            y,
            rows,
            D,
            eps,
            z3.shape[1],
            x2.stride(0),
            z3.stride(0),
            z3.stride(1),
            y.stride(0),
            BLOCK=triton.next_power_of_2(D),
            R=GATED_NORM_ROWS,
        )
    return y.view(x.shape)


@triton.jit
def _silu_mul_kernel(gate_up, y, width, stride_g, stride_y, BLOCK: tl.constexpr):
    row, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = i_c * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(gate_up + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up + row * stride_g + width + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y + row * stride_y + cols, (g * tl.sigmoid(g) * u).to(y.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The MLP's activation: silu(gate) · up from the concatenated [gate | up] projection [rows, 2I], in one read
    (fp32 inside, one rounding)."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(1) == 1
    y = torch.empty(rows, width, device=gate_up.device, dtype=gate_up.dtype)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(width, 1024))](
            gate_up, y, width, gate_up.stride(0), y.stride(0), BLOCK=1024
        )
    return y


@triton.jit(do_not_specialize=["rows"])
def _sigmoid_gate_kernel(x, gate, y, rows, D, heads, stride_g, stride_gh, BLOCK: tl.constexpr, R: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    cols = tl.arange(0, BLOCK)
    mask = (row < rows)[:, None] & (cols < D)[None, :]
    h = tl.load(x + row[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g_rows = gate + ((row // heads) * stride_g + (row % heads) * stride_gh)[:, None]
    g = tl.load(g_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(y + row[:, None] * D + cols[None, :], (h * tl.sigmoid(g)).to(y.dtype.element_ty), mask=mask)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Gated attention's output gate: x · sigmoid(gate) (fp32 inside, one rounding). x: [tokens, heads, D]
    contiguous; gate: [tokens, heads, D] with any token and head strides (the gate half of the per-head [q | gate]
    projection, read in place). Returns [tokens, heads · D] in x's dtype."""
    T, H, D = x.shape
    assert x.is_contiguous() and gate.shape == x.shape and gate.stride(2) == 1
    y = torch.empty(T, H * D, device=x.device, dtype=x.dtype)
    if T * H:
        _sigmoid_gate_kernel[(triton.cdiv(T * H, NORM_ROPE_ROWS),)](
            x,
            gate,
            y,
            T * H,
            D,
            H,
            gate.stride(0),
            gate.stride(1),
            BLOCK=triton.next_power_of_2(D),
            R=NORM_ROPE_ROWS,
        )
    return y


# Plain torch references, one per kernel above (fp32 inside, one rounding to x's dtype, as the kernels): what
# tests/gpu/kernels/test_norms.py compares the kernels with, and the fused pass's CPU stand-ins
# (tests/gpu/fused_cpu_ops.py).

# A CPU runs an element-wise op on more than at::internal::GRAIN_SIZE elements on several threads, each given an equal
# count of elements, not of rows: a cut inside a row makes the row's elements before it the tail of a vector loop,
# computed with the scalar math (libm's exp, not SLEEF's), which rounds apart. A row's gate would then change with
# the rows beside it (tests/dev/test_invariance.py, 16 threads on an AVX-512 CPU). Blocks of whole rows under that size
# run on one thread each.
_ONE_THREAD_ELEMENTS = 32768


def _in_row_blocks(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """op(x) for an element-wise `op`, computed on blocks of x's rows (dim 0) small enough for one thread."""
    rows = max(1, _ONE_THREAD_ELEMENTS // max(1, math.prod(x.shape[1:])))
    return op(x) if x.shape[0] <= rows else torch.cat([op(block) for block in x.split(rows)])


def reference_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    store_residual: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rms_norm in torch: (RMSNorm(x + residual) · weight in x's dtype, x + residual in fp32 with `store_residual`)."""
    h = x.float() + (residual if residual is not None else 0.0)
    y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)
    return y, (h if store_residual else None)


def reference_rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """rms_norm_rope in torch: per-head RMSNorm, then NeoX RoPE (rotate half) on the first cos.shape[-1] dims of each
    head, as model.qwen35.apply_rope. x [tokens, heads, D]; cos, sin [tokens, rotary dims]."""
    h = x.float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight
    dim, half = cos.shape[-1], cos.shape[-1] // 2
    rot, rest = y[..., :dim], y[..., dim:]
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos[:, None] + rotated * sin[:, None], rest), dim=-1).contiguous().to(x.dtype)


def reference_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """gated_rms_norm in torch: RMSNorm(x) · weight · silu(z), z reshaped as x."""
    h = x.float()
    gate = _in_row_blocks(F.silu, z.float()).reshape(h.shape)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight * gate).to(x.dtype)


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul in torch: silu(gate) · up of [gate | up]."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (_in_row_blocks(F.silu, gate) * up).to(gate_up.dtype)


def reference_sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """sigmoid_gate in torch: x · sigmoid(gate) as [tokens, heads · D]."""
    return (x.float() * _in_row_blocks(torch.sigmoid, gate.float())).to(x.dtype).reshape(x.shape[0], -1)
