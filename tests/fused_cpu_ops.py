"""Torch stand-ins, with the same signatures, for every kernel of a fused pass (fla's, varlen_attn, ours).

They let the fused pass (pool writes, rows reading the bank by slot, picks, norms) run on a CPU against the
reference engine. Our Triton kernels are checked against torch in Triton's interpreter (test_kernels.py), fla's
and varlen_attn on the GPU.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

from kev_backend.gpu.fused import PassKernels
from kev_backend.model.qwen35 import apply_rope, causal_attention, gated_delta_rule, l2_normalize


def bounds(cu: torch.Tensor) -> list[tuple[int, int]]:
    offsets = cu.tolist()
    return list(zip(offsets[:-1], offsets[1:]))


def segment_delta_rule(q, k, v, g, beta, h0):
    """One segment's gated delta rule as the kernels compute it (q, k L2-normalised inside, q scaled): q, k [L, H, K];
    v [L, HV, V]; g, beta [L, HV]; h0 [HV, K, V] or None. Returns (o [L, HV, V] fp32, final state [HV, K, V])."""
    rep = v.shape[1] // q.shape[1]
    qq = l2_normalize(q.float().repeat_interleave(rep, 1).transpose(0, 1)[None]) * q.shape[-1] ** -0.5
    kk = l2_normalize(k.float().repeat_interleave(rep, 1).transpose(0, 1)[None])
    vv = v.float().transpose(0, 1)[None]
    o, state = gated_delta_rule(qq, kk, vv, g.T[None], beta.float().T[None], None if h0 is None else h0[None])
    return o[0].transpose(0, 1), state[0]


def segment_attention(q, keys, values):
    """Causal attention of one segment's queries [L, Hq, D] over keys and values [S, Hkv, D], bottom-right aligned."""
    qq, kk, vv = (t.transpose(0, 1)[None] for t in (q, keys, values))
    return causal_attention(qq, kk, vv, q.shape[-1] ** -0.5)[0].transpose(0, 1)


def delta_rule(
    q,
    k,
    v,
    g=None,
    beta=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=True,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
):
    assert cu_seqlens_cpu is None or torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
    outputs, finals = [], []
    for n, (a, b) in enumerate(bounds(cu_seqlens)):
        h0 = None if initial_state is None else initial_state[n]
        o, state = segment_delta_rule(q[0, a:b], k[0, a:b], v[0, a:b], g[0, a:b], beta[0, a:b], h0)
        outputs.append(o.to(v.dtype))
        finals.append(state)
    return torch.cat(outputs)[None], (torch.stack(finals) if output_final_state else None)


def attention(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, -1)):
    """varlen attention's contract: an output for every token of q; tokens outside the segments (before cu[0] or
    after cu[-1], as in a captured pass) are left unset (zeros here)."""
    assert window_size == (-1, 0) and cu_q.dtype == torch.int32
    o = torch.zeros_like(q)
    for (a, b), (c, d) in zip(bounds(cu_q), bounds(cu_k)):
        assert b - a <= max_q and d - c <= max_k
        o[a:b] = segment_attention(q[a:b], k[c:d], v[c:d])
    return o


def rms_norm(x, weight, eps, residual=None, store_residual=False):
    h = x.float() + (residual if residual is not None else 0.0)
    y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)
    return y, (h if store_residual else None)


def rms_norm_rope(x, weight, eps, cos, sin):
    h = x.float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight
    return apply_rope(y.transpose(0, 1), cos, sin).transpose(0, 1).contiguous().to(x.dtype)


def gated_rms_norm(x, z, weight, eps):
    h = x.float()
    gate = F.silu(z.float().reshape(h.shape))
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight * gate).to(x.dtype)


def sigmoid_gate(x, gate):
    return (x.float() * torch.sigmoid(gate.float())).to(x.dtype).reshape(x.shape[0], -1)


def silu_mul(gate_up):
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


# Our kernels' stand-ins take padded passes too (a captured pass's layout): the region may hold tokens after the last
# segment (outputs left as zeros here) and empty segments (a new one writes an empty state into its slot).


CALLS: Counter[str] = Counter()  # delta-rule launches by kernel, for routing checks


def chunked_rows(
    q, k, v, a, b, a_log, dt_bias, pool, slots, cu, new_states=False, out=None, padded=False, lead_apart=False, lead=0
):
    """The same recurrence as recurrent_rows; the kernels differ only in how they walk it (`padded`, `lead_apart`
    and `lead`, how the GPU kernel launches, change nothing here)."""
    CALLS["chunked_rows"] += 1
    CALLS[f"chunked_rows padded={padded}"] += 1  # True: a captured pass's group
    CALLS[f"chunked_rows lead_apart={lead_apart}"] += 1  # True: a captured pass's long new states
    CALLS[f"chunked_rows lead={lead > 0}"] += 1  # True: a captured pass's short and long new states in one group
    return _delta_rule_rows(q, k, v, a, b, a_log, dt_bias, pool, slots, cu, new_states, out)


def recurrent_rows(q, k, v, a, b, a_log, dt_bias, pool, slots, cu, new_states=False, out=None, padded=False):
    CALLS["recurrent_rows"] += 1
    CALLS[f"recurrent_rows new_states={new_states}"] += 1
    return _delta_rule_rows(q, k, v, a, b, a_log, dt_bias, pool, slots, cu, new_states, out)


def _delta_rule_rows(q, k, v, a, b, a_log, dt_bias, pool, slots, cu, new_states=False, out=None):
    T, HV, V = v.shape
    o = torch.zeros(T, HV, V, dtype=v.dtype) if out is None else out
    g = -a_log.exp() * F.softplus(a.float() + dt_bias)
    for (lo, hi), slot in zip(bounds(cu), slots.tolist()):
        if hi == lo:
            if new_states:
                pool[slot] = 0.0
            continue
        h0 = None if new_states else pool[slot]
        y, final = segment_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], torch.sigmoid(b[lo:hi].float()), h0)
        o[lo:hi] = y.to(o.dtype)
        if new_states:
            pool[slot] = final
    return o


def conv_rows(x, weight, pool, slots, cu, new_states=False):
    y = torch.zeros_like(x)
    for (lo, hi), slot in zip(bounds(cu), slots.tolist()):
        window = torch.zeros_like(pool[slot]) if new_states else pool[slot]
        seq = torch.cat([window, x[lo:hi].T], dim=1)
        if hi > lo:
            y[lo:hi] = F.silu(F.conv1d(seq[None, :, 1:], weight[:, None, :], groups=weight.shape[0]))[0].T
        if new_states:
            pool[slot] = seq[:, -weight.shape[1] :]
    return y


def rows_attention(q, k, v, k_pool, v_pool, prefix, prefix_start, prefix_len, cu, max_len, out=None):
    o = torch.zeros_like(q) if out is None else out
    for n, (lo, hi) in enumerate(bounds(cu)):
        assert hi - lo <= max_len
        if hi == lo:
            continue
        idx = prefix[prefix_start[n] : prefix_start[n] + prefix_len[n]] if prefix is not None else []
        keys, values = torch.cat([k_pool[idx], k[lo:hi]]), torch.cat([v_pool[idx], v[lo:hi]])
        o[lo:hi] = segment_attention(q[lo:hi], keys, values)
    return o


def bank_kv(keys, values, dst, k, v):
    keys.index_copy_(0, dst, k)
    values.index_copy_(0, dst, v)


TORCH_KERNELS = PassKernels(
    chunk=delta_rule,
    attention=attention,
    rms_norm=rms_norm,
    rms_norm_rope=rms_norm_rope,
    gated_rms_norm=gated_rms_norm,
    silu_mul=silu_mul,
    sigmoid_gate=sigmoid_gate,
    recurrent_rows=recurrent_rows,
    chunked_rows=chunked_rows,
    conv=conv_rows,  # conv_tokens' job, segment by segment
    rows_attention=rows_attention,
    bank_kv=bank_kv,
)
