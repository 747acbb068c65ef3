"""Qwen3.5's depthwise causal conv (kernel 4) + SiLU for segments reading or writing their window in the bank.

The pass uses conv_tokens for every segment; conv_rows (token by token, its predecessor for short segments) stays
while bench/diag.py long compares the two on the GPU."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import grid
from .segments import search_steps, segment_of


@triton.jit
def _conv_rows_kernel(
    x, weight, pool, slots, cu, y, C, stride_xt, stride_yt, W: tl.constexpr, BC: tl.constexpr, CONTINUE: tl.constexpr
):
    i_c, n = tl.program_id(0), tl.program_id(1)
    bos, eos = tl.load(cu + n).to(tl.int64), tl.load(cu + n + 1).to(tl.int64)
    slot = tl.load(slots + n).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    # The window: the last W inputs, [C, W] right-aligned in the bank slot (slot 0 is x_{-4}, 3 is x_{-1}).
    base = pool + (slot * C + o_c) * W
    if CONTINUE:  # a row continues its state's window
        x4 = tl.load(base + 0, mask=m_c, other=0.0).to(tl.float32)
        x3 = tl.load(base + 1, mask=m_c, other=0.0).to(tl.float32)
        x2 = tl.load(base + 2, mask=m_c, other=0.0).to(tl.float32)
        x1 = tl.load(base + 3, mask=m_c, other=0.0).to(tl.float32)
    else:  # a new state starts from zeros
        x4 = tl.zeros([BC], dtype=tl.float32)
        x3 = tl.zeros([BC], dtype=tl.float32)
        x2 = tl.zeros([BC], dtype=tl.float32)
        x1 = tl.zeros([BC], dtype=tl.float32)
    w0 = tl.load(weight + o_c * W + 0, mask=m_c, other=0.0).to(tl.float32)
    w1 = tl.load(weight + o_c * W + 1, mask=m_c, other=0.0).to(tl.float32)
    w2 = tl.load(weight + o_c * W + 2, mask=m_c, other=0.0).to(tl.float32)
    w3 = tl.load(weight + o_c * W + 3, mask=m_c, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        x0 = tl.load(x + t * stride_xt + o_c, mask=m_c, other=0.0).to(tl.float32)
        acc = w0 * x3 + w1 * x2 + w2 * x1 + w3 * x0
        out = acc * tl.sigmoid(acc)
        tl.store(y + t * stride_yt + o_c, out.to(y.dtype.element_ty), mask=m_c)
        x4, x3, x2, x1 = x3, x2, x1, x0
    if not CONTINUE:  # a new state's window goes into its (fresh) bank slot
        tl.store(base + 0, x4.to(pool.dtype.element_ty), mask=m_c)
        tl.store(base + 1, x3.to(pool.dtype.element_ty), mask=m_c)
        tl.store(base + 2, x2.to(pool.dtype.element_ty), mask=m_c)
        tl.store(base + 3, x1.to(pool.dtype.element_ty), mask=m_c)


def conv_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    cu: torch.Tensor,
    new_states: bool = False,
) -> torch.Tensor:
    """Depthwise causal conv (kernel 4) + SiLU for question rows, each continuing the conv window held in
    `pool[slots[n]]` ([C, 4], right-aligned as fla keeps it) without copying it; or, with `new_states`, for new
    states from a zero window, each writing its last 4 inputs into `pool[slots[n]]`. x: [T, C] with unit channel
    stride; weight: [C, 4]. Returns y [T, C] in x's dtype."""
    T, C = x.shape
    W = weight.shape[1]
    assert W == 4 and x.stride(1) == 1 and weight.is_contiguous() and pool.is_contiguous()
    y = torch.empty(T, C, device=x.device, dtype=x.dtype)
    BC = 256
    for first, last in grid.segment_spans(slots.shape[0], 1):
        _conv_rows_kernel[(triton.cdiv(C, BC), last - first)](
            x,
            weight,
            pool,
            slots[first:last],
            cu[first : last + 1],
            y,
            C,
            x.stride(0),
            y.stride(0),
            W=W,
            BC=BC,
            CONTINUE=not new_states,
        )
    return y


# Tokens × channels per program of conv_tokens, and warps, for new states. H200, Kev-4B's 8,192 channels (bench/diag.py
# long, dd024d3), ms for 1/8/24 new states of 2,200 tokens and 1/32 of 34: 64×64/4 0.068/0.437/1.31/0.026/0.036;
# 32×128/4 0.068/0.467/1.41/0.042/0.035; 16×128/8 (before) 0.123/0.982/3.00/0.045/0.069. Rows (reading their state's
# window through per-token pointers; 5597f85, ms for 192×39, 40×100 and 6×39 rows): 32×128/4 0.394/0.192/0.045 (spills
# 756 bytes on sm_90a), 16×256/4 0.393/0.198/0.052, 64×64/4 0.442/0.223/0.049, 16×128/8 (before) 0.472/0.239/0.050.
NEW_TOKEN_TILE = (64, 64)
NEW_TOKEN_WARPS = 4
TOKEN_TILE = (32, 128)
TOKEN_WARPS = 4


# The segment count varies per pass: one compiled variant for any (no specialisation on its value).
@triton.jit(do_not_specialize=["N", "steps"])
def _conv_tokens_kernel(
    x,
    weight,
    pool,
    slots,
    cu,
    y,
    C,
    N,
    stride_xt,
    stride_yt,
    steps,
    W: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    CONTINUE: tl.constexpr,
):
    i_c, i_t = tl.program_id(0), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    # Each token's segment; tokens outside every segment (before cu[0], from cu[N]) are left alone.
    n = segment_of(cu, N, t, steps)
    m_t = (t >= tl.load(cu).to(tl.int64)) & (n < N)
    bos = tl.load(cu + n, mask=m_t, other=0).to(tl.int64)
    eos = tl.load(cu + n + 1, mask=m_t, other=0).to(tl.int64)
    slot = tl.load(slots + n, mask=m_t, other=0).to(tl.int64)
    base = pool + (slot[:, None] * C + o_c[None, :]) * W  # each token's window [C, W]: W + d holds x_{bos + d}
    mask = m_t[:, None] & m_c[None, :]
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):  # tap j multiplies x_{t - (W - 1) + j}
        src = t - (W - 1) + j
        inside = src >= bos
        value = tl.load(x + src[:, None] * stride_xt + o_c[None, :], mask=mask & inside[:, None], other=0.0)
        value = value.to(tl.float32)
        if CONTINUE:  # before the segment: its state's window (new states: zeros)
            held = W + (src - bos)
            before = (~inside) & (held >= 0)
            value += tl.load(base + held[:, None], mask=mask & before[:, None], other=0.0).to(tl.float32)
        acc += tl.load(weight + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)[None, :] * value
    out = acc * tl.sigmoid(acc)
    tl.store(y + t[:, None] * stride_yt + o_c[None, :], out.to(y.dtype.element_ty), mask=mask)
    if not CONTINUE:  # a segment's last token writes its window: the last W inputs, zeros before its start
        last = mask & (t == eos - 1)[:, None]
        for j in tl.static_range(W):
            token = eos - W + j
            held = tl.load(
                x + token[:, None] * stride_xt + o_c[None, :], mask=last & (token >= bos)[:, None], other=0.0
            )
            tl.store(base + j, held.to(pool.dtype.element_ty), mask=last)


# Tokens per program of the scanning conv, and channels per program on SCAN_WARPS warps. Four channels per thread
# hold ~64 registers (sm_90a), eight 128: 32 or 16 warps per SM. bench/diag.py long sweeps them on the H200.
SCAN_TOKENS = 32
SCAN_CHANNELS = 256
SCAN_WARPS = 2
# Which conv the pass runs: "scan" (_conv_scan_kernel) or "tiles" (_conv_tokens_kernel), until the H200 has compared
# them (KEV_CONV).
CONV = os.environ.get("KEV_CONV", "scan")


# The segment count varies per pass: one compiled variant for any (no specialisation on its value).
@triton.jit(do_not_specialize=["N", "steps"])
def _conv_scan_kernel(
    x,
    weight,
    pool,
    slots,
    cu,
    y,
    C,
    N,
    stride_xt,
    stride_yt,
    steps,
    W: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    CONTINUE: tl.constexpr,
):
    """conv_tokens in BT-token slices of the input, each scanned token by token by one program per BC channels: the
    window lives in registers, so each input is loaded once, and the program holds a few [BC] vectors, not the
    [BT, BC] tiles of pointers and masks that limit _conv_tokens_kernel to two programs per SM. The scan of a
    segment that starts before the slice begins W tokens early (outputs not stored) to fill the window."""
    i_c, i_t = tl.program_id(0), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    w0 = tl.load(weight + o_c * W + 0, mask=m_c, other=0.0).to(tl.float32)
    w1 = tl.load(weight + o_c * W + 1, mask=m_c, other=0.0).to(tl.float32)
    w2 = tl.load(weight + o_c * W + 2, mask=m_c, other=0.0).to(tl.float32)
    w3 = tl.load(weight + o_c * W + 3, mask=m_c, other=0.0).to(tl.float32)
    # Tokens before cu[0] or from cu[N] belong to no segment and are left alone.
    first = tl.maximum(i_t.to(tl.int64) * BT, tl.load(cu).to(tl.int64))
    last = tl.minimum(i_t.to(tl.int64) * BT + BT, tl.load(cu + N).to(tl.int64))
    n = segment_of(cu, N, first, steps)  # first >= last: n is N or its segment starts at or after last
    bos = tl.load(cu + n, mask=n < N, other=0).to(tl.int64)
    while (n < N) & (bos < last):
        eos = tl.load(cu + n + 1).to(tl.int64)
        lo, hi = tl.maximum(bos, first), tl.minimum(eos, last)
        start = tl.maximum(bos, lo - W)  # where the scan starts: the segment's start, or W tokens before lo
        base = pool + (tl.load(slots + n).to(tl.int64) * C + o_c) * W  # the window [C, W]: W - d holds x_{bos - d}
        # The window before `start`: a row's state's window when the scan starts at the row's first token, else
        # zeros (a new state's start; or a scan started inside the segment, which replaces them before lo).
        x4 = tl.zeros([BC], dtype=tl.float32)
        x3 = tl.zeros([BC], dtype=tl.float32)
        x2 = tl.zeros([BC], dtype=tl.float32)
        x1 = tl.zeros([BC], dtype=tl.float32)
        if CONTINUE:
            if start == bos:
                x4 = tl.load(base + 0, mask=m_c, other=0.0).to(tl.float32)
                x3 = tl.load(base + 1, mask=m_c, other=0.0).to(tl.float32)
                x2 = tl.load(base + 2, mask=m_c, other=0.0).to(tl.float32)
                x1 = tl.load(base + 3, mask=m_c, other=0.0).to(tl.float32)
        for t in range(start, lo):
            x0 = tl.load(x + t * stride_xt + o_c, mask=m_c, other=0.0).to(tl.float32)
            x4, x3, x2, x1 = x3, x2, x1, x0
        # Token t + 1's input is loaded while token t's output is computed and stored.
        ahead = tl.load(x + lo * stride_xt + o_c, mask=m_c & (lo < hi), other=0.0)
        for t in range(lo, hi):
            x0 = ahead.to(tl.float32)
            ahead = tl.load(x + (t + 1) * stride_xt + o_c, mask=m_c & (t + 1 < hi), other=0.0)
            acc = w0 * x3 + w1 * x2 + w2 * x1 + w3 * x0
            tl.store(y + t * stride_yt + o_c, (acc * tl.sigmoid(acc)).to(y.dtype.element_ty), mask=m_c)
            x4, x3, x2, x1 = x3, x2, x1, x0
        if not CONTINUE:  # the program with a new state's last token writes its window: its last W inputs
            end = m_c & (hi == eos) & (hi > lo)
            tl.store(base + 0, x4.to(pool.dtype.element_ty), mask=end)
            tl.store(base + 1, x3.to(pool.dtype.element_ty), mask=end)
            tl.store(base + 2, x2.to(pool.dtype.element_ty), mask=end)
            tl.store(base + 3, x1.to(pool.dtype.element_ty), mask=end)
        n += 1
        bos = tl.load(cu + n, mask=n < N, other=0).to(tl.int64)


def conv_tokens(
    x: torch.Tensor,
    weight: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    cu: torch.Tensor,
    new_states: bool = False,
) -> torch.Tensor:
    """conv_rows' job (same arguments) for segments of any length and number: tiles of tokens × channels over the
    whole input, each token finding its segment by binary search in `cu`. The grid depends only on x's size, so it
    can be captured; tokens outside the segments are not written. A new state's window is written by its last
    token, so an empty new segment writes none (the engine has none; a graph's padding segments are empty)."""
    T, C = x.shape
    W = weight.shape[1]
    n = slots.shape[0]
    assert x.stride(1) == 1 and weight.is_contiguous() and pool.is_contiguous()
    y = torch.empty(T, C, device=x.device, dtype=x.dtype)
    if n and T and CONV == "scan":
        _conv_scan_kernel[(triton.cdiv(C, SCAN_CHANNELS), triton.cdiv(T, SCAN_TOKENS))](
            x,
            weight,
            pool,
            slots,
            cu,
            y,
            C,
            n,
            x.stride(0),
            y.stride(0),
            search_steps(n),
            W=W,
            BT=SCAN_TOKENS,
            BC=SCAN_CHANNELS,
            CONTINUE=not new_states,
            num_warps=SCAN_WARPS,
        )
        return y
    BT, BC = NEW_TOKEN_TILE if new_states else TOKEN_TILE
    if n and T:
        _conv_tokens_kernel[(triton.cdiv(C, BC), triton.cdiv(T, BT))](
            x,
            weight,
            pool,
            slots,
            cu,
            y,
            C,
            n,
            x.stride(0),
            y.stride(0),
            search_steps(n),
            W=W,
            BT=BT,
            BC=BC,
            CONTINUE=not new_states,
            num_warps=NEW_TOKEN_WARPS if new_states else TOKEN_WARPS,
        )
    return y
