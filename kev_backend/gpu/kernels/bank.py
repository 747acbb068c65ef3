"""New states' K and V into the bank's pages, both in one launch.

torch's index_copy_ takes a launch for each and runs at about half the copy rate. Here a program copies one token's K
row and V row (every KV head: the rows are contiguous), with the token's strides as given, so a view of the
projection's V columns is read in place (docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bank_kv_kernel(k, v, keys, values, dst, stride_k, stride_v, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    row = tl.load(dst + t).to(tl.int64) * WIDTH  # the token's row in the pool
    tl.store(keys + row + cols, tl.load(k + t * stride_k + cols, mask=mask), mask=mask)
    tl.store(values + row + cols, tl.load(v + t * stride_v + cols, mask=mask), mask=mask)


def bank_kv(keys: torch.Tensor, values: torch.Tensor, dst: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """keys[dst] = k and values[dst] = v (index_copy_ along dim 0 for both): k and v [T, heads, D], each token's heads
    contiguous (any token stride); keys and values [rows, heads, D] contiguous; dst [T] integer rows."""
    T = k.shape[0]
    assert v.shape == k.shape and keys.shape == values.shape and keys.shape[1:] == k.shape[1:] and dst.shape == (T,)
    assert keys.is_contiguous() and values.is_contiguous() and keys.dtype == k.dtype and values.dtype == v.dtype
    width = k.shape[1] * k.shape[2]
    for x in (k, v):
        assert x.stride(2) == 1 and x.stride(1) == x.shape[2], "each token's heads must be contiguous"
    if T == 0:
        return
    block = min(triton.next_power_of_2(width), 1024)
    _bank_kv_kernel[(T, triton.cdiv(width, block))](
        k, v, keys, values, dst, k.stride(0), v.stride(0), WIDTH=width, BLOCK=block, num_warps=4
    )


def reference_bank_kv(
    keys: torch.Tensor, values: torch.Tensor, dst: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """bank_kv in torch (tests/gpu/kernels/test_bank.py): index_copy_ along dim 0 for both."""
    keys.index_copy_(0, dst, k)
    values.index_copy_(0, dst, v)
