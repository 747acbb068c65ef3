"""kernels.attention.rows_attention against its torch reference (model.qwen35's causal attention, segment by
segment): in Triton's interpreter on a CPU, compiled on a GPU (tests/conftest.py); cudnn_attention against the fp32
formula and ours, on a GPU, and the layout and length classes it gives torch, anywhere."""

from __future__ import annotations

import os

import pytest
import torch

from kev_backend.gpu.kernels import grid
from kev_backend.gpu.kernels.attention import (
    CUDNN_ABOVE,
    cudnn_attention,
    cudnn_attention_runs,
    cudnn_plan_lengths,
    reference_rows_attention,
    reference_segment_attention,
    rows_attention,
)
from kev_backend.model.qwen35 import causal_attention

D, T, POOL = 32, 28, 200
CU = [0, 7, 27, 28]
RUNS = [[3, 4, 5, 6, 100, 101], list(range(40, 77))]  # the states' tokens in the pool
ROW_RUNS = [0, 1, 0]  # rows 0 and 2 continue the same state
# Query heads per key/value head: 2, and 3 (Qwen3.5-27B has 6: a program's tile pads the group to a power of two).
GROUPS = pytest.mark.parametrize(("HQ", "HKV"), [(4, 2), (6, 2)], ids=["gqa2", "gqa3"])


def rows(HQ: int, HKV: int):
    """Rows' inputs: q, k, v (v a slice of a wider projection, read in place), the pool's K/V, and the prefix."""
    kp, vp = torch.randn(POOL, HKV, D), torch.randn(POOL, HKV, D)
    prefix = torch.tensor(RUNS[0] + RUNS[1])
    start, length = torch.tensor([0, 6, 0]), torch.tensor([6, 37, 6])
    q, k = torch.randn(T, HQ, D), torch.randn(T, HKV, D)
    v = torch.randn(T, HKV * D + 5)[:, : HKV * D].view(T, HKV, D)
    return q, k, v, kp, vp, prefix, start, length


def formula(q, keys, values) -> torch.Tensor:
    return causal_attention(*(t.transpose(0, 1)[None] for t in (q, keys, values)), D**-0.5)[0].transpose(0, 1)


@GROUPS
def test_rows_over_their_prefix_in_the_pool(kernel_run, HQ: int, HKV: int) -> None:
    q, k, v, kp, vp, prefix, start, length = rows(HQ, HKV)
    cu = torch.tensor(CU)
    o = rows_attention(q, k, v, kp, vp, prefix, start, length, cu, max_len=20)
    ref = reference_rows_attention(q, k, v, kp, vp, prefix, start, length, cu, max_len=20)
    for n in range(3):
        a, b = CU[n], CU[n + 1]
        idx = RUNS[ROW_RUNS[n]]
        keys, values = torch.cat([kp[idx], k[a:b]]), torch.cat([vp[idx], v[a:b]])
        assert torch.allclose(ref[a:b], formula(q[a:b], keys, values), atol=1e-6), n  # the reference is the formula
        assert (o[a:b] - ref[a:b]).abs().max() < kernel_run.tol, n


@GROUPS
def test_new_states_over_their_own_tokens_into_out(kernel_run, HQ: int, HKV: int) -> None:
    """New states: causal attention over their own tokens only, into a given output."""
    q, k, v, kp, vp, *_ = rows(HQ, HKV)
    cu = torch.tensor(CU)
    dst = torch.empty_like(q)
    o = rows_attention(q, k, v, kp, vp, None, None, None, cu, max_len=20, out=dst)
    assert o is dst
    ref = reference_rows_attention(q, k, v, kp, vp, None, None, None, cu, max_len=20)
    for n in range(3):
        a, b = CU[n], CU[n + 1]
        assert (o[a:b] - ref[a:b]).abs().max() < kernel_run.tol, n


@GROUPS
@pytest.mark.parametrize("has_prefix", [True, False], ids=["rows", "new-states"])
def test_rows_attention_in_one_segment_launches(kernel_run, monkeypatch, HQ: int, HKV: int, has_prefix: bool) -> None:
    """The same answers when every launch is split into one launch per segment (kernels.grid: CUDA caps the grid's
    second dimension at 65,535)."""
    q, k, v, kp, vp, prefix, start, length = rows(HQ, HKV)
    if not has_prefix:
        prefix = start = length = None
    cu = torch.tensor(CU)
    whole = rows_attention(q, k, v, kp, vp, prefix, start, length, cu, max_len=20)
    monkeypatch.setattr(grid, "MAX_GRID_Y", 1)
    assert torch.equal(whole, rows_attention(q, k, v, kp, vp, prefix, start, length, cu, max_len=20))


def test_long_new_state(kernel_run) -> None:
    """A new state long enough for query blocks past the first, whose keys before the block's first token are read
    without masks."""
    HQ, HKV, L = 4, 2, 150
    q, k, v = torch.randn(L, HQ, D), torch.randn(L, HKV, D), torch.randn(L, HKV, D)
    cu = torch.tensor([0, L])
    o = rows_attention(q, k, v, k, v, None, None, None, cu, max_len=L)
    ref = reference_rows_attention(q, k, v, k, v, None, None, None, cu, max_len=L)
    assert torch.allclose(ref, formula(q, k, v), atol=1e-6)
    assert (o - ref).abs().max() < kernel_run.tol


@pytest.fixture
def split_16(monkeypatch) -> None:
    """Prefixes over 16 keys split in parts of 16: the rows above (6 and 37 keys) take one part and three."""
    from kev_backend.gpu.kernels import attention

    monkeypatch.setattr(attention, "SPLIT_KEYS", 16)
    monkeypatch.setattr(attention, "SPLIT_ABOVE", 16)


@GROUPS
def test_a_split_prefix_answers_as_the_reference(kernel_run, split_16, HQ: int, HKV: int) -> None:
    """Prefixes over SPLIT_ABOVE read in parts of SPLIT_KEYS and merged: row 1's 37 keys in three parts of 16, rows 0
    and 2 (6 keys) in one."""
    q, k, v, kp, vp, prefix, start, length = rows(HQ, HKV)
    cu = torch.tensor(CU)
    o = rows_attention(q, k, v, kp, vp, prefix, start, length, cu, max_len=20, max_prefix=37)
    ref = reference_rows_attention(q, k, v, kp, vp, prefix, start, length, cu, max_len=20)
    assert (o - ref).abs().max() < kernel_run.tol


@GROUPS
def test_a_rows_bits_do_not_depend_on_the_launch(kernel_run, split_16, HQ: int, HKV: int) -> None:
    """A row's parts follow its own prefix alone: a short row gets the same bits from a split launch as from an
    unsplit one, and a long row the same bits alone as beside other rows."""
    q, k, v, kp, vp, prefix, start, length = rows(HQ, HKV)
    cu = torch.tensor(CU)
    split = rows_attention(q, k, v, kp, vp, prefix, start, length, cu, max_len=20, max_prefix=37)
    unsplit = rows_attention(q, k, v, kp, vp, prefix, start, length, cu, max_len=20)
    for a, b in ((CU[0], CU[1]), (CU[2], CU[3])):  # the 6-key rows: one part
        assert torch.equal(split[a:b], unsplit[a:b])
    a, b = CU[1], CU[2]  # the 37-key row alone
    alone = rows_attention(
        q[a:b].contiguous(),
        k[a:b].contiguous(),
        v[a:b],
        kp,
        vp,
        prefix,
        start[1:2],
        length[1:2],
        torch.tensor([0, b - a]),
        max_len=20,
        max_prefix=37,
    )
    assert torch.equal(alone, split[a:b])


@pytest.mark.gpu
def test_cudnn_attention_is_as_near_the_fp32_formula_as_ours() -> None:
    """A new state over CUDNN_ABOVE tokens with Kev's heads (16 query and 4 key/value heads of 256; v read in place
    from a wider projection): cuDNN's output is as near the fp32 formula as our kernel's (both round to bf16), and a
    state's output is the same bits alone as inside a longer pass."""
    torch.manual_seed(0)
    L, HQ, HKV, HD = CUDNN_ABOVE + 904, 16, 4, 256
    assert cudnn_attention_runs(torch.device("cuda"), HQ, HKV, HD, torch.bfloat16)
    q = torch.randn(L + 300, HQ, HD, device="cuda").bfloat16()
    k = torch.randn(L + 300, HKV, HD, device="cuda").bfloat16()
    v = torch.randn(L + 300, 3 * HKV * HD, device="cuda").bfloat16()[:, : HKV * HD].view(L + 300, HKV, HD)
    exact = reference_segment_attention(q[:L].float(), k[:L].float(), v[:L].float())
    out = torch.full((L + 300, HQ, HD), float("nan"), device="cuda", dtype=torch.bfloat16)
    cudnn_attention(q[:L], k[:L], v[:L], out[:L])
    ours = rows_attention(q[:L], k[:L], v[:L], k, k, None, None, None, torch.tensor([0, L], device="cuda"), L)
    error, ours_error = ((x.float() - exact).abs().max().item() for x in (out[:L], ours))
    print(f"cudnn_attention: max |error| {error:.2e}, ours {ours_error:.2e}")
    assert error <= max(1.5 * ours_error, 4e-3)
    assert not out[L:].isfinite().any()  # nothing written past the state
    again = torch.empty_like(q)
    cudnn_attention(q[100 : L + 100], k[100 : L + 100], v[100 : L + 100], again[100 : L + 100])
    cudnn_attention(q[:L], k[:L], v[:L], again[:L])
    assert torch.equal(again[:L], out[:L])


def test_cudnn_plan_lengths_take_the_smallest_state_of_each_class() -> None:
    """torch keys cuDNN's plans by lengths rounded up to powers of two (RAGGED_PLANS): one state length a class, from
    just over CUDNN_ABOVE to the limit, each the class's smallest."""
    assert CUDNN_ABOVE == 4096
    assert cudnn_plan_lengths(65_536) == [4097, 8193, 16385, 32769]
    assert cudnn_plan_lengths(8193) == [4097, 8193]
    assert cudnn_plan_lengths(4096) == []


def test_cudnn_attention_hands_torch_the_layout_keyed_by_length_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch keys cuDNN's plans by length class (RAGGED_PLANS, set by the fused path's start-up step on a GPU) only
    for q, k and v laid out [batch, tokens, heads, D] contiguous: cudnn_attention gives it that layout whatever the
    strides it gets (v read in place from a wider projection here), and writes the result into `out`."""
    import torch.nn.functional as F

    from kev_backend.gpu import process
    from kev_backend.gpu.kernels import attention

    monkeypatch.delenv(attention.RAGGED_PLANS, raising=False)
    process.configure(torch.device("cpu"))
    assert attention.RAGGED_PLANS not in os.environ  # a CPU pass makes none of CUDA's settings
    with monkeypatch.context() as patch:
        patch.setattr(torch.backends.cuda, "preferred_blas_library", lambda library: None)
        process.configure(torch.device("cuda"))
    assert os.environ[attention.RAGGED_PLANS] == "1"
    seen = []

    def sdpa(q, k, v, is_causal, enable_gqa):
        seen.extend(x.transpose(1, 2).is_contiguous() for x in (q, k, v))
        assert is_causal and enable_gqa and q.shape == (1, 4, 9, 8) and k.shape == v.shape == (1, 2, 9, 8)
        return q * 2

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    q, k = torch.randn(9, 4, 8), torch.randn(9, 2, 8)
    v = torch.randn(9, 3 * 2 * 8)[:, : 2 * 8].view(9, 2, 8)
    assert not v.is_contiguous()
    out = torch.zeros(9, 4, 8)
    attention.cudnn_attention(q, k, v, out)
    assert seen == [True, True, True]
    assert torch.equal(out, q * 2)
