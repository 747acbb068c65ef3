"""Attention of question rows over their state's K/V in the bank (by index) and their own, bottom-right causal
(rows_attention); and states' causal attention over their own tokens, at any length, a state grown from a banked
point over the point's tokens first, with the same arithmetic as the state computed whole (states_attention)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import grid
from .segments import segment_bounds

# Query rows per program (tokens × the query heads sharing a key/value head; tl.dot wants at least 16), and keys per
# step and pipeline stages for heads over 128 wide (Qwen3.5's 256), all read at each launch. 64 rows read a GQA
# group's prefix once per tile, not once per head; 64 keys on 2 stages is the fastest of the tiles measured
# (docs/kernels.md). 8 warps (as launched, no spills on sm_90a: tests/gpu/kernels/test_compiled_for_hopper.py).
TILE_ROWS = 64
WIDE_HEAD_KEYS = 64
WIDE_HEAD_STAGES = 2
WIDE_HEAD_WARPS = 8
# Query rows per program for states whose rows attend to more than LONG_ABOVE keys (new states over LONG_ABOVE tokens,
# turns over a point and their own): bigger tiles pay (128 rows × 64 keys on 2 stages, faster than torch's varlen
# attention; a turn after 32k-64k tokens, or six at once after 8k, in half the time of rows' tiles: docs/kernels.md).
# A row's arithmetic does not depend on the tile's rows (keys per step and warps are the same), so a state's output
# depends neither on the states batched with it nor on the point it was computed from.
LONG_TILE_ROWS = 128
LONG_ABOVE = 128
# Pipeline stages of the key loop for heads up to 128 wide (Triton's default on sm_90), read at each launch.
ATTENTION_STAGES = 3
# The scale holds log2(e) and the softmax exponentiates in base 2 (the same softmax, fewer instructions).
LOG2_E = 1.4426950408889634
# A state's keys in parts of FOLD_KEYS (from the state's first token): each part's online softmax starts afresh and
# the parts' running max, sum and output are combined in part order by _fold. Rows (questions) read their state's keys
# in the same parts, then their own keys in the last; a state's own tokens attend to its keys up to theirs. A launch
# folds the parts in turn inside each tile's program, or reads them in parallel, a program each, and
# _merge_parts_kernel folds them with the same _fold in the same order: the same bits either way, so a row's or a
# turn's answer depends on neither the launch nor its batch, and a lone turn or question over a 64k-token
# conversation runs 16 programs a tile where one walked all its keys (the GPU mostly idle). Eagerly, rows and
# states continuing a point take the parallel launch where their tokens × parts fit PARALLEL_PARTS_ENTRIES; a new
# state computed whole folds in turn. A tile whose keys lie in the first part (every state of FOLD_KEYS tokens or
# fewer, every row over such a state) never folds and computes what it always did. A state's tile never straddles a
# part: its rows (BM tokens) and a point (64-token pages) divide FOLD_KEYS.
FOLD_KEYS = 4096
# Rows and states continuing a point read their parts in parallel where the launch's tokens × parts come to at most
# this many (the parts' partial outputs: [tokens, Hq, parts, D] fp32, 512 MiB at Kev-4B's heads, 768 MiB at
# Kev-27B's): a graph's extension or long-prefix bucket (1,024 tokens × 16 parts: graphs.EXT_BUCKETS), or dozens of
# turns near 8k tokens at once. A larger launch folds in turn and is slower for it: six turns near 8k tokens on an
# H100, ms a layer, 1.16 in parallel, 1.98 in turn. A launch's part count is an argument, not a constant its kernel is
# compiled for (do_not_specialize): eager passes over states of any length run the kernels the warm-up compiled.
PARALLEL_PARTS_ENTRIES = 32_768


@triton.jit
def _attend_tile(b_q, b_k, b_v, keep, scale, m_i, l_i, acc, MASKED: tl.constexpr):
    """One key tile of the online softmax: queries b_q [R, D] against keys b_k and values b_v [BN, D], where `keep`
    [R, BN] says which pairs count (MASKED; otherwise all do); returns the running max, sum and output accumulator.
    The scale holds log2(e) and the exponentials are base 2 (LOG2_E)."""
    s = tl.dot(b_q, tl.trans(b_k)) * scale
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v)


@triton.jit
def _fold(m_i, l_i, acc, m_j, l_j, acc_j):
    """The running max, sum and output accumulator (m_i, l_i, acc) followed by a part's own (m_j, l_j, acc_j), in
    explicit fused multiply-adds: every fold compiles to the same arithmetic, in a tile's program and in
    _merge_parts_kernel alike. Folded into (-inf, 0, 0), a part is itself, bit for bit (the scales are 0 and 1)."""
    m_new = tl.maximum(m_i, m_j)
    alpha = tl.math.exp2(m_i - m_new)
    beta = tl.math.exp2(m_j - m_new)
    l_new = tl.fma(l_j, beta, l_i * alpha)
    acc_new = tl.fma(acc_j, tl.broadcast_to(beta[:, None], acc_j.shape), acc * alpha[:, None])
    return m_new, l_new, acc_new


@triton.jit
def _tile_rows(i_m, hk, L, G: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr):
    """A tile's rows: for its BM tokens from the segment's i_m-th block, each of the G query heads sharing key/value
    head hk (GP: G rounded up to a power of two, the extra rows masked). Returns each row's token in the segment,
    whether it is one, and its query head."""
    o_r = tl.arange(0, GP * BM)
    g = o_r // BM  # the tile's row r: query head hk * G + g, token i_m * BM + r % BM of the segment
    o_m = i_m * BM + o_r % BM
    return o_m, (o_m < L) & (g < G), hk * G + g


@triton.jit
def _attend_causal_block(
    b_q, k, v, bos, o_n, o_m, L, hk, o_d, stride_kt, stride_vt, scale, m_i, l_i, acc, D: tl.constexpr
):
    """The segment's own keys at o_n (positions in the segment, past its end masked) for the tile's rows at o_m,
    causal: a row sees the keys up to its own token."""
    m_n = o_n < L
    b_k = tl.load(k + (bos + o_n)[:, None] * stride_kt + hk * D + o_d[None, :], mask=m_n[:, None], other=0.0)
    b_v = tl.load(v + (bos + o_n)[:, None] * stride_vt + hk * D + o_d[None, :], mask=m_n[:, None], other=0.0)
    keep = m_n[None, :] & (o_n[None, :] <= o_m[:, None])
    return _attend_tile(b_q, b_k, b_v, keep, scale, m_i, l_i, acc, True)


@triton.jit
def _end_part(
    part_acc, part_ml, at, o_d, m_r, part, last, m_i, l_i, acc, D: tl.constexpr, SPLIT: tl.constexpr,
    FOLD: tl.constexpr
):  # fmt: skip
    """A part's running max, sum and accumulator, at its end: SPLIT, stored at the rows' entries `at` + part of
    part_ml / part_acc for _merge_parts_kernel; FOLD (a program folding its parts in turn), folded after what is folded
    so far (kept at the entries `at`, fp32) and stored back for the next part unless this is the `last`. Returns what
    the program goes on with."""
    if SPLIT:
        tl.store(part_ml + (at + part) * 2, m_i, mask=m_r)
        tl.store(part_ml + (at + part) * 2 + 1, l_i, mask=m_r)
        tl.store(part_acc + (at + part)[:, None] * D + o_d[None, :], acc, mask=m_r[:, None])
    elif FOLD:
        if part > 0:  # what is folded so far, then this part
            tl.debug_barrier()  # this program's stores before are visible to all its threads
            m_s = tl.load(part_ml + at * 2, mask=m_r, other=0.0)
            l_s = tl.load(part_ml + at * 2 + 1, mask=m_r, other=1.0)
            acc_s = tl.load(part_acc + at[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.0)
            m_i, l_i, acc = _fold(m_s, l_s, acc_s, m_i, l_i, acc)
        if part < last:
            tl.debug_barrier()  # every thread has read the entries before any overwrites them
            tl.store(part_ml + at * 2, m_i, mask=m_r)
            tl.store(part_ml + at * 2 + 1, l_i, mask=m_r)
            tl.store(part_acc + at[:, None] * D + o_d[None, :], acc, mask=m_r[:, None])
    return m_i, l_i, acc


@triton.jit
def _store_out(o, bos, o_m, head, o_d, m_r, acc, l_i, stride_ot, D: tl.constexpr):
    """The tile's rows' attention output: the accumulator over the sum, in o's dtype."""
    out = acc / l_i[:, None]
    o_rows = (bos + o_m)[:, None] * stride_ot + head[:, None] * D + o_d[None, :]
    tl.store(o + o_rows, out.to(o.dtype.element_ty), mask=m_r[:, None])


@triton.jit(do_not_specialize=["PARTS"])
def _rows_attention_kernel(
    q,
    k,
    v,
    k_pool,
    v_pool,
    o,
    part_acc,
    part_ml,
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
    GP: tl.constexpr,
    PARTS,
    SPLIT: tl.constexpr,
    FOLD: tl.constexpr,
    FOLD_KEYS: tl.constexpr,
):
    """A program per (BM query tokens, row, key/value head[, part]): its tile's rows are those tokens for each of the
    HQ // HKV query heads sharing the key/value head (GP: that group size rounded up to a power of two, the extra
    rows masked), so each key tile is read once for all of them: with Kev-4B's 4 query heads per key/value head, a
    row's prefix is read by one program of 64 rows, not by 4 programs of 16. A row's P prefix keys come in parts of
    FOLD_KEYS, its own keys in the last: FOLD folds the parts in turn in this program, what is folded so far kept in
    part_acc / part_ml ([T, HQ] entries, written and read by this program alone); SPLIT runs a program per part (the
    grid's third axis; programs past the row's parts return), each writing its own into part_acc / part_ml ([T, HQ,
    PARTS] entries) for _merge_parts_kernel. Neither: no row's prefix reaches a second part (the launch's prefixes
    are FOLD_KEYS keys or fewer)."""
    G: tl.constexpr = HQ // HKV
    # The last query blocks (the most keys under causal attention) are dispatched first: less of a tail.
    i_m, i_nh = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1)
    n, hk = i_nh // HKV, i_nh % HKV
    bos, eos = tl.load(cu + n).to(tl.int64), tl.load(cu + n + 1).to(tl.int64)
    L = eos - bos
    p_bos, P = tl.load(prefix_start + n).to(tl.int64), tl.load(prefix_len + n).to(tl.int64)
    if SPLIT or FOLD:
        last = tl.maximum(tl.cdiv(P, FOLD_KEYS), 1) - 1  # the row's last part, which goes on with its own keys
    else:
        last = 0
    if SPLIT:
        first = tl.program_id(2)
        stop = first + 1
        active = (i_m * BM < L) & (first <= last)
    else:
        first = 0
        stop = last + 1
        active = i_m * BM < L
    if active:
        o_m, m_r, head = _tile_rows(i_m, hk, L, G, GP, BM)
        o_d = tl.arange(0, D)
        q_rows = (bos + o_m)[:, None] * stride_qt + head[:, None] * D + o_d[None, :]
        b_q = tl.load(q + q_rows, mask=m_r[:, None], other=0.0)
        at = ((bos + o_m) * HQ + head) * PARTS  # the rows' entries in part_acc / part_ml
        m_i = tl.full([GP * BM], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GP * BM], dtype=tl.float32)
        acc = tl.zeros([GP * BM, D], dtype=tl.float32)
        for part in range(first, stop):
            m_i = tl.full([GP * BM], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([GP * BM], dtype=tl.float32)
            acc = tl.zeros([GP * BM, D], dtype=tl.float32)
            if SPLIT or FOLD:
                lo = part * FOLD_KEYS
                hi = tl.minimum(P, lo + FOLD_KEYS)
            else:
                lo, hi = 0, P
            # The state's K/V (this part's keys), read in place from the bank pool through its token index: its whole
            # key blocks without masks, then the rest masked.
            whole = lo + (hi - lo) // BN * BN
            for start in range(lo, whole, BN):
                idx = tl.load(prefix + p_bos + start + tl.arange(0, BN)).to(tl.int64)
                b_k = tl.load(k_pool + idx[:, None] * stride_pt + hk * D + o_d[None, :])
                b_v = tl.load(v_pool + idx[:, None] * stride_pt + hk * D + o_d[None, :])
                m_i, l_i, acc = _attend_tile(b_q, b_k, b_v, None, scale, m_i, l_i, acc, False)
            for start in range(whole, hi, BN):
                o_n = start + tl.arange(0, BN)
                m_n = o_n < hi
                idx = tl.load(prefix + p_bos + o_n, mask=m_n, other=0).to(tl.int64)
                b_k = tl.load(k_pool + idx[:, None] * stride_pt + hk * D + o_d[None, :], mask=m_n[:, None], other=0.0)
                b_v = tl.load(v_pool + idx[:, None] * stride_pt + hk * D + o_d[None, :], mask=m_n[:, None], other=0.0)
                m_i, l_i, acc = _attend_tile(b_q, b_k, b_v, m_n[None, :], scale, m_i, l_i, acc, True)
            # The segment's own K/V, causal (in the last part): the keys before the tile's first token, which every
            # row of the tile sees (whole key blocks of them), without masks, then the rest masked.
            if part == last:
                diagonal = (i_m * BM) // BN * BN
                for own in range(0, diagonal, BN):
                    o_n = own + tl.arange(0, BN)
                    b_k = tl.load(k + (bos + o_n)[:, None] * stride_kt + hk * D + o_d[None, :])
                    b_v = tl.load(v + (bos + o_n)[:, None] * stride_vt + hk * D + o_d[None, :])
                    m_i, l_i, acc = _attend_tile(b_q, b_k, b_v, None, scale, m_i, l_i, acc, False)
                for own in range(diagonal, (i_m + 1) * BM, BN):
                    o_n = own + tl.arange(0, BN)
                    m_i, l_i, acc = _attend_causal_block(
                        b_q, k, v, bos, o_n, o_m, L, hk, o_d, stride_kt, stride_vt, scale, m_i, l_i, acc, D
                    )
            m_i, l_i, acc = _end_part(part_acc, part_ml, at, o_d, m_r, part, last, m_i, l_i, acc, D, SPLIT, FOLD)
        if not SPLIT:
            _store_out(o, bos, o_m, head, o_d, m_r, acc, l_i, stride_ot, D)


@triton.jit(do_not_specialize=["PARTS"])
def _states_attention_kernel(
    q,
    k,
    v,
    k_pool,
    v_pool,
    o,
    part_acc,
    part_ml,
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
    GP: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    PARTS,
    SPLIT: tl.constexpr,
    FOLD: tl.constexpr,
    FOLD_KEYS: tl.constexpr,
):
    """A program per (BM query tokens, state, key/value head[, part]), its tile's rows as _rows_attention_kernel's:
    causal attention of a state's tokens over its keys. A new state's are its own; a state continuing a banked point
    (HAS_PREFIX) has its point's P tokens first, their K/V read from the bank through `prefix`, then its own (its
    segment holds its tokens from P on). Keys come in blocks of BN from the state's first, those every row of the
    tile sees unmasked, then the rest masked, and their online softmax starts afresh at every FOLD_KEYS-th key
    (FOLD_KEYS): FOLD folds the parts in turn in this program, what is folded so far kept in part_acc / part_ml
    ([T, HQ] entries, written and read by this program alone); SPLIT runs a program per part (the grid's third axis),
    each writing its own into part_acc / part_ml ([T, HQ, PARTS] entries) for _merge_parts_kernel. Neither: no tile
    reaches a second part (the launch's states are FOLD_KEYS tokens or fewer)."""
    G: tl.constexpr = HQ // HKV
    # The last query blocks (the most keys under causal attention) are dispatched first: less of a tail.
    i_m, i_nh = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1)
    n, hk = i_nh // HKV, i_nh % HKV
    bos, eos = tl.load(cu + n).to(tl.int64), tl.load(cu + n + 1).to(tl.int64)
    L = eos - bos
    if HAS_PREFIX:
        p_bos, P = tl.load(prefix_start + n).to(tl.int64), tl.load(prefix_len + n).to(tl.int64)
    else:
        p_bos, P = 0, 0
    t0 = P + i_m * BM  # the tile's first token, from the state's first
    diagonal = t0 // BN * BN  # keys before its key block: every row of the tile sees them
    if SPLIT or FOLD:
        last = t0 // FOLD_KEYS  # the tile's last part: the tile lies in one (BM divides FOLD_KEYS and P)
    else:
        last = 0
    if SPLIT:
        first = tl.program_id(2)
        stop = first + 1
        active = (i_m * BM < L) & (first <= last)
    else:
        first = 0
        stop = last + 1
        active = i_m * BM < L
    if active:
        o_m, m_r, head = _tile_rows(i_m, hk, L, G, GP, BM)
        o_d = tl.arange(0, D)
        q_rows = (bos + o_m)[:, None] * stride_qt + head[:, None] * D + o_d[None, :]
        b_q = tl.load(q + q_rows, mask=m_r[:, None], other=0.0)
        at = ((bos + o_m) * HQ + head) * PARTS  # the rows' entries in part_acc / part_ml
        m_i = tl.full([GP * BM], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GP * BM], dtype=tl.float32)
        acc = tl.zeros([GP * BM, D], dtype=tl.float32)
        for part in range(first, stop):
            m_i = tl.full([GP * BM], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([GP * BM], dtype=tl.float32)
            acc = tl.zeros([GP * BM, D], dtype=tl.float32)
            if SPLIT or FOLD:
                lo = part * FOLD_KEYS
                hi = tl.minimum(lo + FOLD_KEYS, diagonal)
            else:
                lo, hi = 0, diagonal
            # The point's keys, read in place from the bank pool through its token index (whole key blocks: a
            # point is on a page boundary).
            if HAS_PREFIX:
                for start in range(lo, tl.minimum(hi, P), BN):
                    idx = tl.load(prefix + p_bos + start + tl.arange(0, BN)).to(tl.int64)
                    b_k = tl.load(k_pool + idx[:, None] * stride_pt + hk * D + o_d[None, :])
                    b_v = tl.load(v_pool + idx[:, None] * stride_pt + hk * D + o_d[None, :])
                    m_i, l_i, acc = _attend_tile(b_q, b_k, b_v, None, scale, m_i, l_i, acc, False)
                own = tl.maximum(lo, P)
            else:
                own = lo
            # Its own keys before the tile's key block, then (in its last part) that block and the next, masked.
            for start in range(own, hi, BN):
                o_n = start - P + tl.arange(0, BN)
                b_k = tl.load(k + (bos + o_n)[:, None] * stride_kt + hk * D + o_d[None, :])
                b_v = tl.load(v + (bos + o_n)[:, None] * stride_vt + hk * D + o_d[None, :])
                m_i, l_i, acc = _attend_tile(b_q, b_k, b_v, None, scale, m_i, l_i, acc, False)
            if part == last:
                for start in range(diagonal, t0 + BM, BN):
                    o_n = start - P + tl.arange(0, BN)
                    m_i, l_i, acc = _attend_causal_block(
                        b_q, k, v, bos, o_n, o_m, L, hk, o_d, stride_kt, stride_vt, scale, m_i, l_i, acc, D
                    )
            m_i, l_i, acc = _end_part(part_acc, part_ml, at, o_d, m_r, part, last, m_i, l_i, acc, D, SPLIT, FOLD)
        if not SPLIT:
            _store_out(o, bos, o_m, head, o_d, m_r, acc, l_i, stride_ot, D)


@triton.jit(do_not_specialize=["PARTS"])
def _merge_parts_kernel(
    o,
    part_acc,
    part_ml,
    prefix_len,
    cu,
    stride_ot,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    GP: tl.constexpr,
    PARTS,
    FOLD_KEYS: tl.constexpr,
    BY_POSITION: tl.constexpr,
):
    """A split launch's outputs: for the rows of the attention kernel's tile, their parts' running max, sum and
    accumulator folded in part order (_fold), then divided, as a launch folding them in turn does. Rows' parts
    (_rows_attention_kernel) follow their prefix's length; a state's (BY_POSITION: _states_attention_kernel's) the
    tile's first token, from the state's first."""
    G: tl.constexpr = HQ // HKV
    i_m, i_nh = tl.program_id(0), tl.program_id(1)
    n, hk = i_nh // HKV, i_nh % HKV
    bos, eos = tl.load(cu + n).to(tl.int64), tl.load(cu + n + 1).to(tl.int64)
    L = eos - bos
    if i_m * BM < L:
        P = tl.load(prefix_len + n).to(tl.int64)
        if BY_POSITION:
            parts = (P + i_m * BM) // FOLD_KEYS + 1
        else:
            parts = tl.maximum(tl.cdiv(P, FOLD_KEYS), 1)
        o_m, m_r, head = _tile_rows(i_m, hk, L, G, GP, BM)
        o_d = tl.arange(0, D)
        base = ((bos + o_m) * HQ + head) * PARTS
        m_i = tl.full([GP * BM], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GP * BM], dtype=tl.float32)
        acc = tl.zeros([GP * BM, D], dtype=tl.float32)
        for j in range(0, parts):
            m_j = tl.load(part_ml + (base + j) * 2, mask=m_r, other=0.0)
            l_j = tl.load(part_ml + (base + j) * 2 + 1, mask=m_r, other=1.0)
            acc_j = tl.load(part_acc + (base + j)[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.0)
            m_i, l_i, acc = _fold(m_i, l_i, acc, m_j, l_j, acc_j)
        _store_out(o, bos, o_m, head, o_d, m_r, acc, l_i, stride_ot, D)


def rows_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    prefix: torch.Tensor,
    prefix_start: torch.Tensor,
    prefix_len: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    out: torch.Tensor | None = None,
    max_prefix: int = 0,
    parallel: bool = True,
) -> torch.Tensor:
    """Attention of question rows over [their state's K/V | their own K/V], bottom-right causal, GQA.

    q: [T, Hq, D] and k: [T, Hkv, D] contiguous; v: [T, Hkv, D] with any token stride (e.g. a slice of the
    projection, read in place); k_pool, v_pool: [tokens, Hkv, D] bank pool;
    prefix: pool token indices of the states' tokens, one run per state; row n's state is the run of
    prefix_len[n] entries at prefix_start[n]; cu [N + 1] the rows' token offsets; max_len bounds a row's length
    (it sizes the grid). The state's K/V are read where the bank keeps them, never copied per row. Writes `out` when
    given. max_prefix: the longest row prefix (a host count, or a bound: at least each row's), which sizes its parts
    (FOLD_KEYS); `parallel`: its parts may run a program each (where T × parts fits PARALLEL_PARTS_ENTRIES), else
    they fold in turn. Every row gets the same bits whatever the launch.
    """
    T, HQ, D = q.shape
    HKV = k.shape[1]
    o = _checked(q, k, v, k_pool, v_pool, out)
    n = cu.shape[0] - 1
    GP, BM, BN, stages, warps = _tiles(HQ, HKV, D, TILE_ROWS)
    folds = max_prefix > FOLD_KEYS
    split = folds and parallel and T * triton.cdiv(max_prefix, FOLD_KEYS) <= PARALLEL_PARTS_ENTRIES
    parts = triton.cdiv(max_prefix, FOLD_KEYS) if split else 1
    # A part's entries for each (token, query head): split, every part's; folding in turn, the fold's. Not read else.
    part_acc, part_ml = _partials(q, parts) if folds else (o, o)
    for first, last in grid.segment_spans(n, HKV):  # a program per (query block, row, key/value head[, part])
        spans = (prefix_start[first:last], prefix_len[first:last], cu[first : last + 1])
        _rows_attention_kernel[(triton.cdiv(max_len, BM), (last - first) * HKV, parts)](
            *_leading(q, k, v, k_pool, v_pool, o, part_acc, part_ml, prefix, *spans),
            HQ=HQ,
            HKV=HKV,
            D=D,
            BM=BM,
            BN=BN,
            GP=GP,
            PARTS=parts,
            SPLIT=split,
            FOLD=folds and not split,
            FOLD_KEYS=FOLD_KEYS,
            num_warps=warps,
            num_stages=stages,
        )
        if split:
            _merge_parts(o, part_acc, part_ml, *spans[1:], max_len, HKV, BM, GP, warps)
    return o


def states_attention(
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
    max_keys: int = 0,
) -> torch.Tensor:
    """Causal attention of states over their tokens, GQA: new states over their own (prefix None), or states
    continuing a banked point, over the point's K/V in the pool (a run of prefix_len[n] entries of `prefix` at
    prefix_start[n], a multiple of 64 tokens: pages) and then their own, their tokens being the state's from the
    point on. The arguments as rows_attention's; max_keys: the longest state's tokens, its point's and its own (a
    host count; at least each state's, which it parts by: FOLD_KEYS), or 0 for max_len (new states). A state's
    tokens get the same bits whether it was computed whole or from any of its points, in any batch."""
    T, HQ, D = q.shape
    HKV = k.shape[1]
    o = _checked(q, k, v, k_pool, v_pool, out)
    n = cu.shape[0] - 1
    has_prefix = prefix is not None
    if not has_prefix:
        prefix = prefix_start = prefix_len = cu  # not read
    assert max_keys > 0 or not has_prefix, "states continuing a point: max_keys bounds their parts"
    keys = max(max_keys, max_len)
    GP, BM, BN, stages, warps = _tiles(HQ, HKV, D, LONG_TILE_ROWS if keys > LONG_ABOVE else TILE_ROWS)
    if has_prefix and 64 % BM:  # a turn's tiles start at its point, a page boundary: rows' tiles without GQA
        GP, BM, BN, stages, warps = _tiles(HQ, HKV, D, TILE_ROWS)
    assert FOLD_KEYS % BM == 0 and FOLD_KEYS % BN == 0 and (not has_prefix or 64 % BM == 0)
    folds = keys > FOLD_KEYS
    split = folds and has_prefix and T * triton.cdiv(keys, FOLD_KEYS) <= PARALLEL_PARTS_ENTRIES
    parts = triton.cdiv(keys, FOLD_KEYS) if split else 1
    # A part's entries for each (token, query head): split, every part's; folding in turn, the fold's. Not read else.
    part_acc, part_ml = _partials(q, parts) if folds else (o, o)
    for first, last in grid.segment_spans(n, HKV):  # a program per (query block, state, key/value head[, part])
        spans = (prefix_start[first:last], prefix_len[first:last], cu[first : last + 1])
        _states_attention_kernel[(triton.cdiv(max_len, BM), (last - first) * HKV, parts)](
            *_leading(q, k, v, k_pool, v_pool, o, part_acc, part_ml, prefix, *spans),
            HQ=HQ,
            HKV=HKV,
            D=D,
            BM=BM,
            BN=BN,
            GP=GP,
            HAS_PREFIX=has_prefix,
            PARTS=parts,
            SPLIT=split,
            FOLD=folds and not split,
            FOLD_KEYS=FOLD_KEYS,
            num_warps=warps,
            num_stages=stages,
        )
        if split:
            _merge_parts(o, part_acc, part_ml, *spans[1:], max_len, HKV, BM, GP, warps, by_position=True)
    return o


def _checked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """The output tensor (`out`, or a new one), once the inputs' layouts are those the kernels read."""
    D = q.shape[2]
    assert q.is_contiguous() and k.is_contiguous() and k_pool.is_contiguous()
    assert v.stride(1) == D and v.stride(2) == 1 and v_pool.stride() == k_pool.stride()
    o = torch.empty_like(q) if out is None else out
    assert o.shape == q.shape and o.is_contiguous()
    return o


def _leading(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    o: torch.Tensor,
    part_acc: torch.Tensor,
    part_ml: torch.Tensor,
    prefix: torch.Tensor,
    prefix_start: torch.Tensor,
    prefix_len: torch.Tensor,
    cu: torch.Tensor,
) -> tuple:
    """The attention kernels' arguments before their constants, for one span of segments: the tensors, the softmax
    scale (log2(e) in it) and the token strides."""
    D = q.shape[2]
    tensors = (q, k, v, k_pool, v_pool, o, part_acc, part_ml, prefix, prefix_start, prefix_len, cu)
    return (*tensors, D**-0.5 * LOG2_E, q.stride(0), k.stride(0), v.stride(0), k_pool.stride(0), o.stride(0))


def _partials(q: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Running outputs and (max, sum) per (token, query head, part), fp32: [T, Hq, parts, D] and [T, Hq, parts, 2]."""
    T, HQ, D = q.shape
    acc = torch.empty(T, HQ, parts, D, device=q.device, dtype=torch.float32)
    return acc, torch.empty(T, HQ, parts, 2, device=q.device, dtype=torch.float32)


def _tiles(HQ: int, HKV: int, D: int, rows: int) -> tuple[int, int, int, int, int]:
    """A launch's tile: (GP, BM, BN, stages, warps) for tiles of `rows` rows, BM tokens × the query heads of one
    key/value head (GP: their count rounded up to a power of two)."""
    GP = triton.next_power_of_2(HQ // HKV)
    BM = max(1, rows // GP)
    BN, stages = (64, ATTENTION_STAGES) if D <= 128 else (WIDE_HEAD_KEYS, WIDE_HEAD_STAGES)
    warps = 4 if D <= 128 else WIDE_HEAD_WARPS
    return GP, BM, BN, stages, warps


def _merge_parts(
    o: torch.Tensor,
    part_acc: torch.Tensor,
    part_ml: torch.Tensor,
    prefix_len: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    HKV: int,
    BM: int,
    GP: int,
    warps: int,
    by_position: bool = False,
) -> None:
    """_merge_parts_kernel over a split launch's segments (rows', or by_position states')."""
    _, HQ, parts, D = part_acc.shape
    _merge_parts_kernel[(triton.cdiv(max_len, BM), (cu.shape[0] - 1) * HKV)](
        o,
        part_acc,
        part_ml,
        prefix_len,
        cu,
        o.stride(0),
        HQ=HQ,
        HKV=HKV,
        D=D,
        BM=BM,
        GP=GP,
        PARTS=parts,
        FOLD_KEYS=FOLD_KEYS,
        BY_POSITION=by_position,
        num_warps=warps,
    )


def reference_segment_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal attention of one segment's queries [L, Hq, D] over keys and values [S, Hkv, D], bottom-right aligned
    (query i sees keys 0..S-L+i), GQA (query head h reads key/value head h // (Hq/Hkv)), in one softmax."""
    L, S = q.shape[0], keys.shape[0]
    rep = q.shape[1] // keys.shape[1]
    kk, vv = (t.float().repeat_interleave(rep, 1).transpose(0, 1) for t in (keys, values))  # [Hq, S, D]
    scores = q.float().transpose(0, 1) @ kk.transpose(1, 2) * q.shape[-1] ** -0.5  # [Hq, L, S]
    hidden = torch.ones(L, S, dtype=torch.bool, device=q.device).triu(S - L + 1)
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return (probs @ vv).transpose(0, 1).to(q.dtype)


def reference_rows_attention(
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
    max_prefix: int = 0,
    parallel: bool = True,
) -> torch.Tensor:
    """rows_attention and states_attention in torch (tests/gpu/kernels/test_attention.py, tests/gpu/fused_cpu_ops.py),
    segment by segment: over [k_pool/v_pool at the segment's prefix run, if any | its own K/V], bottom-right causal (a
    state continuing a point: its tokens are the last of the state's). Tokens outside the segments are zeros (or
    `out`'s)."""
    o = torch.zeros_like(q) if out is None else out
    for n, (lo, hi) in enumerate(segment_bounds(cu)):
        assert hi - lo <= max_len
        if hi == lo:
            continue
        idx = prefix[prefix_start[n] : prefix_start[n] + prefix_len[n]] if prefix is not None else []
        keys, values = torch.cat([k_pool[idx], k[lo:hi]]), torch.cat([v_pool[idx], v[lo:hi]])
        o[lo:hi] = reference_segment_attention(q[lo:hi], keys, values)
    return o


reference_states_attention = reference_rows_attention  # the same formula: bottom-right causal over [prefix | own]
