"""Kev's pointer softmax in one kernel, from the head's projections of every picked token (scoring/head.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Options per step of a question's loop (System One allows up to 255; most questions have 2-6).
OPTIONS_PER_STEP = 16


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
    """pointer_softmax in torch (tests/test_kernel_pointer.py): question by question, softmax over its options of
    (k_j · q) / √dp / T; zeros past them."""
    dp = projected.shape[1] // 2
    out = torch.zeros(decides.shape[0], n_cols, device=projected.device, dtype=torch.float32)
    for i, (d, n) in enumerate(zip(decides.tolist(), widths.tolist())):
        z = projected[d + 1 : d + 1 + n, dp:].float() @ projected[d, :dp].float() / dp**0.5 / temperature
        out[i, :n] = torch.softmax(z, 0)
    return out
