"""The gated delta rule in chunks for segments read from or written to the bank in place: any length, grids that
depend only on token and segment counts (graph-capturable). One algorithm, hence one module over 600 lines: the chunk's
preparation, the chain across chunks and their launch share its layout and its numerics, with its torch reference."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .segments import search_steps, segment_bounds, segment_of
from .streams import beside


@triton.jit
def _delta_rule_program(
    item,
    a_log,
    dt_bias,
    pool,
    slots,
    cu,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    CONTINUE: tl.constexpr,
):
    """What a delta-rule item (segment n, value head hv, value block i_v) works on: its key and value heads, its
    segment [bos, eos), its key and value offsets, the head's gate constants, where its state block lives in the
    pool and that block's start value."""
    i_nh, i_v = item // (V // BV), item % (V // BV)
    n, hv = i_nh // HV, i_nh % HV
    hk = hv // (HV // H)  # each key head serves HV // H consecutive value heads
    bos, eos = tl.load(cu + n).to(tl.int64), tl.load(cu + n + 1).to(tl.int64)
    slot = tl.load(slots + n).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    # The gate: g = -exp(A_log) · softplus(a + dt_bias) (log decay, fp32) and beta = sigmoid(b), as Qwen3.5 has them.
    decay_rate = tl.exp(tl.load(a_log + hv).to(tl.float32))
    bias = tl.load(dt_bias + hv).to(tl.float32)
    state = pool + ((slot * HV + hv) * K + o_k[:, None]) * V + o_v[None, :]
    if CONTINUE:  # a row: the state it continues, read in place from its bank slot ([K, BV] of [Hv, K, V], fp32);
        # not for an empty segment (a captured pass's padding: most of a bucket's row slots), which reads nothing
        h = tl.load(state, mask=eos > bos, other=0.0)
    else:  # a new state: from zero
        h = tl.zeros([K, BV], dtype=tl.float32)
    return hk, hv, bos, eos, o_k, o_v, decay_rate, bias, state, h


@triton.jit
def _next_item(item, bos, end, items):
    """A program's item after `item` (whose segment starts at bos): tl.num_programs(0) items on, or none (`items`)
    once a segment starts where the segments' tokens end. Offsets only grow, so every later segment is empty there:
    the padding of a captured pass's group (most of its capacity), which needs no program of its own."""
    return tl.where(bos < end, item + tl.num_programs(0), items)


# The chunked delta rule's fp32 products (the prep's always; the chain's off a GPU, _bf16_chain) take operands
# rounded to TF32 on tensor cores (10-bit mantissa) and accumulate in fp32; the state stays fp32. At K = 128 and 32
# value columns on 8 warps "ieee" (FMA loops) and "tf32x3" spill registers on sm_90a (ptxas -v).
PRECISION: tl.constexpr = tl.constexpr("tf32")
# Tokens per chunk. (I + A)⁻¹ of a strictly lower-triangular A [CHUNK, CHUNK] is a product of log2(CHUNK) factors
# (I + A^(2^j)). 32-token chunks put fewer steps on the chain but their prep spills registers and runs slower; 64
# would need 262 KB of shared memory (an H200 has 232 KB): docs/kernels.md.
CHUNK = 16


def _bf16_chain(x: torch.Tensor) -> bool:
    """Whether the chain multiplies bf16 operands (_dot): on a GPU, where it is faster and no further from the fp32
    reference than TF32 (docs/kernels.md). Triton's interpreter (CPU tensors) has no bf16 (numpy multiplies bf16
    operands as raw bits), so there the chain takes fp32 operands, exact in the interpreter."""
    return x.is_cuda


# The sequential pass's (value columns per program, warps, register cap: ptxas's .maxnreg, None for up to 255), read
# at each launch: NARROW while the pass has at most WIDE_ABOVE programs per SM at NARROW's value block, WIDE above.
# One state wants short programs, one per SM; many states want programs that share SMs. Each value column's
# arithmetic is the same in both, so a state answers alike alone and in a batch (identical outputs). Other blocks,
# warp counts and register caps are slower (docs/kernels.md).
CHUNK_NARROW: tuple[int, int, int | None] = (32, 4, None)
CHUNK_WIDE: tuple[int, int, int | None] = (64, 4, None)
WIDE_ABOVE = 2
# Warps per prep program: 2, faster than 4 with identical outputs (docs/kernels.md). With whole chunks unmasked it
# compiles without spills on 2 warps (230 registers as launched: tests/gpu/kernels/test_compiled_for_hopper.py).
PREP_WARPS = 2
# A register cap on the prep (None: none). Uncapped it takes 230 registers on 2 warps, four programs an SM; at 168 six
# fit, for a few bytes of spill stores, and new states' prep and chain run faster (docs/kernels.md). Identical outputs
# (a cap moves values between registers and memory, never changes the arithmetic).
PREP_MAXNREG: int | None = 168
# A prep program looks for chunk starts in CHUNK tokens of the input, one per segment reaching into them: rows of ~31
# tokens put two in most windows (one row's second chunk, the next row's first), so a short6's rows wait for two
# chunks' terms in series (narrower windows for rows, with more programs, are slower in the engine: docs/kernels.md).
# The prep multiplies in TF32 (bf16 operands there would change the outputs). W, Qs, Kd, QK and U₀ are stored as the
# chain multiplies them (_bf16_chain): bf16 on a GPU, fp32 otherwise. U₀ in bf16 (as fla stores its u) adds a
# rounding before U = U₀ − W S, which the chain's products round to bf16 anyway; it halves U₀'s bytes, written here
# and read there.


@triton.jit
def _dot(x, y, BF16: tl.constexpr):
    """x @ y for the chunked delta rule's chain: fp32 operands on TF32 tensor cores, or (BF16) rounded to bf16 as fla's
    chunked kernels do, which halves the registers an MMA operand takes; fp32 accumulation either way."""
    if BF16:
        product = tl.dot(x.to(tl.bfloat16), y.to(tl.bfloat16))
    else:  # (an else, not an early return: Triton would type-check the tf32 form on bf16 operands too)
        product = tl.dot(x.to(tl.float32), y.to(tl.float32), input_precision=PRECISION)
    return product


@triton.jit
def _l2_normalised(x):
    """Rows of x [BT, K] (fp32) over their L2 norm, as use_qk_l2norm_in_kernel does."""
    return x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit
def _chunk_gates(a, b, t, m, stride_at, hv, decay_rate, bias):
    """A chunk's cumulative log decay γ (g summed from the chunk's start; g = 0 past the segment's end, so γ stays
    at its last value there) and β, both [BT] fp32, 0 β past the end."""
    b_a = tl.load(a + t * stride_at + hv, mask=m, other=0.0).to(tl.float32) + bias
    g = tl.where(m, -decay_rate * tl.where(b_a > 20.0, b_a, tl.log(1.0 + tl.exp(b_a))), 0.0)
    beta = tl.where(m, tl.sigmoid(tl.load(b + t * stride_at + hv, mask=m, other=0.0).to(tl.float32)), 0.0)
    return tl.cumsum(g, axis=0), beta


@triton.jit
def _load_rows(ptrs, m, MASKED: tl.constexpr):
    """A [BT, n] tile, its rows past a segment's end (~m) read as zeros when MASKED (a segment's last chunk), all
    read otherwise: only a partial chunk pays for per-element masks."""
    if MASKED:
        x = tl.load(ptrs, mask=m[:, None], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _store_rows(ptrs, x, m, MASKED: tl.constexpr):
    """_load_rows' store: rows past a segment's end are left alone when MASKED."""
    if MASKED:
        tl.store(ptrs, x, mask=m[:, None])
    else:
        tl.store(ptrs, x)


@triton.jit
def _chunk_terms(
    q,
    k,
    v,
    a,
    b,
    w,
    u,
    qs,
    kd,
    qk,
    dend,
    c0,
    eos,
    hk,
    hv,
    decay_rate,
    bias,
    scale,
    stride_t,
    stride_vt,
    stride_at,
    HV,
    K,
    V,
    BT,
    LOG2_BT,
    MASKED,
):
    """One chunk's state-independent terms (tokens [c0, min(c0 + BT, eos)) of one segment; MASKED unless the chunk
    is whole), written per token: W and U₀ (below), and everything else the chain multiplies by the state, so that
    its loop holds only the products: Qs = q̂ exp(γ) scale, Kd = k̂ exp(γ_last − γ) [BT, K], QK = (q̂·k̂ᵀ ⊙ decay)
    scale [BT, BT] and exp(γ_last) (dend, at the chunk's first token). Addresses are the chunk's scalar base plus
    in-chunk offsets (int32)."""
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    t = c0 + o_t
    m = t < eos
    gam, beta = _chunk_gates(a, b, t, m, stride_at, hv, decay_rate, bias)
    in_qk = o_t[:, None] * stride_t + o_k[None, :]  # q and k rows: [T, H, K] with token stride stride_t
    in_k = o_t[:, None] * (HV * K) + o_k[None, :]  # the per-(token, value head) terms: [T, HV, K]
    at_k = (c0 * HV + hv) * K
    b_k = _l2_normalised(_load_rows(k + c0 * stride_t + hk * K + in_qk, m, MASKED).to(tl.float32))
    causal = o_t[:, None] >= o_t[None, :]
    decay = tl.where(causal, tl.exp(tl.where(causal, gam[:, None] - gam[None, :], 0.0)), 0.0)
    # q's terms first, stored before the inverse (fewer tiles live at once: no register spills on sm_90a). The
    # chain's bf16 products round q̂ and k̂ after these scalings (fp32 here), as it rounded them before. γ stays at its
    # last value past the segment's end, so γ_last is the chunk's (or the segment's) end.
    b_q = _l2_normalised(_load_rows(q + c0 * stride_t + hk * K + in_qk, m, MASKED).to(tl.float32))
    QK = tl.where(causal, tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * decay, 0.0) * scale
    in_tt = o_t[:, None] * (HV * BT) + o_t[None, :]
    _store_rows(qk + (c0 * HV + hv) * BT + in_tt, QK.to(qk.dtype.element_ty), m, MASKED)
    _store_rows(qs + at_k + in_k, (b_q * (tl.exp(gam) * scale)[:, None]).to(qs.dtype.element_ty), m, MASKED)
    last = tl.sum(tl.where(o_t == BT - 1, gam, 0.0), axis=0)
    _store_rows(kd + at_k + in_k, (b_k * tl.exp(last - gam)[:, None]).to(kd.dtype.element_ty), m, MASKED)
    tl.store(dend + c0 * HV + hv, tl.exp(last))
    strict = o_t[:, None] > o_t[None, :]
    eye = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    A = tl.where(strict, beta[:, None] * decay * tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION), 0.0)
    # (I + A)⁻¹ = (I − A)(I + A²)(I + A⁴)…, exact once A^BT = 0 (A is strictly lower-triangular).
    T = eye - A
    P = A
    for _ in tl.static_range(LOG2_BT - 1):
        P = tl.dot(P, P, input_precision=PRECISION)
        T = tl.dot(T, eye + P, input_precision=PRECISION)
    W = tl.dot(T, (beta * tl.exp(gam))[:, None] * b_k, input_precision=PRECISION)
    _store_rows(w + at_k + in_k, W.to(w.dtype.element_ty), m, MASKED)
    b_v = _load_rows(v + c0 * stride_vt + hv * V + o_t[:, None] * stride_vt + o_v[None, :], m, MASKED)
    U0 = tl.dot(T, beta[:, None] * b_v.to(tl.float32), input_precision=PRECISION)
    _store_rows(u + (c0 * HV + hv) * V + o_t[:, None] * (HV * V) + o_v[None, :], U0.to(u.dtype.element_ty), m, MASKED)


# The segment count varies per pass: one compiled variant for any (no specialisation on its value).
@triton.jit(do_not_specialize=["N", "steps"])
def _chunk_prep_kernel(
    q,
    k,
    v,
    a,
    b,
    a_log,
    dt_bias,
    cu,
    w,
    u,
    qs,
    kd,
    qk,
    dend,
    N,
    scale,
    stride_t,
    stride_vt,
    stride_at,
    steps,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    LOG2_BT: tl.constexpr,
):
    """Everything of a chunk that does not depend on the state, for all chunks in parallel: with
    T = (I + A)⁻¹, A = strictly-lower(β_t exp(γ_t − γ_s) k_t·k_s), the chunk's state-independent terms
    W = T (β exp(γ) k) [BT, K] and U₀ = T (β v) [BT, V], written per token into w [T, HV, K] and u [T, HV, V]
    (as the chain multiplies them: _bf16_chain), so that the sequential pass gets U = U₀ − W S; and the scaled q̂
    and k̂, the chunk's q̂·k̂ᵀ and its end decay (_chunk_terms). Chunks start at their segment's first token and
    every BT tokens after; a program takes the chunks that start in its BT tokens of the input (at most one per
    segment, found from the first segment reaching into them)."""
    i_t, hv = tl.program_id(0), tl.program_id(1)
    hk = hv // (HV // H)
    start = i_t.to(tl.int64) * BT
    decay_rate = tl.exp(tl.load(a_log + hv).to(tl.float32))
    bias = tl.load(dt_bias + hv).to(tl.float32)
    # A window at or past the tokens' end has nothing to do, and returns before the segment search: a captured
    # pass's padding windows, and every window of an empty group (a long5 pass's empty short group: thousands of
    # such programs).
    end = tl.load(cu + N).to(tl.int64)
    n = start * 0 + N
    if start < end:
        n = segment_of(cu, N, start, steps)
    # Segments in turn while they start in this window and before the tokens end: a captured pass's padding
    # segments all start at the end, and the window holding it would otherwise walk every one of them (a long5
    # pass's long group: 19 in series).
    while (n < N) & (tl.load(cu + n).to(tl.int64) < tl.minimum(start + BT, end)):
        bos, eos = tl.load(cu + n).to(tl.int64), tl.load(cu + n + 1).to(tl.int64)
        c0 = bos + tl.maximum(start - bos + BT - 1, 0) // BT * BT  # the segment's first chunk start >= start
        if c0 < tl.minimum(eos, start + BT):
            # Two compiled bodies, one run: masks only for a segment's last, partial chunk.
            for partial in tl.static_range(2):
                if (c0 + BT > eos) == (partial == 1):
                    _chunk_terms(
                        q,
                        k,
                        v,
                        a,
                        b,
                        w,
                        u,
                        qs,
                        kd,
                        qk,
                        dend,
                        c0,
                        eos,
                        hk,
                        hv,
                        decay_rate,
                        bias,
                        scale,
                        stride_t,
                        stride_vt,
                        stride_at,
                        HV,
                        K,
                        V,
                        BT,
                        LOG2_BT,
                        partial == 1,
                    )
        n += 1


@triton.jit
def _chain_chunk(
    S, qs, kd, w, u, qk, dend, o, c0, hv, in_k, in_qk, in_u, in_o, stride_ut, stride_ot, HV, K, V, BT, BF16, m, MASKED
):
    """One chunk of the chain from c0 (its rows m, read and written only where m holds when MASKED): its output
    stored, the next state returned."""
    at_k = (c0 * HV + hv) * K
    b_qs = _load_rows(qs + at_k + in_k, m, MASKED)
    b_kd = _load_rows(kd + at_k + in_k, m, MASKED)
    b_w = _load_rows(w + at_k + in_k, m, MASKED)
    b_u = _load_rows(u + c0 * stride_ut + hv * V + in_u, m, MASKED)
    b_qk = _load_rows(qk + (c0 * HV + hv) * BT + in_qk, m, MASKED)
    U = b_u - _dot(b_w, S, BF16)
    out = _dot(b_qs, S, BF16) + _dot(b_qk, U, BF16)
    _store_rows(o + c0 * stride_ot + hv * V + in_o, out.to(o.dtype.element_ty), m, MASKED)
    return tl.load(dend + c0 * HV + hv) * S + _dot(tl.trans(b_kd), U, BF16)


@triton.jit
def _chain_item(
    item,
    u,
    a_log,
    dt_bias,
    pool,
    slots,
    cu,
    o,
    stride_ut,
    stride_ot,
    w,
    qs,
    kd,
    qk,
    dend,
    save_at,
    save_slots,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    CONTINUE: tl.constexpr,
    STORE: tl.constexpr,
    SAVE: tl.constexpr,
    BF16: tl.constexpr,
):
    """One item of _chunked_delta_rule_kernel; returns its segment's start."""
    hk, hv, bos, eos, o_k, o_v, decay_rate, bias, state, S = _delta_rule_program(
        item, a_log, dt_bias, pool, slots, cu, H, HV, K, V, BV, CONTINUE
    )
    written = eos > bos  # empty segments (a captured pass's padding, on the scratch slot) store no end state
    # SAVE: the state after the segment's first save_at[n] tokens (a whole number of chunks; 0: none) also goes into
    # pool[save_slots[n]]: a point a longer state can continue from (gpu/pool.py).
    # Only scalars stay live across the chain: the point's address is made where it is stored.
    save_end = bos
    save_base = bos * 0
    if SAVE:
        n = item // (V // BV) // HV
        save_end = bos + tl.load(save_at + n).to(tl.int64)
        save_base = (tl.load(save_slots + n).to(tl.int64) * HV + hv) * K * V + (item % (V // BV)) * BV
    o_t = tl.arange(0, BT)
    # Offsets within a chunk (the same for every chunk) and the chunk's base: only a segment's last chunk can be
    # partial, so the others (a first pass over the whole chunks) load and store without per-element masks.
    in_k = (o_t[:, None] * HV) * K + o_k[None, :]
    in_qk = (o_t[:, None] * HV) * BT + o_t[None, :]
    in_u = o_t[:, None] * stride_ut + o_v[None, :]
    in_o = o_t[:, None] * stride_ot + o_v[None, :]
    full_end = bos + (eos - bos) // BT * BT
    for partial in tl.static_range(2):
        for c0 in range(full_end if partial == 1 else bos, eos if partial == 1 else full_end, BT):
            S = _chain_chunk(
                S,
                qs,
                kd,
                w,
                u,
                qk,
                dend,
                o,
                c0,
                hv,
                in_k,
                in_qk,
                in_u,
                in_o,
                stride_ut,
                stride_ot,
                HV,
                K,
                V,
                BT,
                BF16,
                o_t < eos - c0,
                partial == 1,
            )
            if SAVE:
                if (c0 + BT == save_end) & (save_end > bos):
                    tl.store(pool + save_base + tl.arange(0, K)[:, None] * V + tl.arange(0, BV)[None, :], S)
    if STORE:
        tl.store(state, S, mask=written)
    return bos


@triton.jit(do_not_specialize=["N"])
def _chunked_delta_rule_kernel(
    q,
    k,
    u,
    a,
    b,
    a_log,
    dt_bias,
    pool,
    slots,
    cu,
    o,
    scale,
    stride_t,
    stride_ut,
    stride_at,
    stride_ot,
    w,
    qs,
    kd,
    qk,
    dend,
    save_at,
    save_slots,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    CONTINUE: tl.constexpr,
    STORE: tl.constexpr,
    SAVE: tl.constexpr,
    BF16: tl.constexpr,
    LOOP: tl.constexpr,
    N,
):
    """The sequential part (chunked_rows' arguments, with U₀ [T, HV, V] in v's place, and the prep's other terms
    added; q, k, a and b are not read), chunk by chunk from the state S [K, BV] (fp32, in registers): U = U₀ − W S;
    o = Qs S + QK U; S ← exp(γ_last) S + Kdᵀ U. Only these products sit on the chain from one chunk to the next:
    the inverse, the norms, the gates and their decays are in _chunk_prep_kernel (in this loop they would be most of
    its instructions, few of them MMAs), and whole chunks load and store without masks."""
    if LOOP:  # items in turn until the segments' tokens end (_next_item)
        end = tl.load(cu + N).to(tl.int64)
        item = tl.program_id(0)
        while item < N * HV * (V // BV):
            bos = _chain_item(
                item,
                u,
                a_log,
                dt_bias,
                pool,
                slots,
                cu,
                o,
                stride_ut,
                stride_ot,
                w,
                qs,
                kd,
                qk,
                dend,
                save_at,
                save_slots,
                H,
                HV,
                K,
                V,
                BV,
                BT,
                CONTINUE,
                STORE,
                SAVE,
                BF16,
            )
            item = _next_item(item, bos, end, N * HV * (V // BV))
    else:  # one item, compiled without the loop (which costs registers: CHUNK_PER_SM)
        _chain_item(
            tl.program_id(0),
            u,
            a_log,
            dt_bias,
            pool,
            slots,
            cu,
            o,
            stride_ut,
            stride_ot,
            w,
            qs,
            kd,
            qk,
            dend,
            save_at,
            save_slots,
            H,
            HV,
            K,
            V,
            BV,
            BT,
            CONTINUE,
            STORE,
            SAVE,
            BF16,
        )


# A captured pass's group counts its capacity, not its work (r192's 48 row slots may hold one short6 request's 6
# rows): a program per item (segment, value head, value block) would run mostly empty programs, in waves after the
# real ones. For such `padded` groups a launch runs CHUNK_PER_SM programs an SM (what the chain fits at once: the loop
# costs registers, and at 64 value columns it spills, so padded groups run narrow), each taking items in turn
# (_next_item); outputs are identical.
CHUNK_PER_SM = 2


def _launch_chain(
    block_v: int,
    warps: int,
    per_sm: int | None,
    q,
    k,
    u,
    a,
    b,
    a_log,
    dt_bias,
    pool,
    slots,
    cu,
    new_states,
    extend,
    save_at,
    save_slots,
    out,
    **extra,
) -> torch.Tensor:
    """Checks the layouts the chain assumes and launches it: a program per item (segment, value head, value block),
    or with `per_sm` that many programs an SM taking items in turn (CHUNK_PER_SM). `extra`: the prep's terms and
    the launch options, by name (per token, never per segment); the segments' own arrays are arguments."""
    T, H, K = q.shape
    HV, V = u.shape[1], u.shape[2]
    assert k.stride() == q.stride() and q.stride(2) == 1 and u.stride(2) == 1
    assert q.stride(1) == K and u.stride(1) == V and pool.is_contiguous()
    assert a.stride() == b.stride() and a.stride(1) == 1 and a_log.is_contiguous() and dt_bias.is_contiguous()
    if out is None:
        out = torch.empty(T, HV, V, device=q.device, dtype=q.dtype)
    assert out.shape == (T, HV, V) and out.is_contiguous()
    BV = min(block_v, V)
    n = slots.shape[0]
    if n:
        assert V % BV == 0
        items = n * HV * (V // BV)
        programs = items if per_sm is None else min(items, per_sm * _sm_count(q.device))
        _chunked_delta_rule_kernel[(programs,)](
            q,
            k,
            u,
            a,
            b,
            a_log,
            dt_bias,
            pool,
            slots,
            cu,
            out,
            K**-0.5,
            q.stride(0),
            u.stride(0),
            a.stride(0),
            out.stride(0),
            save_at=slots if save_at is None else save_at,  # not read without SAVE
            save_slots=slots if save_slots is None else save_slots,
            H=H,
            HV=HV,
            K=K,
            V=V,
            BV=BV,
            CONTINUE=extend or not new_states,
            STORE=new_states,
            SAVE=save_at is not None,
            LOOP=per_sm is not None,
            N=n,
            num_warps=warps,
            **extra,
        )
    return out


def chunked_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    cu: torch.Tensor,
    new_states: bool = False,
    out: torch.Tensor | None = None,
    padded: bool = False,
    lead_apart: bool = False,
    lead: int = 0,
    extend: bool = False,
    save_at: torch.Tensor | None = None,
    save_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule for question rows, each continuing the state in `pool[slots[n]]` without copying it;
    or, with `new_states`, for new states starting from zero, each writing its end state into `pool[slots[n]]` (an
    empty segment writes nothing). With `new_states` and `extend`, each new state continues the state its slot holds
    already (the point it extends, copied there) instead of zero. `save_at` [N] (with `new_states`): the state after
    each segment's first save_at[n] tokens, a multiple of CHUNK (0: none), is also written into
    pool[save_slots[n]]. A segment continued from the state after its first m·CHUNK tokens gives the same outputs
    and end state, bit for bit, as the segment whole: chunks start every CHUNK tokens from a segment's start, and
    the chain's state is carried and saved in fp32.

    q, k: [T, H, K] and v: [T, HV, V], contiguous per token (e.g. slices of the conv output); a, b: [T, HV] raw
    gate inputs (same token stride), with A_log and dt_bias [HV]; pool: [slots, HV, K, V] fp32; slots: [N]; cu:
    [N + 1] token offsets. q and k are L2-normalised here and q scaled by K^-0.5, as `use_qk_l2norm_in_kernel`
    does. Returns o [T, HV, V] in q's dtype (written into `out` when given, a contiguous [T, HV, V]).

    In chunks of CHUNK tokens: first every chunk's state-independent terms in parallel, then one program per (value
    block, segment, value head) carries the fp32 state from chunk to chunk. No host-side chunk maps, and grids that
    depend only on the token and segment counts (kernels.segments): capturable in a CUDA graph. The sequential pass
    runs CHUNK_WIDE or CHUNK_NARROW (both give the same outputs), chosen from the segment count. `padded` (a
    captured pass's group, whose segments count its capacity, not its work): narrow, its programs taking items in
    turn (CHUNK_PER_SM). `lead_apart` (the caller's padded group of long new states): segment `lead` (its first long
    one; a captured pass's short new states come before it in the group) on a launch of its own, a program per item,
    and the group's other segments at the same time on a side stream, in turn. A lone long state in a padded group
    would otherwise chain slower: in turn, the GPU places two of its programs on some SMs. The items' arithmetic is
    the same either way, so are the outputs."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    n = slots.shape[0]
    # The chain's operands (W, Qs, Kd, QK, U₀) are stored as it multiplies them: bf16, or fp32 for TF32 products.
    bf16 = _bf16_chain(q)
    operands = torch.bfloat16 if bf16 else torch.float32
    w, qs, kd = (torch.empty(T, HV, K, device=q.device, dtype=operands) for _ in range(3))
    qk = torch.empty(T, HV, CHUNK, device=q.device, dtype=operands)
    u = torch.empty(T, HV, V, device=q.device, dtype=operands)
    dend = torch.empty(T, HV, device=q.device, dtype=torch.float32)  # at each chunk's first token
    if n:
        assert k.stride() == q.stride() and q.stride(2) == 1 and v.stride(2) == 1 and v.stride(1) == V
        assert a.stride() == b.stride() and a.stride(1) == 1
        _chunk_prep_kernel[(triton.cdiv(T, CHUNK), HV)](
            q,
            k,
            v,
            a,
            b,
            a_log,
            dt_bias,
            cu,
            w,
            u,
            qs,
            kd,
            qk,
            dend,
            n,
            K**-0.5,
            q.stride(0),
            v.stride(0),
            a.stride(0),
            search_steps(n),
            H=H,
            HV=HV,
            K=K,
            V=V,
            BT=CHUNK,
            LOG2_BT=CHUNK.bit_length() - 1,
            num_warps=PREP_WARPS,
            **({} if PREP_MAXNREG is None else {"maxnreg": PREP_MAXNREG}),
        )
    # A launch saving points runs narrow: at 64 value columns the store inside the chain spills registers.
    wide = not padded and save_at is None and n >= segments_for_wide(q.device, HV, V)
    block_v, warps, maxnreg = CHUNK_WIDE if wide else CHUNK_NARROW
    extra = dict(w=w, qs=qs, kd=kd, qk=qk, dend=dend, BT=CHUNK, BF16=bf16)
    if maxnreg is not None:
        extra["maxnreg"] = maxnreg

    def chain(first: int, last: int, per_sm: int | None, into: torch.Tensor | None) -> torch.Tensor:
        """The sequential pass over segments [first, last) (cu's offsets are the pass's, so any run of them)."""
        run_slots, run_cu = slots[first:last], cu[first : last + 1]
        saves = (None, None) if save_at is None else (save_at[first:last], save_slots[first:last])
        args = (q, k, u, a, b, a_log, dt_bias, pool, run_slots, run_cu, new_states, extend, *saves, into)
        return _launch_chain(block_v, warps, per_sm, *args, **extra)

    if not (padded and lead_apart and n > lead + 1):
        return chain(0, n, CHUNK_PER_SM if padded else None, out)
    out = torch.empty(T, HV, V, device=q.device, dtype=q.dtype) if out is None else out
    with beside(q.device) as apart:
        apart(lambda: chain(lead, lead + 1, None, out))
        for first, last in ((0, lead), (lead + 1, n)):  # the others in turn, beside it
            if last > first:
                chain(first, last, CHUNK_PER_SM, out)
    return out


def segments_for_wide(device: torch.device, value_heads: int, value_dim: int) -> int:
    """The fewest segments of one pass that run the sequential pass in its CHUNK_WIDE configuration (the engine's
    warm-up runs that many so that neither configuration compiles on a request)."""
    return WIDE_ABOVE * _sm_count(device) // (value_heads * triton.cdiv(value_dim, CHUNK_NARROW[0])) + 1


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the interpreter's CPU tensors: 1)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


# Plain torch references (tests/gpu/kernels/test_delta_rule.py, tests/gpu/fused_cpu_ops.py): the gated delta rule in
# fp32, token by token, segment by segment (model.qwen35.gated_delta_rule computes the same in chunks).


def reference_segment_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One segment's gated delta rule as the kernels compute it (q, k L2-normalised inside, q scaled by K^-0.5), one
    token at a time: S_t = e^{g_t} S_{t-1} + k_t u_tᵀ, u_t = β_t (v_t − (e^{g_t} S_{t-1})ᵀ k_t), o_t = S_tᵀ q_t.
    q, k [L, H, K]; v [L, HV, V]; g, beta [L, HV]; h0 [HV, K, V] or None (zero; never written). Returns (o [L, HV, V]
    fp32, final state [HV, K, V])."""
    rep = v.shape[1] // q.shape[1]
    qq, kk = (t.float().repeat_interleave(rep, 1) for t in (q, k))
    qq = qq * torch.rsqrt((qq * qq).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    kk = kk * torch.rsqrt((kk * kk).sum(-1, keepdim=True) + 1e-6)
    HV, K, V = v.shape[1], q.shape[-1], v.shape[-1]
    state = torch.zeros(HV, K, V, device=v.device) if h0 is None else h0.float().clone()
    o = torch.empty(v.shape[0], HV, V, device=v.device)
    for t in range(v.shape[0]):
        state = state * g[t].float().exp()[:, None, None]
        u = beta[t].float()[:, None] * (v[t].float() - torch.einsum("hk,hkv->hv", kk[t], state))
        state = state + kk[t][:, :, None] * u[:, None, :]
        o[t] = torch.einsum("hk,hkv->hv", qq[t], state)
    return o, state


def reference_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    cu: torch.Tensor,
    new_states: bool = False,
    out: torch.Tensor | None = None,
    segment_rule=reference_segment_delta_rule,
    extend: bool = False,
    save_at: torch.Tensor | None = None,
    save_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """chunked_rows' job in torch (same arguments, less its launch options): rows from
    pool[slots[n]] (read, never written), or new states from zero (`extend`: from pool[slots[n]]) writing their final
    state into it (an empty new segment writes its start state), and with `save_at` the state after a segment's
    first save_at[n] tokens into pool[save_slots[n]]. Tokens outside the segments are zeros (or `out`'s).
    `segment_rule`: one segment's rule, reference_segment_delta_rule's arguments and results
    (tests/gpu/fused_cpu_ops.py passes the engine's)."""
    T, HV, V = v.shape
    o = torch.zeros(T, HV, V, device=v.device, dtype=v.dtype) if out is None else out
    saves = [0] * len(slots) if save_at is None else save_at.tolist()
    for n, ((lo, hi), slot) in enumerate(zip(segment_bounds(cu), slots.tolist(), strict=True)):
        h0 = None if new_states and not extend else pool[slot]  # read, not changed, by the rule
        if hi == lo:
            if new_states:
                pool[slot] = 0.0 if h0 is None else h0
            continue
        # Segment by segment, the gates too: a CPU's vector math rounds a tensor's tail elements apart from the rest,
        # so a gate computed over the whole group would change with the segments beside it.
        g = -a_log.exp() * F.softplus(a[lo:hi].float() + dt_bias)
        beta = torch.sigmoid(b[lo:hi].float())
        # A saved point splits the segment there: the rule carries its state across the split as it does whole.
        for start, end in ((0, saves[n]), (saves[n], hi - lo)) if saves[n] else ((0, hi - lo),):
            span = slice(start, end)
            y, h0 = segment_rule(q[lo:hi][span], k[lo:hi][span], v[lo:hi][span], g[span], beta[span], h0)
            o[lo + start : lo + end] = y.to(o.dtype)
            if end == saves[n]:
                pool[int(save_slots[n])] = h0
        if new_states:
            pool[slot] = h0
    return o
