"""The fused path's own Triton kernels against torch references, in Triton's interpreter (on CPU, in a subprocess so
the interpreter setting never reaches GPU tests in the same run). On the GPU the parity tests cover them again."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHECK = r"""
import os
import torch
# In the interpreter everything is exact fp32; compiled on a GPU, tl.dot on fp32 runs in TF32 and norms use fast
# reciprocal square roots.
if os.environ.get("KEV_KERNEL_DEVICE") == "cuda":
    torch.set_default_device("cuda")
    TOL, REL = 3e-3, 1e-5
else:
    TOL, REL = 1e-5, 1e-6
from kev_backend.gpu.kernels import (
    chunked_rows, conv_rows, conv_tokens, gated_rms_norm, recurrent_rows, rms_norm, rms_norm_rope, rows_attention,
    sigmoid_gate, silu_mul,
)
from kev_backend.gpu.kernels import delta_rule as R, grid
from kev_backend.model.qwen35 import gated_delta_rule, l2_normalize


# fn() equals itself with every launch that puts segments on the grid's second dimension split into one launch per
# segment (kernels.grid: CUDA caps that dimension at 65,535).
def same_in_one_segment_launches(fn):
    whole = fn()
    limit, grid.MAX_GRID_Y = grid.MAX_GRID_Y, 1
    try:
        return torch.equal(whole, fn())
    finally:
        grid.MAX_GRID_Y = limit


torch.manual_seed(0)
# RMSNorm with the fp32 residual stream, on a strided input (a slice of a wider projection), and gated RMSNorm.
for D, N in [(64, 3), (256, 37)]:
    wide = torch.randn(N, D + 7)
    x, residual, w, z = wide[:, 3 : 3 + D], torch.randn(N, D), 1 + 0.1 * torch.randn(D), torch.randn(N, D)
    y, out = rms_norm(x, w, 1e-6, residual, store_residual=True)
    h = x + residual
    assert torch.equal(out, h)
    ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert ((y - ref).abs().max() / ref.abs().max()) < REL
    y, none = rms_norm(x, w, 1e-6)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert none is None and ((y - ref).abs().max() / ref.abs().max()) < REL
    y = gated_rms_norm(x, z, w, 1e-6)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w * torch.nn.functional.silu(z)
    assert ((y - ref).abs().max() / ref.abs().max()) < REL

# Per-head norms read in place from a projection: [tokens, heads, D] views with token and head strides.
proj = torch.randn(9, 3 * 2 * 32 + 5)
heads = proj[:, : 3 * 2 * 32].view(9, 3, 2 * 32)[..., :32]  # q of a [q | gate] per-head layout
w = 1 + 0.1 * torch.randn(32)
y, _ = rms_norm(heads, w, 1e-6)
ref = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6) * w
assert y.is_contiguous() and ((y - ref).abs().max() / ref.abs().max()) < REL
x, z = torch.randn(9 * 3, 32), proj[:, 5 : 5 + 96].view(9, 3, 32)
y = gated_rms_norm(x, z, w, 1e-6)
ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w * torch.nn.functional.silu(z.reshape(-1, 32))
assert ((y - ref).abs().max() / ref.abs().max()) < REL
# q's norm and partial RoPE in one kernel, read in place from the [q | gate] per-head layout.
from kev_backend.model.qwen35 import apply_rope

angles = torch.rand(9, 4) * 6
cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
y = rms_norm_rope(heads, w, 1e-6, cos, sin)
normed = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6) * w
ref = apply_rope(normed.transpose(0, 1), cos, sin).transpose(0, 1)
assert y.is_contiguous() and ((y - ref).abs().max() / ref.abs().max()) < REL * 4
gate_up = torch.randn(5, 2 * 1500 + 3)[:, : 2 * 1500]
ref = torch.nn.functional.silu(gate_up[:, :1500]) * gate_up[:, 1500:]
assert ((silu_mul(gate_up) - ref).abs().max() / ref.abs().max()) < REL
# The attention output gate, the gate read in place from the [q | gate] per-head layout.
gate = proj[:, : 3 * 2 * 32].view(9, 3, 2 * 32)[..., 32:]
out = torch.randn(9, 3, 32)
y = sigmoid_gate(out, gate)
ref = (out * torch.sigmoid(gate)).reshape(9, 96)
assert y.shape == (9, 96) and ((y - ref).abs().max() / ref.abs().max()) < REL
# New states' K and V into the bank's rows, V read in place from a wider projection: index_copy_ into each, exactly;
# the other rows untouched.
from kev_backend.gpu.kernels import bank_kv

kv_proj = torch.randn(9, 4 * 2 * 32 + 3)
k_new, v_new = kv_proj[:, : 4 * 32].reshape(9, 4, 32).contiguous(), kv_proj[:, 4 * 32 : 8 * 32].view(9, 4, 32)
keys, values = torch.randn(20, 4, 32), torch.randn(20, 4, 32)
ref_keys, ref_values = keys.clone(), values.clone()
kv_dst = torch.tensor([19, 3, 4, 5, 11, 0, 7, 8, 2])
bank_kv(keys, values, kv_dst, k_new, v_new)
ref_keys.index_copy_(0, kv_dst, k_new)
ref_values.index_copy_(0, kv_dst, v_new)
assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)

# Rows' conv continuing the window held in a pool, and rows' attention over pool K/V by index.
from kev_backend.model.qwen35 import causal_attention

cu = torch.tensor([0, 7, 27, 28])
T = 28
C = 300
wide = torch.randn(T, C + 5)
x, w, pool, slots = wide[:, 2 : 2 + C], torch.randn(C, 4), torch.randn(5, C, 4), torch.tensor([3, 0, 3])
y = conv_rows(x, w, pool, slots, cu)
for n in range(3):
    a, b = cu[n].item(), cu[n + 1].item()
    seq = torch.cat([pool[slots[n]][:, 1:], x[a:b].T], dim=1)
    ref = torch.nn.functional.silu(torch.nn.functional.conv1d(seq[None], w[:, None, :], groups=C))[0].T
    assert (y[a:b] - ref).abs().max() < TOL, n
assert same_in_one_segment_launches(lambda: conv_rows(x, w, pool, slots, cu))
# Query heads per key/value head: 2, and 3 (Qwen3.5-27B has 6: a program's tile pads the group to a power of two).
for HQ, HKV in ((4, 2), (6, 2)):
    D = 32
    kp, vp = torch.randn(200, HKV, D), torch.randn(200, HKV, D)
    runs = [[3, 4, 5, 6, 100, 101], list(range(40, 77))]
    prefix = torch.tensor(runs[0] + runs[1])
    row_runs = [0, 1, 0]  # rows 0 and 2 continue the same state
    start, length = torch.tensor([0, 6, 0]), torch.tensor([6, 37, 6])
    q, k = torch.randn(T, HQ, D), torch.randn(T, HKV, D)
    v = torch.randn(T, HKV * D + 5)[:, : HKV * D].view(T, HKV, D)  # a slice of a wider projection, read in place
    o = rows_attention(q, k, v, kp, vp, prefix, start, length, cu, max_len=20)
    for n in range(3):
        a, b = cu[n].item(), cu[n + 1].item()
        idx = runs[row_runs[n]]
        K = torch.cat([kp[idx], k[a:b]]).transpose(0, 1)[None]
        V = torch.cat([vp[idx], v[a:b]]).transpose(0, 1)[None]
        ref = causal_attention(q[a:b].transpose(0, 1)[None], K, V, D**-0.5)[0].transpose(0, 1)
        assert (o[a:b] - ref).abs().max() < TOL, n
    # New states: causal attention over their own tokens only, into a given output.
    dst = torch.empty_like(q)
    o = rows_attention(q, k, v, kp, vp, None, None, None, cu, max_len=20, out=dst)
    assert o is dst
    for n in range(3):
        a, b = cu[n].item(), cu[n + 1].item()
        qq, kk, vv = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
        ref = causal_attention(qq, kk, vv, D**-0.5)[0].transpose(0, 1)
        assert (o[a:b] - ref).abs().max() < TOL, n
    assert same_in_one_segment_launches(lambda: rows_attention(q, k, v, kp, vp, prefix, start, length, cu, max_len=20))
    assert same_in_one_segment_launches(lambda: rows_attention(q, k, v, kp, vp, None, None, None, cu, max_len=20))
# A new state long enough for query blocks past the first, with and without the keys before a block's first token
# unmasked (SPLIT_DIAGONAL) and base-2 exponentials (EXP2).
from kev_backend.gpu.kernels import attention as A

HQ, HKV, D, L = 4, 2, 32, 150
q, k, v = torch.randn(L, HQ, D), torch.randn(L, HKV, D), torch.randn(L, HKV, D)
ref = causal_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], D**-0.5)
chosen = A.SPLIT_DIAGONAL, A.EXP2
for A.SPLIT_DIAGONAL, A.EXP2 in ((False, False), (True, False), (True, True)):
    o = rows_attention(q, k, v, k, v, None, None, None, torch.tensor([0, L]), max_len=L)
    assert (o - ref[0].transpose(0, 1)).abs().max() < TOL, (A.SPLIT_DIAGONAL, A.EXP2)
A.SPLIT_DIAGONAL, A.EXP2 = chosen

# Rows continuing states read in place from a pool, against the fp32 chunked reference from a copied state.
H, HV, K, V = 2, 4, 16, 32
lens = [5, 1, 9]
T = sum(lens)
cu = torch.tensor([0, 5, 6, 15])
mixed = torch.randn(T, 2 * H * K + HV * V + 3)
q = mixed[:, : H * K].view(T, H, K)
k = mixed[:, H * K : 2 * H * K].view(T, H, K)
v = mixed[:, 2 * H * K : 2 * H * K + HV * V].view(T, HV, V)
gates = torch.randn(T, 2 * HV + 1)  # a and b: strided views, as slices of the projection
gate_a, gate_b = gates[:, :HV], gates[:, HV : 2 * HV]
a_log, dt_bias = torch.randn(HV), torch.randn(HV)
# The token-by-token kernel keeps the decay in a scalar scale and folds it into the state once the scale falls under
# RESCALE_BELOW (kernels.delta_rule): head 1 decays by g ≈ -14 a token (a fold every few tokens), head 2 by g ≈ -100
# (each token's decay alone is under it: folded token by token), the others mildly.
a_log[1], a_log[2] = 3.0, 4.6
gate_a[0, 0] = 30.0  # softplus's linear branch
g = -a_log.exp() * torch.nn.functional.softplus(gate_a + dt_bias)
beta = torch.sigmoid(gate_b)
pool = torch.randn(6, HV, K, V)
before = pool.clone()
slots = torch.tensor([4, 1, 4])
dst = torch.empty(T, HV, V)
o = recurrent_rows(q, k, v, gate_a, gate_b, a_log, dt_bias, pool, slots, cu, out=dst)
assert o is dst and torch.equal(pool, before)  # into the given output; nothing written back
rep = HV // H
for n in range(3):
    a, b = cu[n].item(), cu[n + 1].item()
    qq = l2_normalize(q[a:b].repeat_interleave(rep, 1).transpose(0, 1)[None]) * K**-0.5
    kk = l2_normalize(k[a:b].repeat_interleave(rep, 1).transpose(0, 1)[None])
    ref, _ = gated_delta_rule(qq, kk, v[a:b].transpose(0, 1)[None], g[a:b].T[None], beta[a:b].T[None],
                              pool[slots[n]][None].clone())
    assert (o[a:b] - ref[0].transpose(0, 1)).abs().max() < TOL, n

# A NaN gate input (NaN activations) makes that head's outputs NaN from its token on, and the kernel still ends.
nan_gates = gates.clone()
nan_gates[2, 0] = float("nan")
o = recurrent_rows(q, k, v, nan_gates[:, :HV], nan_gates[:, HV : 2 * HV], a_log, dt_bias, pool.clone(), slots, cu)
assert o[2:5, 0].isnan().all() and not o[:2].isnan().any() and not o[:, 1:].isnan().any()

# New states: from zero, each writing its end state (and conv window) into its slot.
fresh = torch.full((6, HV, K, V), float("nan"))
o = recurrent_rows(q, k, v, gate_a, gate_b, a_log, dt_bias, fresh, torch.tensor([2, 5]), cu[:3], new_states=True)
for n, slot in enumerate([2, 5]):
    a, b = cu[n].item(), cu[n + 1].item()
    qq = l2_normalize(q[a:b].repeat_interleave(rep, 1).transpose(0, 1)[None]) * K**-0.5
    kk = l2_normalize(k[a:b].repeat_interleave(rep, 1).transpose(0, 1)[None])
    ref, final = gated_delta_rule(qq, kk, v[a:b].transpose(0, 1)[None], g[a:b].T[None], beta[a:b].T[None], None)
    assert (o[a:b] - ref[0].transpose(0, 1)).abs().max() < TOL, n
    assert (fresh[slot] - final[0]).abs().max() < TOL, n

windows = torch.full((5, C, 4), float("nan"))
y = conv_rows(x, w, windows, torch.tensor([1, 4, 0]), cu, new_states=True)
for n, slot in enumerate([1, 4, 0]):
    a, b = cu[n].item(), cu[n + 1].item()
    seq = torch.cat([torch.zeros(C, 4), x[a:b].T], dim=1)
    ref = torch.nn.functional.silu(torch.nn.functional.conv1d(seq[None, :, 1:], w[:, None, :], groups=C))[0].T
    assert (y[a:b] - ref).abs().max() < TOL, n
    assert torch.equal(windows[slot], seq[:, -4:]), n

# The chunked delta rule on segments of any length (several chunks, a partial last one, a single token): rows from
# their states in place, and new states from zero into their slots, against the fp32 chunked reference.
lens = [37, 1, 70]
T = sum(lens)
cu = torch.tensor([0, 37, 38, 108])
mixed = torch.randn(T, 2 * H * K + HV * V + 3)
q = mixed[:, : H * K].view(T, H, K)
k = mixed[:, H * K : 2 * H * K].view(T, H, K)
v = mixed[:, 2 * H * K : 2 * H * K + HV * V].view(T, HV, V)
gates = torch.randn(T, 2 * HV + 1)
gate_a, gate_b = gates[:, :HV], gates[:, HV : 2 * HV]
g = -a_log.exp() * torch.nn.functional.softplus(gate_a + dt_bias)
beta = torch.sigmoid(gate_b)
pool = torch.randn(6, HV, K, V) * 0.3
before = pool.clone()
slots = torch.tensor([4, 1, 4])
o = chunked_rows(q, k, v, gate_a, gate_b, a_log, dt_bias, pool, slots, cu)
assert torch.equal(pool, before)
fresh = torch.full((6, HV, K, V), float("nan"))
o_new = chunked_rows(q, k, v, gate_a, gate_b, a_log, dt_bias, fresh, torch.tensor([2, 5, 0]), cu, new_states=True)
for n in range(3):
    a, b = cu[n].item(), cu[n + 1].item()
    qq = l2_normalize(q[a:b].repeat_interleave(rep, 1).transpose(0, 1)[None]) * K**-0.5
    kk = l2_normalize(k[a:b].repeat_interleave(rep, 1).transpose(0, 1)[None])
    args = (qq, kk, v[a:b].transpose(0, 1)[None], g[a:b].T[None], beta[a:b].T[None])
    ref, _ = gated_delta_rule(*args, pool[slots[n]][None].clone())
    assert (o[a:b] - ref[0].transpose(0, 1)).abs().max() < 10 * TOL, n
    ref, final = gated_delta_rule(*args, None)
    assert (o_new[a:b] - ref[0].transpose(0, 1)).abs().max() < 10 * TOL, n
    assert (fresh[[2, 5, 0][n]] - final[0]).abs().max() < 10 * TOL, n
# Many segments inside a wider input (tokens 0-4 and 77-107 in none; several in one 16-token tile; an empty one), as
# a captured pass's groups: the chunked kernel answers as the token-by-token one, rows and new states.
inner_cu = torch.tensor([5, 8, 24, 41, 42, 42, 75, 77])
o1 = chunked_rows(q, k, v, gate_a, gate_b, a_log, dt_bias, pool, torch.tensor([0, 1, 2, 3, 4, 5, 0]), inner_cu)
o2 = recurrent_rows(q, k, v, gate_a, gate_b, a_log, dt_bias, pool, torch.tensor([0, 1, 2, 3, 4, 5, 0]), inner_cu)
assert (o1[5:77] - o2[5:77]).abs().max() < 10 * TOL
states_1, states_2 = torch.full((8, HV, K, V), float("nan")), torch.full((8, HV, K, V), float("nan"))
o1 = chunked_rows(q, k, v, gate_a, gate_b, a_log, dt_bias, states_1, torch.arange(7), inner_cu, new_states=True)
o2 = recurrent_rows(q, k, v, gate_a, gate_b, a_log, dt_bias, states_2, torch.arange(7), inner_cu, new_states=True)
written = [0, 1, 2, 3, 5, 6]  # the empty segment's slot (4) is left alone
assert (o1[5:77] - o2[5:77]).abs().max() < 10 * TOL and (states_1[written] - states_2[written]).abs().max() < 10 * TOL
assert states_1[4].isnan().all() and states_2[4].isnan().all()
# A captured pass's group ends in padding: empty segments on a scratch slot. With `padded` a few programs take the
# items in turn (here, on the CPU's one "SM", 4 or 18 programs for all of them) and answer exactly as a program per
# item does.
R.RECURRENT_LOOP = True
padded_cu = torch.cat([inner_cu, inner_cu[-1:].repeat(9)])
for kernel in (chunked_rows, recurrent_rows):
    slots = torch.tensor([0, 1, 2, 3, 4, 5, 0] + [5] * 9)
    rows = lambda padded: kernel(q, k, v, gate_a, gate_b, a_log, dt_bias, pool, slots, padded_cu, padded=padded)
    assert torch.equal(rows(False)[5:77], rows(True)[5:77])  # tokens in no segment: not written

    def new_states(padded: bool):
        states = torch.full((9, HV, K, V), float("nan"))
        o = kernel(q, k, v, gate_a, gate_b, a_log, dt_bias, states, torch.tensor([*range(7)] + [8] * 9), padded_cu,
                   new_states=True, padded=padded)
        assert states[[4, 7, 8]].isnan().all()  # the empty segments' slots (the padding's and one inside) untouched
        return torch.cat([o[5:77].flatten(), states[[0, 1, 2, 3, 5, 6]].flatten()])

    assert torch.equal(new_states(False), new_states(True))
# A padded group of long new states with its first segment on a launch of its own (LEAD_APART; here in order, no CUDA
# streams) answers as one launch does.


def long_group(lead_apart: bool, lead: int = 0):
    states = torch.full((9, HV, K, V), float("nan"))
    o = chunked_rows(q, k, v, gate_a, gate_b, a_log, dt_bias, states, torch.tensor([*range(7)] + [8] * 9), padded_cu,
                     new_states=True, padded=True, lead_apart=lead_apart, lead=lead)
    assert states[[4, 7, 8]].isnan().all()
    return torch.cat([o[5:77].flatten(), states[[0, 1, 2, 3, 5, 6]].flatten()])


assert R.LEAD_APART and torch.equal(long_group(True), long_group(False))
# Apart from the middle of the group (a captured pass's short and long new states in one group, its first long one
# apart): the segments before and after it in turn.
assert torch.equal(long_group(True, lead=2), long_group(False))

# The pointer softmax: questions of 1 to 40 options (several of the kernel's 16-option steps), a head width that is no
# power of two, a temperature; each row zero past its question's options.
from kev_backend.gpu.kernels.pointer import pointer_softmax

dp, widths = 24, [2, 1, 40, 5, 17]
decides = [sum(1 + n for n in widths[:i]) for i in range(len(widths))]
projected = torch.randn(sum(1 + n for n in widths), 2 * dp)
got = pointer_softmax(projected, torch.tensor(decides), torch.tensor(widths), 40, 2.0)
for i, (d, n) in enumerate(zip(decides, widths)):
    z = projected[d + 1 : d + 1 + n, dp:] @ projected[d, :dp] / dp**0.5 / 2.0
    assert (got[i, :n] - torch.softmax(z, 0)).abs().max() < 1e-6, i
    assert torch.equal(got[i, n:], torch.zeros(40 - n)), i

# The pass's conv (token slices in parallel, each finding its first segment) answers as the token-by-token one: rows
# from their windows, new states writing theirs; segments that start after the input's first token and end before its
# last (a captured pass's long group) leave the other tokens alone.
# In 32- and in 4-token slices, and in a small pass's (SCAN_SMALL): segments crossing many slices, scans starting
# inside a segment.
from kev_backend.gpu.kernels import conv as conv_kernels

small_pass_tokens = conv_kernels.SCAN_SMALL_TOKENS
for conv_kernels.SCAN_SMALL_TOKENS, conv_kernels.SCAN_TOKENS in ((0, 32), (0, 4), (108, 32)):
    lens = [37, 1, 70, 0]
    cu = torch.tensor([0, 37, 38, 108, 108])
    wide = torch.randn(108, C + 5)
    x = wide[:, 2 : 2 + C]
    pool = torch.randn(6, C, 4)
    slots = torch.tensor([3, 0, 3, 5])
    # Compiled, the two sum the window in different orders (fused multiply-adds): equal to rounding, not bit for bit.
    assert (conv_tokens(x, w, pool, slots, cu) - conv_rows(x, w, pool, slots, cu)).abs().max() < TOL
    windows_a, windows_b = torch.full((6, C, 4), float("nan")), torch.full((6, C, 4), float("nan"))
    ya = conv_tokens(x, w, windows_a, torch.tensor([1, 4, 0, 2]), cu, new_states=True)
    yb = conv_rows(x, w, windows_b, torch.tensor([1, 4, 0, 2]), cu, new_states=True)
    assert (ya - yb).abs().max() < TOL
    assert torch.equal(windows_a[[1, 4, 0]], windows_b[[1, 4, 0]])  # the empty segment (slot 2) writes no window
    inner = torch.tensor([5, 42, 42, 100])  # tokens 0-4 and 100-107 in no segment; an empty one in between
    ya = conv_tokens(x, w, pool, torch.tensor([3, 0, 5]), inner)
    yb = conv_rows(x[5:], w, pool, torch.tensor([3, 0, 5]), inner - 5)
    assert (ya[5:100] - yb[:95]).abs().max() < TOL
conv_kernels.SCAN_SMALL_TOKENS, conv_kernels.SCAN_TOKENS = small_pass_tokens, 32
print("ok")
"""


def run_check(**env: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHECK], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# The interpreter multiplies bf16 tensors as raw bits (numpy has no bf16): the chunked delta rule's chain runs its
# TF32 form here (exact fp32 in the interpreter); test_kernels_compiled_on_the_gpu checks the bf16 default.
INTERPRETER = {"TRITON_INTERPRET": "1", "KEV_CHUNK_DOTS": "tf32"}


def test_kernels_in_the_interpreter() -> None:
    run_check(**INTERPRETER)


def test_chunked_delta_rule_with_32_token_chunks_in_the_interpreter() -> None:
    """The chunk length bench/diag.py also times (KEV_CHUNK): the same checks hold with 32-token chunks."""
    run_check(**INTERPRETER, KEV_CHUNK="32")


@pytest.mark.gpu
def test_kernels_compiled_on_the_gpu() -> None:
    run_check(KEV_KERNEL_DEVICE="cuda")


# Spills measured to pay, by (kernel, CONTINUE, register cap, BM): the prep capped at 168 registers (six programs an
# SM, not four: kernels.delta_rule.PREP_MAXNREG). Compiled as a launch specialises them (aligned pointers and strides),
# no other kernel spills; compiled without that specialisation, rows' attention would spill and no loop would load by
# async copies.
SPILL_ALLOWED: dict[tuple[str, bool | None, int | None, int | None], int] = {
    ("_chunk_prep_kernel", None, 168, None): 60,
}


def test_kernels_compile_for_hopper_without_spills(tmp_path) -> None:
    """Our kernels at Kev-4B's shapes compile for sm_90a (Triton to PTX, then the wheel's ptxas) with no register
    spills but those measured to pay (SPILL_ALLOWED): the GPU run then only measures them. Needs no GPU."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kev_backend.gpu.kernels import attention as A
    from kev_backend.gpu.kernels import bank as B
    from kev_backend.gpu.kernels import conv as C
    from kev_backend.gpu.kernels import delta_rule as R
    from kev_backend.gpu.kernels import norms as N
    from kev_backend.gpu.kernels import pointer as P

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this triton wheel carries no ptxas")
    bf, f32, i64 = "*bf16", "*fp32", "*i64"
    recurrent = {"q": bf, "k": bf, "v": bf, "a": bf, "b": bf, "a_log": f32, "dt_bias": f32, "pool": f32}
    bf16_chain = R.CHUNK_DOTS == "bf16"
    chunk_w = bf if bf16_chain else f32  # W, Qs, Kd, QK and U₀ are stored as the chain multiplies them
    recurrent |= {"slots": i64, "cu": i64, "o": bf, "scale": "fp32"}
    chunk_terms = recurrent | {"dend": f32} | {name: chunk_w for name in ("w", "qs", "kd", "qk", "u")}
    deltanet_heads = dict(H=16, HV=32, K=128, V=128)  # Kev-4B's DeltaNet heads
    attention = {"q": bf, "k": bf, "v": bf, "k_pool": bf, "v_pool": bf, "o": bf, "scale": "fp32"}
    attention |= {"prefix": i64, "prefix_start": i64, "prefix_len": i64, "cu": i64}
    cases = [
        *[
            (
                N._rms_norm_kernel,
                {"x": bf, "residual": f32, "residual_out": f32, "weight": f32, "y": bf, "eps": "fp32"},
                dict(HAS_RESIDUAL=residual, STORE_RESIDUAL=residual, BLOCK=block),
                4,
            )
            for residual, block in ((True, 4096), (False, 256))
        ],
        (
            N._gated_rms_norm_kernel,
            {"x": bf, "z": bf, "weight": f32, "y": bf, "eps": "fp32"},
            dict(BLOCK=128, R=N.GATED_NORM_ROWS),
            4,
        ),
        (
            N._rms_norm_rope_kernel,
            {"x": bf, "weight": f32, "cos": f32, "sin": f32, "y": bf, "eps": "fp32"},
            dict(ROT=64, BLOCK=256, R=N.NORM_ROPE_ROWS),
            4,
        ),
        (N._silu_mul_kernel, {"gate_up": bf, "y": bf}, dict(BLOCK=1024), 4),
        (B._bank_kv_kernel, {"k": bf, "v": bf, "keys": bf, "values": bf, "dst": i64}, dict(WIDTH=1024, BLOCK=1024), 4),
        (
            P._pointer_softmax_kernel,
            {"p": f32, "decides": i64, "widths": i64, "out": f32, "root_dp": "fp32", "temperature": "fp32"},
            dict(BD=256, BW=P.OPTIONS_PER_STEP),
            4,
        ),
        (N._sigmoid_gate_kernel, {"x": bf, "gate": bf, "y": bf}, dict(BLOCK=256, R=N.NORM_ROPE_ROWS), 4),
        *[
            (
                C._conv_rows_kernel,
                {"x": bf, "weight": bf, "pool": bf, "slots": i64, "cu": i64, "y": bf},
                dict(W=4, BC=256, CONTINUE=continues),
                4,
            )
            for continues in (True, False)
        ],
        *[
            (
                C._conv_scan_kernel,
                {"x": bf, "weight": bf, "pool": bf, "slots": i64, "cu": i64, "y": bf},
                dict(W=4, BT=tokens, BC=channels, CONTINUE=continues),
                warps,
            )
            for continues in (True, False)
            for tokens, channels, warps in ((C.SCAN_TOKENS, C.SCAN_CHANNELS, C.SCAN_WARPS), C.SCAN_SMALL)
        ],
        *[
            (
                R._recurrent_rows_kernel,
                recurrent,
                deltanet_heads | dict(BV=R.RECURRENT_BV, CONTINUE=continues, LOOP=loop),
                R.RECURRENT_WARPS,
            )
            for continues in (True, False)
            for loop in sorted({False, R.RECURRENT_LOOP})
        ],
        (
            R._chunk_prep_kernel,
            chunk_terms,
            deltanet_heads | dict(BT=R.CHUNK, LOG2_BT=4),
            R.PREP_WARPS,
            R.PREP_MAXNREG,
        ),
        *[
            (
                R._chunked_delta_rule_kernel,
                chunk_terms,
                deltanet_heads | dict(BV=block_v, BT=R.CHUNK, CONTINUE=continues, BF16=bf16_chain, LOOP=loop),
                warps,
                maxnreg,
            )
            for continues in (True, False)
            # padded groups (LOOP: programs taking items in turn) run narrow
            for (block_v, warps, maxnreg), loop in (
                (R.CHUNK_NARROW, False),
                (R.CHUNK_NARROW, True),
                (R.CHUNK_WIDE, False),
            )
        ],
        *[
            (
                A._rows_attention_kernel,
                attention,
                dict(HQ=16, HKV=4, D=256, BM=rows // 4, BN=A.WIDE_HEAD_KEYS, GP=4)
                | dict(HAS_PREFIX=has_prefix, SPLIT=A.SPLIT_DIAGONAL, EXP2=A.EXP2),
                A.WIDE_HEAD_WARPS,
            )
            for has_prefix, rows in ((True, A.TILE_ROWS), (False, A.TILE_ROWS), (False, A.LONG_TILE_ROWS))
        ],
    ]
    for fn, types, constants, warps, *cap in cases:  # cap: a register cap (ptxas's .maxnreg), where one is set
        names = list(inspect.signature(fn.fn).parameters)
        signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
        # As a launch specialises them: pointers (torch's allocations and Kev-4B's views) and strides (multiples of 16
        # elements at Kev-4B's shapes) divisible by 16. Without it Triton neither vectorises nor pipelines the loads
        # (no async copies), and registers and spills differ from the kernels that run.
        aligned = [i for i, n in enumerate(names) if signature[n].startswith("*") or n.startswith("stride")]
        source = ASTSource(
            fn=fn,
            signature=signature,
            constexprs={(names.index(n),): v for n, v in constants.items()},
            attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
        )
        maxnreg = cap[0] if cap else None
        options = {"num_warps": warps} | ({"maxnreg": maxnreg} if maxnreg else {})
        compiled = compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        ptx = tmp_path / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        result = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(tmp_path / "kernel.cubin")],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        spilled = re.search(r"(\d+) bytes spill stores", result.stderr)
        allowed = SPILL_ALLOWED.get((fn.fn.__name__, constants.get("CONTINUE"), maxnreg, constants.get("BM")), 0)
        assert spilled and int(spilled[1]) <= allowed, (
            fn.fn.__name__,
            constants,
            result.stderr[-500:],
        )
