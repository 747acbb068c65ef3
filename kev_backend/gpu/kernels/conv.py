"""Qwen3.5's depthwise causal conv (kernel 4) + SiLU for segments reading or writing their window in the bank.

The pass uses conv_tokens for every segment; conv_rows (a program per segment, token by token) is the tests' and
bench/diag's reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import grid
from .segments import search_steps, segment_bounds, segment_of


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


# Tokens per program of the scanning conv, and channels per program on SCAN_WARPS warps (four per thread): the
# fastest slice for one long state, within a few per cent of the best for many (docs/kernels.md). Outputs do not
# depend on the slice.
SCAN_TOKENS = 32
SCAN_CHANNELS = 256
SCAN_WARPS = 2
# Passes of up to SCAN_SMALL_TOKENS tokens (a lone request's rows or short state: r192, s64) scan in SCAN_SMALL's
# (tokens, channels, warps): at 32×256/2 a 192-token pass would have only 192 programs of 2 warps, where every
# program's path is a few load latencies in series (finding its segment, four tokens a step). Shorter slices, more
# programs (docs/kernels.md). Outputs identical.
SCAN_SMALL_TOKENS = 256
SCAN_SMALL = (8, 128, 1)
# Channels per program of the extensions' window store (a few programs per state: W loads and stores each).
STORE_CHANNELS = 1024


def scan_config(tokens: int) -> tuple[int, int, int]:
    """(tokens, channels, warps) a program for a pass of `tokens` tokens (read at each launch)."""
    return SCAN_SMALL if tokens <= SCAN_SMALL_TOKENS else (SCAN_TOKENS, SCAN_CHANNELS, SCAN_WARPS)


@triton.jit
def _store_silu(y, t, stride_yt, o_c, mask, acc):
    """Token t's conv output through SiLU, rounded to y's dtype."""
    tl.store(y + t * stride_yt + o_c, (acc * tl.sigmoid(acc)).to(y.dtype.element_ty), mask=mask)


@triton.jit
def _input_before(x, stride_xt, o_c, m_c, t, start, bos, window, W: tl.constexpr, CONTINUE: tl.constexpr):
    """The conv's input at token t, one of the W - 1 before a scan's first output: x's from `start` on; before it (the
    scan then starts at its segment's first token, bos) a row's state's window entry (W - d holds x_{bos - d}), or zero
    (a new state's start)."""
    value = tl.load(x + t * stride_xt + o_c, mask=m_c & (t >= start), other=0.0).to(tl.float32)
    if CONTINUE:
        value += tl.load(window + W - (bos - t), mask=m_c & (t < start), other=0.0).to(tl.float32)
    return value


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
    STORE: tl.constexpr,
):
    """conv_tokens in BT-token slices of the input, each scanned token by token by one program per BC channels: the
    window lives in registers, so each input is loaded once, and a program holds a few [BC] vectors (no [BT, BC]
    tiles of pointers and masks). The scan of a segment that starts before the slice first reads the W - 1 inputs
    before it to fill the window."""
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
        start = tl.maximum(bos, lo - W)  # the segment's start, or W tokens before lo: no input before it is read
        base = pool + (tl.load(slots + n).to(tl.int64) * C + o_c) * W  # the window [C, W]: W - d holds x_{bos - d}
        # The three inputs before lo, loaded at once (one token after another would put three load latencies in
        # series on every program's path).
        x3 = _input_before(x, stride_xt, o_c, m_c, lo - 3, start, bos, base, W, CONTINUE)
        x2 = _input_before(x, stride_xt, o_c, m_c, lo - 2, start, bos, base, W, CONTINUE)
        x1 = _input_before(x, stride_xt, o_c, m_c, lo - 1, start, bos, base, W, CONTINUE)
        # Four tokens a step, their inputs loaded a step ahead: eight loads in flight per program where one token
        # a step would keep two (the scan is bound by load latency, not bandwidth). Past `hi` loads give zeros and
        # stores are masked off.
        n0 = tl.load(x + lo * stride_xt + o_c, mask=m_c & (lo < hi), other=0.0)
        n1 = tl.load(x + (lo + 1) * stride_xt + o_c, mask=m_c & (lo + 1 < hi), other=0.0)
        n2 = tl.load(x + (lo + 2) * stride_xt + o_c, mask=m_c & (lo + 2 < hi), other=0.0)
        n3 = tl.load(x + (lo + 3) * stride_xt + o_c, mask=m_c & (lo + 3 < hi), other=0.0)
        for t in range(lo, hi, 4):
            c0, c1, c2, c3 = n0, n1, n2, n3
            n0 = tl.load(x + (t + 4) * stride_xt + o_c, mask=m_c & (t + 4 < hi), other=0.0)
            n1 = tl.load(x + (t + 5) * stride_xt + o_c, mask=m_c & (t + 5 < hi), other=0.0)
            n2 = tl.load(x + (t + 6) * stride_xt + o_c, mask=m_c & (t + 6 < hi), other=0.0)
            n3 = tl.load(x + (t + 7) * stride_xt + o_c, mask=m_c & (t + 7 < hi), other=0.0)
            a0, a1, a2, a3 = c0.to(tl.float32), c1.to(tl.float32), c2.to(tl.float32), c3.to(tl.float32)
            _store_silu(y, t, stride_yt, o_c, m_c, w0 * x3 + w1 * x2 + w2 * x1 + w3 * a0)
            _store_silu(y, t + 1, stride_yt, o_c, m_c & (t + 1 < hi), w0 * x2 + w1 * x1 + w2 * a0 + w3 * a1)
            _store_silu(y, t + 2, stride_yt, o_c, m_c & (t + 2 < hi), w0 * x1 + w1 * a0 + w2 * a1 + w3 * a2)
            _store_silu(y, t + 3, stride_yt, o_c, m_c & (t + 3 < hi), w0 * a0 + w1 * a1 + w2 * a2 + w3 * a3)
            x3, x2, x1 = a1, a2, a3
        if STORE:  # the program with a new state's last token writes its window: its last W inputs, read again
            # (zeros before the segment's start). Not an extension's: conv_tokens stores those after the scan.
            end = hi == eos
            if end & (hi > lo):
                for d in tl.static_range(W):
                    src = eos - W + d
                    x_d = tl.load(x + src * stride_xt + o_c, mask=m_c & (src >= bos), other=0.0)
                    tl.store(base + d, x_d.to(pool.dtype.element_ty), mask=m_c)
        n += 1
        bos = tl.load(cu + n, mask=n < N, other=0).to(tl.int64)


@triton.jit
def _store_windows_kernel(x, pool, slots, cu, C, stride_xt, W: tl.constexpr, BC: tl.constexpr):
    """Each segment's last W inputs into its slot's window (an empty segment writes none): extensions, which are W
    tokens or more (gpu/pool.py EXTEND_MIN_TOKENS)."""
    i_c, n = tl.program_id(0), tl.program_id(1)
    bos, eos = tl.load(cu + n).to(tl.int64), tl.load(cu + n + 1).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    base = pool + (tl.load(slots + n).to(tl.int64) * C + o_c) * W
    if eos > bos:
        for d in tl.static_range(W):
            x_d = tl.load(x + (eos - W + d) * stride_xt + o_c, mask=m_c, other=0.0)
            tl.store(base + d, x_d.to(pool.dtype.element_ty), mask=m_c)


def conv_tokens(
    x: torch.Tensor,
    weight: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    cu: torch.Tensor,
    new_states: bool = False,
    extend: bool = False,
) -> torch.Tensor:
    """conv_rows' job (same arguments) for segments of any length and number: slices of SCAN_TOKENS tokens of the
    whole input scanned in parallel, each finding its first segment by binary search in `cu`. The grid depends
    only on x's size, so it can be captured; tokens outside the segments are not written. A new state's window is
    written by the program holding its last token, so an empty new segment writes none (the engine has none; a
    graph's padding segments are empty). With `new_states` and `extend`, each new state (at least W tokens)
    continues the window its slot holds (the point it extends, copied there) instead of zeros; its end window is
    written by a second launch, after every slice has read the window it continues (within one launch the program
    holding a state's last token may store before the program holding its first has loaded)."""
    T, C = x.shape
    W = weight.shape[1]
    n = slots.shape[0]
    assert x.stride(1) == 1 and weight.is_contiguous() and pool.is_contiguous()
    y = torch.empty(T, C, device=x.device, dtype=x.dtype)
    if n and T:
        block_t, block_c, warps = scan_config(T)
        _conv_scan_kernel[(triton.cdiv(C, block_c), triton.cdiv(T, block_t))](
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
            BT=block_t,
            BC=block_c,
            CONTINUE=extend or not new_states,
            STORE=new_states and not extend,
            num_warps=warps,
        )
        if new_states and extend:
            for first, last in grid.segment_spans(n, 1):
                _store_windows_kernel[(triton.cdiv(C, STORE_CHANNELS), last - first)](
                    x, pool, slots[first:last], cu[first : last + 1], C, x.stride(0), W=W, BC=STORE_CHANNELS
                )
    return y


def reference_conv_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    cu: torch.Tensor,
    new_states: bool = False,
    extend: bool = False,
) -> torch.Tensor:
    """conv_rows' and conv_tokens' job in torch (tests/gpu/kernels/test_conv.py, tests/gpu/fused_cpu_ops.py), segment by
    segment: silu(depthwise conv1d) over [the window | the segment's inputs]; with `new_states` from a zero window
    (`extend`: the slot's), writing the last W inputs into pool[slot] (an empty segment writes its start window).
    Tokens outside the segments are zeros."""
    y = torch.zeros_like(x)
    for (lo, hi), slot in zip(segment_bounds(cu), slots.tolist()):
        window = torch.zeros_like(pool[slot]) if new_states and not extend else pool[slot]
        seq = torch.cat([window, x[lo:hi].T], dim=1)
        if hi > lo:
            y[lo:hi] = F.silu(F.conv1d(seq[None, :, 1:], weight[:, None, :], groups=weight.shape[0]))[0].T
        if new_states:
            pool[slot] = seq[:, -weight.shape[1] :]
    return y
