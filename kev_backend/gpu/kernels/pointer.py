"""Kev's pointer head on a GPU: the head's projection of every picked token, and the pointer softmax in one kernel
from those projections (scoring/head.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Options per step of a question's loop (System One allows up to 255; most questions have 2-6).
OPTIONS_PER_STEP = 16


# The projection's tiles: fixed, whatever the number of picks. Each output is its row's sum over the inner dimension
# in steps of PROJECT_INNER, in order, so a pick's [q | k] has the same bits in any batch and any padding (cuBLAS
# picks its kernel, and with it the order of the sums, by the row count).
PROJECT_ROWS, PROJECT_COLS, PROJECT_INNER = 32, 64, 32


@triton.jit(do_not_specialize=["M"])
def _project_kernel(x, w, bias, y, M, N, K, stride_x, stride_w, stride_y, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):  # fmt: skip
    """y [M, N] = x [M, K] @ w [K, N] + bias, fp32 products and sums (no TF32): a (BM, BN) tile a program."""
    rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_m, m_n = rm < M, rn < N
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        m_k = kk < K
        a = tl.load(x + rm[:, None] * stride_x + kk[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b = tl.load(w + kk[:, None] * stride_w + rn[None, :], mask=m_k[:, None] & m_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    acc += tl.load(bias + rn, mask=m_n, other=0.0)[None, :]
    tl.store(y + rm[:, None] * stride_y + rn[None, :], acc, mask=m_m[:, None] & m_n[None, :])


def pointer_project(hidden: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """hidden [n, d] fp32 @ weight_t [d, 2·dp] + bias → [n, 2·dp] fp32 (each pick's [q | k]), row by row the same
    in any batch."""
    assert hidden.dtype == weight_t.dtype == bias.dtype == torch.float32
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    assert weight_t.stride(1) == 1 and bias.stride(0) == 1
    (m, k), n = hidden.shape, weight_t.shape[1]
    y = torch.empty(m, n, device=hidden.device, dtype=torch.float32)
    if m:
        grid = (triton.cdiv(m, PROJECT_ROWS), triton.cdiv(n, PROJECT_COLS))
        _project_kernel[grid](
            hidden, weight_t, bias, y, m, n, k, hidden.stride(0), weight_t.stride(0), y.stride(0),
            BM=PROJECT_ROWS, BN=PROJECT_COLS, BK=PROJECT_INNER,
        )  # fmt: skip
    return y


@triton.jit
def _pointer_softmax_kernel(
    p, decides, widths, out, stride_p, stride_o, n_cols, root_dp, temperature, DP, BD: tl.constexpr, BW: tl.constexpr
):
    """One question a program: its <decide> row d of p [n, 2·DP] ([q | k] projections of every pick), its options the
    `widths[i]` rows after it; z_j = (k_j · q) / √dp / T, softmax over its options into out[i] (zeros past them)."""
    i = tl.program_id(0)
    d = tl.load(decides + i)
    w = tl.load(widths + i)
    o_d = tl.arange(0, BD)
    m_d = o_d < DP
    q = tl.load(p + d * stride_p + o_d, mask=m_d, other=0.0)
    o_w = tl.arange(0, BW)
    top = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    for j0 in range(0, w, BW):  # the logits, kept in out, with a running maximum and sum of exponentials
        j = j0 + o_w
        m_j = j < w
        k = tl.load(p + (d + 1 + j)[:, None] * stride_p + DP + o_d[None, :], mask=m_j[:, None] & m_d[None, :])
        z = tl.where(m_j, tl.sum(k * q[None, :], axis=1) / root_dp / temperature, float("-inf"))
        tl.store(out + i * stride_o + j, z, mask=m_j)
        new_top = tl.maximum(top, tl.max(z, axis=0))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(z - new_top), axis=0)
        top = new_top
    for j0 in range(0, n_cols, BW):
        j = j0 + o_w
        z = tl.load(out + i * stride_o + j, mask=j < w, other=float("-inf"))
        tl.store(out + i * stride_o + j, tl.exp(z - top) / total, mask=j < n_cols)


def pointer_softmax(
    projected: torch.Tensor, decides: torch.Tensor, widths: torch.Tensor, n_cols: int, temperature: float
) -> torch.Tensor:
    """projected [n, 2·dp] fp32 ([q | k] of each pick), decides [Q] (each question's <decide> row; its options are
    the widths[i] rows after it) → p [Q, n_cols] fp32, each row zero past its options."""
    dp = projected.shape[1] // 2
    assert projected.dtype == torch.float32 and projected.stride(1) == 1
    out = torch.empty(decides.shape[0], n_cols, device=projected.device, dtype=torch.float32)
    if decides.shape[0]:
        _pointer_softmax_kernel[(decides.shape[0],)](
            projected,
            decides,
            widths,
            out,
            projected.stride(0),
            out.stride(0),
            n_cols,
            dp**0.5,
            temperature,
            dp,
            BD=triton.next_power_of_2(dp),
            BW=OPTIONS_PER_STEP,
        )
    return out


def reference_pointer_softmax(
    projected: torch.Tensor, decides: torch.Tensor, widths: torch.Tensor, n_cols: int, temperature: float
) -> torch.Tensor:
    """pointer_softmax in torch (tests/gpu/kernels/test_pointer.py): question by question, softmax over its options of
    (k_j · q) / √dp / T; zeros past them."""
    dp = projected.shape[1] // 2
    out = torch.zeros(decides.shape[0], n_cols, device=projected.device, dtype=torch.float32)
    for i, (d, n) in enumerate(zip(decides.tolist(), widths.tolist())):
        z = projected[d + 1 : d + 1 + n, dp:].float() @ projected[d, :dp].float() / dp**0.5 / temperature
        out[i, :n] = torch.softmax(z, 0)
    return out
