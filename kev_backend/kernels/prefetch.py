"""Weights into L2 ahead of the GEMM that reads them, while the GPU's memory would otherwise sit idle.

A pass of a few hundred tokens (a short6 on a banked state: 192 row tokens) reads every weight once, and its GEMMs
are bound by how fast they pull them from HBM (the MLP's gate_up at ~2.5 TB/s on the H200). Between a layer's input
projection and its output projection, the DeltaNet's conv, prep and chain (or the attention) run for tens of µs,
bound by latency, with HBM nearly idle. A one-thread-per-row kernel there asks the TMA unit to copy the start of the
next GEMMs' weight rows into L2 (cp.async.bulk.prefetch, sm_90: no registers, no data back to the SM, the kernel
ends at once), so those GEMMs find part of their bytes in L2. A prefetch changes no value anywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 128


@triton.jit
def _l2_prefetch_kernel(w, rows, stride, row_bytes, EVICT_LAST: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    r = tl.minimum(r, rows - 1)  # inline asm takes no mask; prefetching the last row again is harmless
    starts = w + r.to(tl.int64) * stride
    sizes = tl.full([BLOCK], 0, tl.int32) + row_bytes
    if EVICT_LAST:  # kept over ordinary lines until read (and after: the next layer's prefetch ages them out)
        tl.inline_asm_elementwise(
            "{ .reg .b64 policy; createpolicy.fractional.L2::evict_last.b64 policy, 1.0; "
            "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, policy; mov.u32 $0, 0; }",
            "=r,l,r",
            [starts, sizes],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
            "=r,l,r",
            [starts, sizes],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def l2_prefetch(weight: torch.Tensor, fraction: float, evict_last: bool = False) -> None:
    """Asks for the first `fraction` of every row of `weight` [N, K] (K contiguous: the part of each output tile's K
    loop that a GEMM reads first) to be copied into L2. No-op off CUDA (the interpreter has no L2 to fill)."""
    if weight.device.type != "cuda" or fraction <= 0:
        return
    rows, cols = weight.shape
    assert weight.stride(1) == 1
    row_bytes = int(min(fraction, 1.0) * cols * weight.element_size()) // 16 * 16  # bulk copies move 16-byte units
    stride_bytes = weight.stride(0) * weight.element_size()
    assert weight.data_ptr() % 16 == 0 and stride_bytes % 16 == 0, "bulk prefetches need 16-byte alignment"
    if row_bytes == 0:
        return
    _l2_prefetch_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](
        weight, rows, weight.stride(0), row_bytes, EVICT_LAST=evict_last, BLOCK=ROWS_PER_PROGRAM, num_warps=4
    )
