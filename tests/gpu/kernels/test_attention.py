"""kernels.attention.rows_attention and states_attention against their torch reference (model.qwen35's causal
attention, segment by segment): in Triton's interpreter on a CPU, compiled on a GPU (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kev_backend.gpu.kernels import attention, grid
from kev_backend.gpu.kernels.attention import reference_rows_attention, rows_attention, states_attention
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
    o = states_attention(q, k, v, kp, vp, None, None, None, cu, max_len=20, out=dst)
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
    attend = rows_attention if has_prefix else states_attention
    whole = attend(q, k, v, kp, vp, prefix, start, length, cu, max_len=20)
    monkeypatch.setattr(grid, "MAX_GRID_Y", 1)
    assert torch.equal(whole, attend(q, k, v, kp, vp, prefix, start, length, cu, max_len=20))


def test_long_new_state(kernel_run) -> None:
    """A new state long enough for query blocks past the first, whose keys before the block's first token are read
    without masks."""
    HQ, HKV, L = 4, 2, 150
    q, k, v = torch.randn(L, HQ, D), torch.randn(L, HKV, D), torch.randn(L, HKV, D)
    cu = torch.tensor([0, L])
    o = states_attention(q, k, v, k, v, None, None, None, cu, max_len=L)
    ref = reference_rows_attention(q, k, v, k, v, None, None, None, cu, max_len=L)
    assert torch.allclose(ref, formula(q, k, v), atol=1e-6)
    assert (o - ref).abs().max() < kernel_run.tol


@pytest.mark.parametrize(("HQ", "HKV"), [(4, 2), (6, 2), (2, 2)], ids=["gqa2", "gqa3", "mha"])
def test_a_state_continued_from_a_point_attends_as_the_state_whole(request, kernel_run, HQ: int, HKV: int) -> None:
    """A new state's tokens after a point (128: a multiple of the key blocks) attending over the point's tokens' K/V
    in the pool, then their own, give the same bits as the state attending over its own tokens whole: the same key
    blocks in the same order, in the same long tiles (its rows attend to more than LONG_ABOVE keys either way), or
    without GQA in rows' tiles, which start at a page boundary where the state whole has 128-token ones."""
    if HQ == HKV:
        request.getfixturevalue("one_tile_size")  # interpreted, bits compared across tile sizes compare BLAS kernels
    L, point = 200, 128
    q, k, v = torch.randn(L, HQ, D), torch.randn(L, HKV, D), torch.randn(L, HKV, D)
    kp, vp = torch.zeros(POOL + L, HKV, D), torch.zeros(POOL + L, HKV, D)
    kp[POOL - point : POOL], vp[POOL - point : POOL] = k[:point], v[:point]  # where the bank keeps them
    whole = states_attention(q, k, v, kp, vp, None, None, None, torch.tensor([0, L]), max_len=L)
    prefix = torch.arange(POOL - point, POOL)
    tail = slice(point, L)
    start, length, cu = torch.tensor([0]), torch.tensor([point]), torch.tensor([0, L - point])
    grown = states_attention(q[tail], k[tail], v[tail], kp, vp, prefix, start, length, cu, L - point, max_keys=L)
    assert torch.equal(grown, whole[tail])


@pytest.fixture
def fold_16(monkeypatch) -> None:
    """Rows' prefixes in parts of 16 keys: the rows above (6 and 37 keys) take one part and three."""
    monkeypatch.setattr(attention, "FOLD_KEYS", 16)


@GROUPS
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "in_turn"])
def test_a_rows_parts_answer_as_the_reference(kernel_run, fold_16, HQ: int, HKV: int, parallel: bool) -> None:
    """A row's prefix over FOLD_KEYS keys is read in parts, in parallel and merged or folded in turn: row 1's 37 keys
    in three parts of 16, rows 0 and 2 (6 keys) in one."""
    q, k, v, kp, vp, prefix, start, length = rows(HQ, HKV)
    cu = torch.tensor(CU)
    o = rows_attention(q, k, v, kp, vp, prefix, start, length, cu, max_len=20, max_prefix=37, parallel=parallel)
    ref = reference_rows_attention(q, k, v, kp, vp, prefix, start, length, cu, max_len=20)
    assert (o - ref).abs().max() < kernel_run.tol


@GROUPS
def test_a_rows_bits_do_not_depend_on_the_launch(kernel_run, fold_16, HQ: int, HKV: int) -> None:
    """A row's parts follow its own prefix alone: every row gets the same bits with its parts in parallel as folded
    in turn, a long row the same alone as beside other rows, and a row of one part the same as from a launch that
    never folds."""
    q, k, v, kp, vp, prefix, start, length = rows(HQ, HKV)
    cu = torch.tensor(CU)
    split = rows_attention(q, k, v, kp, vp, prefix, start, length, cu, max_len=20, max_prefix=37)
    in_turn = rows_attention(q, k, v, kp, vp, prefix, start, length, cu, max_len=20, max_prefix=37, parallel=False)
    assert torch.equal(split, in_turn)
    plain = rows_attention(q, k, v, kp, vp, prefix, start, length, cu, max_len=20)
    for a, b in ((CU[0], CU[1]), (CU[2], CU[3])):  # the 6-key rows: one part
        assert torch.equal(split[a:b], plain[a:b])
    a, b = CU[1], CU[2]  # the 37-key row alone
    for parallel in (True, False):
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
            max_prefix=64,  # a bound over its own: a graph's
            parallel=parallel,
        )
        assert torch.equal(alone, split[a:b])


@pytest.fixture(params=[64, 128], ids=["fold64", "fold128"])
def fold_keys(request, monkeypatch) -> None:
    """States' keys in parts of 64 (one key block: a 300-token state has five) or 128 (a point at 64 tokens then
    ends inside a part)."""
    monkeypatch.setattr(attention, "FOLD_KEYS", request.param)


def grown_state(HQ: int, HKV: int, L: int, points: list[int]):
    """A state of L tokens, its K/V also where the bank keeps them, and its tokens' runs after each of `points`
    (multiples of 64, as pages are) as one launch of states continuing them: (q, k, v, pool K, pool V, prefix,
    starts, lengths, cu of the continuations, their tokens' index in the state)."""
    q, k, v = torch.randn(L, HQ, D), torch.randn(L, HKV, D), torch.randn(L, HKV, D)
    kp, vp = torch.zeros(POOL + L, HKV, D), torch.zeros(POOL + L, HKV, D)
    kp[POOL : POOL + L], vp[POOL : POOL + L] = k, v
    index = torch.cat([torch.arange(POOL, POOL + p) for p in points])
    starts = torch.tensor([0, *points[:-1]]).cumsum(0)
    tokens = torch.cat([torch.arange(p, L) for p in points])
    cu = torch.tensor([0, *[L - p for p in points]]).cumsum(0)
    return q, k, v, kp, vp, index, starts, torch.tensor(points), cu, tokens


@GROUPS
def test_a_long_state_folds_its_parts_and_answers_as_the_reference(kernel_run, fold_keys, HQ: int, HKV: int) -> None:
    """A new state over FOLD_KEYS keys: its rows past the first part fold their parts in turn (five here)."""
    L = 300
    q, k, v = torch.randn(L, HQ, D), torch.randn(L, HKV, D), torch.randn(L, HKV, D)
    cu = torch.tensor([0, L])
    o = states_attention(q, k, v, k, v, None, None, None, cu, max_len=L)
    assert (o - formula(q, k, v)).abs().max() < kernel_run.tol


@GROUPS
@pytest.mark.parametrize("parallel", [True, False], ids=["parts-in-parallel", "parts-in-turn"])
def test_a_state_continued_from_any_point_gets_the_whole_states_bits(
    kernel_run, fold_keys, monkeypatch, HQ: int, HKV: int, parallel: bool
) -> None:
    """A 300-token state continued from points at 64, 128 and 256 tokens (one launch): each continuation's tokens
    get the bits of the state computed whole, which folds its five parts in turn, whether the continuations read
    their parts a program each and merge them (a turn) or fold them in turn (a launch over PARALLEL_PARTS_ENTRIES),
    and with the parts of a longer point than any of theirs (a graph's)."""
    if not parallel:
        monkeypatch.setattr(attention, "PARALLEL_PARTS_ENTRIES", 0)
    L, points = 300, [64, 128, 256]
    q, k, v, kp, vp, index, starts, lengths, cu, tokens = grown_state(HQ, HKV, L, points)
    whole = states_attention(q, k, v, kp, vp, None, None, None, torch.tensor([0, L]), max_len=L)
    grown = states_attention(
        q[tokens], k[tokens], v[tokens], kp, vp, index, starts, lengths, cu, max_len=L - 64, max_keys=L
    )
    assert torch.equal(grown, whole[tokens])
    graph = states_attention(
        q[tokens], k[tokens], v[tokens], kp, vp, index, starts, lengths, cu, max_len=L - 64, max_keys=4096
    )
    assert torch.equal(graph, whole[tokens])


@GROUPS
def test_a_short_states_bits_do_not_depend_on_a_long_one_beside_it(
    kernel_run, one_tile_size, fold_keys, HQ: int, HKV: int
) -> None:
    """A state of FOLD_KEYS tokens or fewer never folds: the same bits alone as in a launch that folds a long one."""
    short, long = 60, 200
    q, k, v = torch.randn(short + long, HQ, D), torch.randn(short + long, HKV, D), torch.randn(short + long, HKV, D)
    both = states_attention(q, k, v, k, v, None, None, None, torch.tensor([0, short, short + long]), max_len=long)
    alone = states_attention(
        q[:short].contiguous(), k[:short].contiguous(), v[:short], k, v, None, None, None, torch.tensor([0, short]), 60
    )
    assert torch.equal(both[:short], alone)
