"""Small Triton kernels for the fused path, with fixed launch configurations.

fla's norm kernels autotune on a bucket of the row count (`NB`), so each new batch size compiles and benchmarks
them again on the request path (seen: 64-client throughput collapsing while batches grew); these take the block
size from the row width alone. Statistics in fp32, as Qwen3.5's norms compute them.
"""

from __future__ import annotations

import torch
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


@triton.jit
def _rms_norm_rope_kernel(
    x, weight, cos, sin, y, D, eps, heads, stride_x, stride_xh, stride_c, ROT: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    token = row // heads
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    src = x + token * stride_x + (row % heads) * stride_xh
    h = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
    out = h * rstd * tl.load(weight + cols, mask=mask, other=0.0)
    # NeoX RoPE on the first ROT dims: out_c = y_c cos_c - y_{c+ROT/2} sin_c (first half), y_c cos_c + y_{c-ROT/2}
    # sin_c (second half), the partner read again from the row (same statistics).
    half = ROT // 2
    rot = cols < ROT
    partner = tl.where(cols < half, cols + half, cols - half)
    y_partner = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32) * rstd
    y_partner = y_partner * tl.load(weight + partner, mask=rot, other=0.0)
    c = tl.load(cos + token * stride_c + cols, mask=rot, other=1.0)
    s = tl.load(sin + token * stride_c + cols, mask=rot, other=0.0)
    out = tl.where(rot, out * c + tl.where(cols < half, -y_partner, y_partner) * s, out)
    tl.store(y + row * D + cols, out.to(y.dtype.element_ty), mask=mask)


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
        _rms_norm_rope_kernel[(T * H,)](
            x3,
            weight,
            cos,
            sin,
            y,
            D,
            eps,
            H,
            x3.stride(0),
            x3.stride(1),
            cos.stride(0),
            ROT=rot,
            BLOCK=triton.next_power_of_2(D),
        )
    return y


@triton.jit
def _gated_rms_norm_kernel(
    x, z, weight, y, D, eps, heads, stride_x, stride_z, stride_zh, stride_y, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(z + (row // heads) * stride_z + (row % heads) * stride_zh + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(weight + cols, mask=mask, other=0.0)
    out = h * rstd * w * (g * tl.sigmoid(g))
    tl.store(y + row * stride_y + cols, out.to(y.dtype.element_ty), mask=mask)


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
        _gated_rms_norm_kernel[(rows,)](
            x2,
            z3,
            weight,
            y,
            D,
            eps,
            z3.shape[1],
            x2.stride(0),
            z3.stride(0),
            z3.stride(1),
            y.stride(0),
            BLOCK=triton.next_power_of_2(D),
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


@triton.jit
def _delta_rule_inputs(q, k, v, a, b, t, eos, stride_t, stride_vt, stride_at, hk, hv, o_k, o_v, K, V):
    """Token t's q, k [K], v [BV] and raw gate inputs a, b in fp32; zeros once t reaches eos (nothing read)."""
    m = t < eos
    b_q = tl.load(q + t * stride_t + hk * K + o_k, mask=m, other=0.0).to(tl.float32)
    b_k = tl.load(k + t * stride_t + hk * K + o_k, mask=m, other=0.0).to(tl.float32)
    b_v = tl.load(v + t * stride_vt + hv * V + o_v, mask=m, other=0.0).to(tl.float32)
    b_a = tl.load(a + t * stride_at + hv, mask=m, other=0.0).to(tl.float32)
    b_b = tl.load(b + t * stride_at + hv, mask=m, other=0.0).to(tl.float32)
    return b_q, b_k, b_v, b_a, b_b


# Value columns per program and warps per program of the delta rule: narrow blocks on one warp keep each step's two
# reductions over the key dim inside a warp (as fla's fused_recurrent does). bench/diag.py recurrent on the H200,
# 192 rows of 39 tokens: 16/1 1.65 ms, 8/1 2.05, 32/2 2.08, 32/4 3.16.
RECURRENT_BV = 16
RECURRENT_WARPS = 1


@triton.jit
def _delta_rule_program(
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
    """What a delta-rule program works on: its key and value heads, its segment [bos, eos), its key and value
    offsets, the head's gate constants, where its state block lives in the pool and that block's start value."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
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
    if CONTINUE:  # a row: the state it continues, read in place from its bank slot ([K, BV] of [Hv, K, V], fp32)
        h = tl.load(state)
    else:  # a new state: from zero
        h = tl.zeros([K, BV], dtype=tl.float32)
    return hk, hv, bos, eos, o_k, o_v, decay_rate, bias, state, h


@triton.jit
def _recurrent_rows_kernel(
    q,
    k,
    v,
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
    stride_vt,
    stride_at,
    stride_ot,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    CONTINUE: tl.constexpr,
):
    hk, hv, bos, eos, o_k, o_v, decay_rate, bias, state, h = _delta_rule_program(
        a_log, dt_bias, pool, slots, cu, H, HV, K, V, BV, CONTINUE
    )
    # Token t+1's inputs are loaded while token t is computed (they do not depend on the state), so the loop's
    # critical path is the state update alone. o_t = (decayed h)·q + (k·q)·u, so both reductions over the key dim
    # read the decayed state at once instead of one after the other.
    n_q, n_k, n_v, n_a, n_b = _delta_rule_inputs(
        q, k, v, a, b, bos, eos, stride_t, stride_vt, stride_at, hk, hv, o_k, o_v, K, V
    )
    for t in range(bos, eos):
        b_q, b_k, b_v, b_a, b_b = n_q, n_k, n_v, n_a, n_b
        n_q, n_k, n_v, n_a, n_b = _delta_rule_inputs(
            q, k, v, a, b, t + 1, eos, stride_t, stride_vt, stride_at, hk, hv, o_k, o_v, K, V
        )
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_a = b_a + bias
        b_g = -decay_rate * tl.where(b_a > 20.0, b_a, tl.log(1.0 + tl.exp(b_a)))
        b_beta = tl.sigmoid(b_b)
        h = h * tl.exp(b_g)
        b_u = (b_v - tl.sum(h * b_k[:, None], axis=0)) * b_beta
        b_o = tl.sum(h * b_q[:, None], axis=0) + tl.sum(b_k * b_q) * b_u
        h = h + b_k[:, None] * b_u[None, :]
        tl.store(o + t * stride_ot + hv * V + o_v, b_o.to(o.dtype.element_ty))
    if not CONTINUE:  # a new state's end state goes into its (fresh) bank slot; a row writes nothing back
        tl.store(state, h)


def recurrent_rows(
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
) -> torch.Tensor:
    """Gated delta rule for question rows, each continuing the state in `pool[slots[n]]` without copying it; or,
    with `new_states`, for new states starting from zero, each writing its end state into `pool[slots[n]]`.

    q, k: [T, H, K] and v: [T, HV, V], contiguous per token (e.g. slices of the conv output); a, b: [T, HV] raw
    gate inputs (same token stride), with A_log and dt_bias [HV]; pool: [slots, HV, K, V] fp32; slots: [N]; cu:
    [N + 1] token offsets. q and k are L2-normalised here and q scaled by K^-0.5, as `use_qk_l2norm_in_kernel`
    does. Returns o [T, HV, V] in q's dtype (written into `out` when given, a contiguous [T, HV, V]).
    """
    return _launch_delta_rule(
        _recurrent_rows_kernel,
        RECURRENT_BV,
        RECURRENT_WARPS,
        q,
        k,
        v,
        a,
        b,
        a_log,
        dt_bias,
        pool,
        slots,
        cu,
        new_states,
        out,
    )


def _launch_delta_rule(
    kernel, block_v: int, warps: int, q, k, v, a, b, a_log, dt_bias, pool, slots, cu, new_states, out, **constants
) -> torch.Tensor:
    """Checks the layouts both delta-rule kernels assume and launches one: a program per (value block, segment,
    value head)."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    assert k.stride() == q.stride() and q.stride(2) == 1 and v.stride(2) == 1
    assert q.stride(1) == K and v.stride(1) == V and pool.is_contiguous()
    assert a.stride() == b.stride() and a.stride(1) == 1 and a_log.is_contiguous() and dt_bias.is_contiguous()
    if out is None:
        out = torch.empty(T, HV, V, device=q.device, dtype=q.dtype)
    assert out.shape == (T, HV, V) and out.is_contiguous()
    BV = min(block_v, V)
    n = slots.shape[0]
    if n:
        kernel[(triton.cdiv(V, BV), n * HV)](
            q,
            k,
            v,
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
            v.stride(0),
            a.stride(0),
            out.stride(0),
            H=H,
            HV=HV,
            K=K,
            V=V,
            BV=BV,
            CONTINUE=not new_states,
            num_warps=warps,
            **constants,
        )
    return out


# The chunked delta rule's products take fp32 operands rounded to TF32 on tensor cores (10-bit mantissa; fla's
# chunked kernels round to bf16, 7 bits) and accumulate in fp32; the state stays fp32. At K = 128 and 32 value
# columns on 4 warps "ieee" (FMA loops) and "tf32x3" spill registers on sm_90a (ptxas -v); "tf32" does not.
PRECISION: tl.constexpr = tl.constexpr("tf32")

# Tokens per chunk of the chunked delta rule: (I + A)⁻¹ of a strictly lower-triangular A is then a product of
# log2(CHUNK) factors (I + A^(2^j)), all 16×16 products; one program walks its segment chunk by chunk.
CHUNK = 16
CHUNK_BV = 32  # value columns per program, on CHUNK_WARPS warps: no register spills (4 warps spill a little)
CHUNK_WARPS = 8


@triton.jit
def _chunked_delta_rule_kernel(
    q,
    k,
    v,
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
    stride_vt,
    stride_at,
    stride_ot,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    LOG2_BT: tl.constexpr,
    CONTINUE: tl.constexpr,
):
    hk, hv, bos, eos, o_k, o_v, decay_rate, bias, state, S = _delta_rule_program(
        a_log, dt_bias, pool, slots, cu, H, HV, K, V, BV, CONTINUE
    )
    o_t = tl.arange(0, BT)
    causal = o_t[:, None] >= o_t[None, :]  # [t, s]: s <= t
    strict = o_t[:, None] > o_t[None, :]
    eye = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    for c0 in range(bos, eos, BT):
        t = c0 + o_t
        m = t < eos
        b_q = tl.load(q + t[:, None] * stride_t + hk * K + o_k[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        b_k = tl.load(k + t[:, None] * stride_t + hk * K + o_k[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        b_v = tl.load(v + t[:, None] * stride_vt + hv * V + o_v[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)[:, None] * scale
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
        b_a = tl.load(a + t * stride_at + hv, mask=m, other=0.0).to(tl.float32) + bias
        g = tl.where(m, -decay_rate * tl.where(b_a > 20.0, b_a, tl.log(1.0 + tl.exp(b_a))), 0.0)
        beta = tl.where(m, tl.sigmoid(tl.load(b + t * stride_at + hv, mask=m, other=0.0).to(tl.float32)), 0.0)
        gam = tl.cumsum(g, axis=0)  # past the segment's end g = 0: gam stays at its last value
        # exp(γ_t − γ_s) where s <= t (there it is <= 1); 0 elsewhere.
        decay = tl.where(causal, tl.exp(tl.where(causal, gam[:, None] - gam[None, :], 0.0)), 0.0)
        A = tl.where(strict, beta[:, None] * decay * tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION), 0.0)
        # (I + A)⁻¹ = (I − A)(I + A²)(I + A⁴)…, exact once A^BT = 0 (A is strictly lower-triangular).
        T = eye - A
        P = A
        for _ in tl.static_range(LOG2_BT - 1):
            P = tl.dot(P, P, input_precision=PRECISION)
            T = tl.dot(T, eye + P, input_precision=PRECISION)
        R = beta[:, None] * (b_v - tl.exp(gam)[:, None] * tl.dot(b_k, S, input_precision=PRECISION))
        U = tl.dot(T, R, input_precision=PRECISION)
        qk = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * decay
        out = tl.exp(gam)[:, None] * tl.dot(b_q, S, input_precision=PRECISION) + tl.dot(
            qk, U, input_precision=PRECISION
        )
        tl.store(o + t[:, None] * stride_ot + hv * V + o_v[None, :], out.to(o.dtype.element_ty), mask=m[:, None])
        last = tl.sum(tl.where(o_t == BT - 1, gam, 0.0), axis=0)
        w = tl.exp(last - gam)
        S = tl.exp(last) * S + tl.dot(tl.trans(b_k * w[:, None]), U, input_precision=PRECISION)
    if not CONTINUE:
        tl.store(state, S)


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
) -> torch.Tensor:
    """recurrent_rows' job (same arguments) for segments of any length: chunks of CHUNK tokens, each a few small
    matrix products, the fp32 state carried from chunk to chunk in registers. No host-side chunk maps and a grid
    that depends only on the segment count, so it can be captured in a CUDA graph."""
    return _launch_delta_rule(
        _chunked_delta_rule_kernel,
        CHUNK_BV,
        CHUNK_WARPS,
        q,
        k,
        v,
        a,
        b,
        a_log,
        dt_bias,
        pool,
        slots,
        cu,
        new_states,
        out,
        BT=CHUNK,
        LOG2_BT=CHUNK.bit_length() - 1,
    )


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
    if slots.shape[0]:
        _conv_rows_kernel[(triton.cdiv(C, BC), slots.shape[0])](
            x, weight, pool, slots, cu, y, C, x.stride(0), y.stride(0), W=W, BC=BC, CONTINUE=not new_states
        )
    return y


# Tokens × channels per program of the token-parallel conv: no register spills on sm_90a with 4 warps (32 × 128
# spills in the variant that reads windows).
CONV_TILE = (16, 128)


@triton.jit
def _conv_tiles_kernel(
    x,
    weight,
    pool,
    slots,
    cu,
    y,
    C,
    stride_xt,
    stride_yt,
    W: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    CONTINUE: tl.constexpr,
):
    i_c, i_t, n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = tl.load(cu + n).to(tl.int64), tl.load(cu + n + 1).to(tl.int64)
    slot = tl.load(slots + n).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    t = bos + i_t * BT + tl.arange(0, BT)
    m_t = t < eos
    base = pool + (slot * C + o_c) * W  # the window [C, W]: slot W + d holds x_{bos + d}, d = -W..-1
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):  # tap j multiplies x_{t - (W - 1) + j}
        src = t - (W - 1) + j
        inside = src >= bos
        value = tl.load(
            x + src[:, None] * stride_xt + o_c[None, :], mask=(m_t & inside)[:, None] & m_c[None, :], other=0.0
        ).to(tl.float32)
        if CONTINUE:  # before the segment: its state's window (new states: zeros)
            held = W + (src - bos)
            before = m_t & (~inside) & (held >= 0)
            value += tl.load(base[None, :] + held[:, None], mask=before[:, None] & m_c[None, :], other=0.0).to(
                tl.float32
            )
        acc += tl.load(weight + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)[None, :] * value
    out = acc * tl.sigmoid(acc)
    tl.store(y + t[:, None] * stride_yt + o_c[None, :], out.to(y.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])
    if not CONTINUE:
        if i_t == 0:  # a new state's window: its last W inputs (zeros before its start) into its (fresh) slot
            for j in tl.static_range(W):
                token = eos - W + j
                last = tl.load(x + token * stride_xt + o_c, mask=m_c & (token >= bos), other=0.0)
                tl.store(base + j, last.to(pool.dtype.element_ty), mask=m_c)


def conv_tiles(
    x: torch.Tensor,
    weight: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    new_states: bool = False,
) -> torch.Tensor:
    """conv_rows' job (same arguments, plus `max_len`, the longest segment, which sizes the grid) with the tokens
    in parallel: tiles of tokens × channels, each tap read from the input or, before a row's start, from its
    state's window. For long segments, where conv_rows walks token by token."""
    T, C = x.shape
    W = weight.shape[1]
    assert x.stride(1) == 1 and weight.is_contiguous() and pool.is_contiguous()
    y = torch.empty(T, C, device=x.device, dtype=x.dtype)
    BT, BC = CONV_TILE
    if slots.shape[0]:
        _conv_tiles_kernel[(triton.cdiv(C, BC), max(1, triton.cdiv(max_len, BT)), slots.shape[0])](
            x, weight, pool, slots, cu, y, C, x.stride(0), y.stride(0), W=W, BT=BT, BC=BC, CONTINUE=not new_states
        )
    return y


@triton.jit
def _rows_attention_kernel(
    q,
    k,
    v,
    k_pool,
    v_pool,
    o,
    prefix,
    prefix_start,
    prefix_len,
    cu,
    scale,
    stride_qt,
    stride_kt,
    stride_vt,
    stride_pt,
    stride_ot,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
):
    i_m, i_nh = tl.program_id(0), tl.program_id(1)
    n, h = i_nh // HQ, i_nh % HQ
    hk = h // (HQ // HKV)
    bos, eos = tl.load(cu + n).to(tl.int64), tl.load(cu + n + 1).to(tl.int64)
    L = eos - bos
    if i_m * BM < L:
        if HAS_PREFIX:
            p_bos, P = tl.load(prefix_start + n).to(tl.int64), tl.load(prefix_len + n).to(tl.int64)
        else:  # new states: their own tokens only
            p_bos, P = 0, 0
        o_m = i_m * BM + tl.arange(0, BM)
        m_m = o_m < L
        o_d = tl.arange(0, D)
        b_q = tl.load(q + (bos + o_m)[:, None] * stride_qt + h * D + o_d[None, :], mask=m_m[:, None], other=0.0)
        m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, D], dtype=tl.float32)
        # The state's K/V, read in place from the bank pool through its token index.
        for start in range(0, P, BN):
            o_n = start + tl.arange(0, BN)
            m_n = o_n < P
            idx = tl.load(prefix + p_bos + o_n, mask=m_n, other=0).to(tl.int64)
            b_k = tl.load(k_pool + idx[:, None] * stride_pt + hk * D + o_d[None, :], mask=m_n[:, None], other=0.0)
            b_v = tl.load(v_pool + idx[:, None] * stride_pt + hk * D + o_d[None, :], mask=m_n[:, None], other=0.0)
            s = tl.dot(b_q, tl.trans(b_k)) * scale
            s = tl.where(m_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v)
            m_i = m_new
        # The row's own K/V, causal.
        for start in range(0, (i_m + 1) * BM, BN):
            o_n = start + tl.arange(0, BN)
            m_n = o_n < L
            b_k = tl.load(k + (bos + o_n)[:, None] * stride_kt + hk * D + o_d[None, :], mask=m_n[:, None], other=0.0)
            b_v = tl.load(v + (bos + o_n)[:, None] * stride_vt + hk * D + o_d[None, :], mask=m_n[:, None], other=0.0)
            s = tl.dot(b_q, tl.trans(b_k)) * scale
            s = tl.where(m_n[None, :] & (o_n[None, :] <= o_m[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            o + (bos + o_m)[:, None] * stride_ot + h * D + o_d[None, :], out.to(o.dtype.element_ty), mask=m_m[:, None]
        )


def rows_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    prefix: torch.Tensor | None,
    prefix_start: torch.Tensor | None,
    prefix_len: torch.Tensor | None,
    cu: torch.Tensor,
    max_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of question rows over [their state's K/V | their own K/V], bottom-right causal, GQA.

    q: [T, Hq, D] and k: [T, Hkv, D] contiguous; v: [T, Hkv, D] with any token stride (e.g. a slice of the
    projection, read in place); k_pool, v_pool: [tokens, Hkv, D] bank pool;
    prefix: pool token indices of the states' tokens, one run per state; row n's state is the run of
    prefix_len[n] entries at prefix_start[n]; cu [N + 1] the rows' token offsets; max_len bounds a row's length
    (it sizes the grid). The state's K/V are read where the bank keeps them, never copied per row. Without a
    prefix (None), plain causal attention over each segment's own tokens (new states). Writes `out` when given.
    """
    T, HQ, D = q.shape
    HKV = k.shape[1]
    assert q.is_contiguous() and k.is_contiguous() and k_pool.is_contiguous()
    assert v.stride(1) == D and v.stride(2) == 1 and v_pool.stride() == k_pool.stride()
    o = torch.empty_like(q) if out is None else out
    assert o.shape == q.shape and o.is_contiguous()
    n = cu.shape[0] - 1
    # D = 256 (Qwen3.5's heads): 32 keys a step on 8 warps fits the registers (sm_90a, ptxas -v); 4 warps spill.
    BM, BN = 16, 64 if D <= 128 else 32
    warps = 4 if D <= 128 else 8
    has_prefix = prefix is not None
    if not has_prefix:
        prefix = prefix_start = prefix_len = cu  # not read
    if n:
        _rows_attention_kernel[(triton.cdiv(max_len, BM), n * HQ)](
            q,
            k,
            v,
            k_pool,
            v_pool,
            o,
            prefix,
            prefix_start,
            prefix_len,
            cu,
            D**-0.5,
            q.stride(0),
            k.stride(0),
            v.stride(0),
            k_pool.stride(0),
            o.stride(0),
            HQ=HQ,
            HKV=HKV,
            D=D,
            BM=BM,
            BN=BN,
            HAS_PREFIX=has_prefix,
            num_warps=warps,
        )
    return o
