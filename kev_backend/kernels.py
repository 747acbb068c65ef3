"""Small Triton kernels for the fused path, with fixed launch configurations.

fla's norm kernels autotune on a bucket of the row count (`NB`), so each new batch size compiles and benchmarks
them again on the request path (seen: 64-client throughput collapsing while batches grew); these take the block
size from the row width alone. Statistics in fp32, as Qwen3.5's norms compute them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x,
    residual,
    residual_out,
    weight,
    y,
    D,
    eps,
    stride_x,
    stride_r,
    stride_y,
    HAS_RESIDUAL: tl.constexpr,
    STORE_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
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
    also returns x + residual in fp32 (the residual stream)."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty(rows, D, device=x.device, dtype=x.dtype)
    res_out = torch.empty(rows, D, device=x.device, dtype=torch.float32) if store_residual else None
    res = residual.reshape(-1, D) if residual is not None else None
    if rows:
        _rms_norm_kernel[(rows,)](
            x2,
            res if res is not None else x2,
            res_out if res_out is not None else y,
            weight,
            y,
            D,
            eps,
            x2.stride(0),
            res.stride(0) if res is not None else 0,
            y.stride(0),
            HAS_RESIDUAL=res is not None,
            STORE_RESIDUAL=store_residual,
            BLOCK=triton.next_power_of_2(D),
        )
    return y.view(x.shape), (res_out.view(x.shape) if res_out is not None else None)


@triton.jit
def _gated_rms_norm_kernel(x, z, weight, y, D, eps, stride_x, stride_z, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(z + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(weight + cols, mask=mask, other=0.0)
    out = h * rstd * w * (g * tl.sigmoid(g))
    tl.store(y + row * stride_y + cols, out.to(y.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeltaNet output norm: RMSNorm(x) · weight · silu(z), per row of the last dim (x, z: [rows, D])."""
    D = x.shape[-1]
    x2, z2 = x.reshape(-1, D), z.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if z2.stride(-1) != 1:
        z2 = z2.contiguous()
    rows = x2.shape[0]
    y = torch.empty(rows, D, device=x.device, dtype=x.dtype)
    if rows:
        _gated_rms_norm_kernel[(rows,)](
            x2, z2, weight, y, D, eps, x2.stride(0), z2.stride(0), y.stride(0), BLOCK=triton.next_power_of_2(D)
        )
    return y.view(x.shape)
