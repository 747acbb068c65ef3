"""An experiment, not used by the engine: a Triton GEMM for the few-hundred-row passes of single requests (y = x wᵀ,
x [M, K] bf16, w [N, K] bf16), to time against cuBLASLt at Kev-4B's projection shapes.

Why: short6 on a banked state is a pass of ~192 rows; its GEMMs take 2.95 ms on the H200, ~1.6x the time to read
the weights once, because cuBLASLt's tiles for these shapes leave SMs idle (448×64 tiles: 84 CTAs on 132 SMs;
bench/NOTES.md, session 5). Here every program reads a BN-column slice of w once for all M rows (BM ≥ M), so the
grid is N / BN programs, times SPLIT_K slices of K when N alone does not fill the GPU. Split-K partial sums go to an
fp32 workspace and are added in a fixed order by a second kernel: the answer does not depend on timing, and for a
given configuration not on M.

Outcome (H200, session 9, bench/NOTES.md): no configuration beat cuBLASLt at these shapes with the weights read past
L2; the pass's GEMMs took 1.2-1.8x longer. Kept as the record of what was tried.

`python bench/diag.py smallgemm` sweeps CONFIGS per shape and row count against F.linear (cuBLASLt, as the engine
sets it), with the largest difference from it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BM, BN, BK, SPLIT_K, warps, stages[, SWAP]). SWAP computes yᵀ = w xᵀ: the weights' rows take the MMA's M side
# (64 per warpgroup) and the pass's rows its N side (8-256), so a program can hold few weight rows and all the pass's
# rows, and small N projections (out, down: N = 2,560) still spread over every SM.
CONFIGS = (
    (64, 64, 64, 1, 4, 4),
    (128, 64, 64, 1, 4, 4),
    (256, 64, 64, 1, 8, 3),
    (256, 32, 128, 1, 4, 3),
    (256, 32, 64, 1, 4, 4),
    (256, 16, 64, 1, 4, 4),
    (256, 64, 64, 2, 8, 3),
    (256, 64, 64, 4, 8, 3),
    (128, 128, 64, 2, 8, 3),
    (256, 128, 64, 1, 8, 3),
    (256, 64, 64, 1, 4, 4, 1),
    (128, 64, 64, 1, 4, 4, 1),
    (256, 64, 128, 1, 4, 2, 1),
    (64, 64, 128, 1, 4, 4, 1),
)


@triton.jit
def _gemm_kernel(
    x,
    w,
    y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
    SWAP: tl.constexpr,
):
    """Program (m, n, s): rows [m·BM, +BM) × columns [n·BN, +BN) over K slice s; fp32 partials into y [SPLIT_K, M,
    N] (SPLIT_K > 1) or bf16 into y [M, N]. The row tiles of one column slice are neighbours in launch order, so
    they read that slice of w from L2 after the first."""
    i_m, i_n, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    per_split = K // SPLIT_K  # a multiple of BK (small_m_linear checks): no mask along K, and none along N
    rows = o_m[:, None] < M
    a_ptr = x + o_m[:, None] * stride_xm + (i_s * per_split + o_k)[None, :]
    b_ptr = w + o_n[:, None] * stride_wn + (i_s * per_split + o_k)[None, :]
    if SWAP:
        acc_t = tl.zeros([BN, BM], dtype=tl.float32)
        for _ in tl.range(0, per_split, BK, num_stages=STAGES):
            acc_t = tl.dot(tl.load(b_ptr), tl.trans(tl.load(a_ptr, mask=rows, other=0.0)), acc_t)
            a_ptr += BK
            b_ptr += BK
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for _ in tl.range(0, per_split, BK, num_stages=STAGES):
            acc = tl.dot(tl.load(a_ptr, mask=rows, other=0.0), tl.trans(tl.load(b_ptr)), acc)
            a_ptr += BK
            b_ptr += BK
    inside = (o_m[:, None] < M) & (o_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y + o_m[:, None] * stride_ym + o_n[None, :], acc.to(y.dtype.element_ty), mask=inside)
    else:
        tl.store(y + (i_s * M + o_m[:, None]) * N + o_n[None, :], acc, mask=inside)


@triton.jit
def _split_sum_kernel(parts, y, M, N, stride_ym, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """y = Σ_s parts[s] in s order (fp32, then y's dtype)."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = o < M * N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(parts + s * M * N + o, mask=inside, other=0.0)
    tl.store(y + (o // N) * stride_ym + o % N, total.to(y.dtype.element_ty), mask=inside)


def small_m_linear(x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...] = CONFIGS[2]) -> torch.Tensor:
    """F.linear(x, w) without bias, x [M, K] and w [N, K] contiguous, by `config` (BM, BN, BK, SPLIT_K, warps,
    stages[, swap])."""
    bm, bn, bk, split_k, warps, stages = config[:6]
    swap = bool(config[6]) if len(config) > 6 else False
    (m, k), n = x.shape, w.shape[0]
    assert x.stride(1) == 1 and w.stride(1) == 1 and w.shape[1] == k
    assert n % bn == 0 and k % (bk * split_k) == 0, "Kev-4B's projections: N and K multiples of the tiles"
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    parts = y if split_k == 1 else torch.empty(split_k, m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split_k)
    _gemm_kernel[grid](
        x, w, parts, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BM=bm, BN=bn, BK=bk, SPLIT_K=split_k, STAGES=stages, SWAP=swap, num_warps=warps,
    )  # fmt: skip
    if split_k > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](parts, y, m, n, y.stride(0), SPLIT_K=split_k, BLOCK=block)
    return y
