"""kernels.delta_rule (chunked_rows: the gated delta rule in chunks of CHUNK tokens) against its torch reference
(model.qwen35's fp32 chunked gated delta rule, segment by segment): in Triton's interpreter on a CPU, compiled on a
GPU (tests/conftest.py). In the interpreter the chain multiplies fp32 operands (exact), compiled bf16 ones
(delta_rule._bf16_chain: chosen by the tensors' device)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kev_backend.gpu.kernels.delta_rule import (
    chunked_rows,
    reference_rows,
    reference_segment_delta_rule,
)
from kev_backend.model.qwen35 import gated_delta_rule, l2_normalize

H, HV, K, V = 2, 4, 16, 32
NAN = float("nan")


def inputs(cu: list[int], pool_scale: float = 1.0, saturate: bool = False) -> SimpleNamespace:
    """Segments at offsets `cu`: q, k, v read in place from one projection, the gates' inputs a and b strided views
    (slices of it), and a pool of 6 states. Head 1 decays by g ≈ -14 a token, head 2 by g ≈ -100 (a chunk's decays
    underflow fp32 within a few tokens), the others mildly. `saturate`: a gate input in softplus's linear branch."""
    T = cu[-1]
    mixed = torch.randn(T, 2 * H * K + HV * V + 3)
    q = mixed[:, : H * K].view(T, H, K)
    k = mixed[:, H * K : 2 * H * K].view(T, H, K)
    v = mixed[:, 2 * H * K : 2 * H * K + HV * V].view(T, HV, V)
    gates = torch.randn(T, 2 * HV + 1)
    a_log, dt_bias = torch.randn(HV), torch.randn(HV)
    a_log[1], a_log[2] = 3.0, 4.6
    if saturate:
        gates[0, 0] = 30.0
    pool = torch.randn(6, HV, K, V) * pool_scale
    return SimpleNamespace(
        q=q, k=k, v=v, gates=gates, a=gates[:, :HV], b=gates[:, HV : 2 * HV], a_log=a_log, dt_bias=dt_bias, pool=pool
    )


def args(x: SimpleNamespace, pool: torch.Tensor | None = None) -> tuple:
    return (x.q, x.k, x.v, x.a, x.b, x.a_log, x.dt_bias, x.pool if pool is None else pool)


def close(got: torch.Tensor, ref: torch.Tensor, tol: float, what: object) -> None:
    assert (got - ref).abs().max() < tol, what


@pytest.mark.parametrize("from_zero", [False, True], ids=["from-a-state", "from-zero"])
def test_reference_is_the_engines_delta_rule(kernel_run, from_zero: bool) -> None:
    """The token-by-token reference answers as the reference engine's chunked fp32 form (model.qwen35)."""
    x = inputs([0, 70], saturate=True)
    g = -x.a_log.exp() * torch.nn.functional.softplus(x.a + x.dt_bias)
    beta = torch.sigmoid(x.b)
    h0 = None if from_zero else x.pool[1]
    o, final = reference_segment_delta_rule(x.q, x.k, x.v, g, beta, h0)
    rep = HV // H
    qq = l2_normalize(x.q.repeat_interleave(rep, 1).transpose(0, 1)[None]) * K**-0.5
    kk = l2_normalize(x.k.repeat_interleave(rep, 1).transpose(0, 1)[None])
    state = None if h0 is None else h0[None].clone()
    ref, ref_final = gated_delta_rule(qq, kk, x.v.transpose(0, 1)[None], g.T[None], beta.T[None], state)
    close(o, ref[0].transpose(0, 1), 1e-5, "outputs")
    close(final, ref_final[0], 1e-5, "final state")


# The chunked kernel: segments of any length (several chunks, a partial last one, a single token).
LONG_CU = [0, 37, 38, 108]


def test_chunked_rows_continue_states_in_place(kernel_run) -> None:
    x = inputs(LONG_CU, pool_scale=0.3)
    before = x.pool.clone()
    slots, cu = torch.tensor([4, 1, 4]), torch.tensor(LONG_CU)
    o = chunked_rows(*args(x), slots, cu)
    assert torch.equal(x.pool, before)
    ref = reference_rows(*args(x, before.clone()), slots, cu)
    for n in range(3):
        a, b = LONG_CU[n], LONG_CU[n + 1]
        close(o[a:b], ref[a:b], 10 * kernel_run.tol, n)


def test_chunked_rows_new_states_from_zero(kernel_run) -> None:
    x = inputs(LONG_CU, pool_scale=0.3, saturate=True)
    slots, cu = torch.tensor([2, 5, 0]), torch.tensor(LONG_CU)
    fresh, ref_states = torch.full((6, HV, K, V), NAN), torch.full((6, HV, K, V), NAN)
    o = chunked_rows(*args(x, fresh), slots, cu, new_states=True)
    ref = reference_rows(*args(x, ref_states), slots, cu, new_states=True)
    for n, slot in enumerate(slots.tolist()):
        a, b = LONG_CU[n], LONG_CU[n + 1]
        close(o[a:b], ref[a:b], 10 * kernel_run.tol, n)
        close(fresh[slot], ref_states[slot], 10 * kernel_run.tol, n)


# Many segments inside a wider input (tokens 0-4 and 77-107 in none; several in one 16-token tile; an empty one), as
# a captured pass's groups.
INNER_CU = [5, 8, 24, 41, 42, 42, 75, 77]


def test_chunked_rows_many_segments(kernel_run) -> None:
    """Rows from their states, several in one chunk's window, answer as the reference does."""
    x = inputs(LONG_CU, pool_scale=0.3)
    slots, cu = torch.tensor([0, 1, 2, 3, 4, 5, 0]), torch.tensor(INNER_CU)
    o = chunked_rows(*args(x), slots, cu)
    close(o[5:77], reference_rows(*args(x, x.pool.clone()), slots, cu)[5:77], 10 * kernel_run.tol, "reference")


def test_chunked_rows_many_new_states(kernel_run) -> None:
    """New states: the reference's outputs and end states; the empty segment's slot (4) is left alone."""
    x = inputs(LONG_CU, pool_scale=0.3)
    slots, cu = torch.arange(7), torch.tensor(INNER_CU)
    states, ref_states = torch.full((8, HV, K, V), NAN), torch.full((8, HV, K, V), NAN)
    o = chunked_rows(*args(x, states), slots, cu, new_states=True)
    written = [0, 1, 2, 3, 5, 6]
    assert states[4].isnan().all()
    ref = reference_rows(*args(x, ref_states), slots, cu, new_states=True)
    close(o[5:77], ref[5:77], 10 * kernel_run.tol, "outputs")
    close(states[written], ref_states[written], 10 * kernel_run.tol, "states")


# A captured pass's group ends in padding: empty segments on a scratch slot. With `padded` a few programs take the
# items in turn (here, on the CPU's one "SM", CHUNK_PER_SM programs for all of them) and answer exactly as a program
# per item does.
PADDED_CU = INNER_CU + [INNER_CU[-1]] * 9


def test_padded_rows_as_unpadded(kernel_run) -> None:
    x = inputs(LONG_CU, pool_scale=0.3)
    slots, cu = torch.tensor([0, 1, 2, 3, 4, 5, 0] + [5] * 9), torch.tensor(PADDED_CU)
    rows = [chunked_rows(*args(x), slots, cu, padded=padded)[5:77] for padded in (False, True)]
    assert torch.equal(*rows)  # tokens in no segment: not written


def padded_new_states(x: SimpleNamespace, **launch) -> torch.Tensor:
    """New states of the padded group: outputs and written states, flattened; the empty segments' slots (the
    padding's and one inside) checked untouched."""
    states = torch.full((9, HV, K, V), NAN)
    slots = torch.tensor([*range(7)] + [8] * 9)
    o = chunked_rows(*args(x, states), slots, torch.tensor(PADDED_CU), new_states=True, **launch)
    assert states[[4, 7, 8]].isnan().all()
    return torch.cat([o[5:77].flatten(), states[[0, 1, 2, 3, 5, 6]].flatten()])


def test_padded_new_states_as_unpadded(kernel_run) -> None:
    x = inputs(LONG_CU, pool_scale=0.3)
    padded = [padded_new_states(x, padded=padded) for padded in (False, True)]
    assert torch.equal(*padded)


@pytest.mark.parametrize("lead", [0, 2], ids=["lead-first", "lead-in-the-middle"])
def test_lead_apart_as_one_launch(kernel_run, lead: int) -> None:
    """A padded group of long new states with one segment on a launch of its own (`lead_apart`; here in order, no
    CUDA streams) answers as one launch does: its first, or one from the middle of the group (a captured pass's short
    and long new states in one group, its first long one apart), the segments before and after it in turn."""
    x = inputs(LONG_CU, pool_scale=0.3)
    apart = padded_new_states(x, padded=True, lead_apart=True, lead=lead)
    assert torch.equal(apart, padded_new_states(x, padded=True, lead_apart=False))


def test_a_state_continued_from_its_saved_point_is_the_state_whole(kernel_run) -> None:
    """New states saving their state after 32 and 64 tokens (save_at; 0: none), then states continuing those points
    (`extend`: from the copy in their slot) over their tokens after them: the same outputs and end states, bit for
    bit, as the states whole; the saved points are the reference's."""
    x = inputs([0, 80, 176], pool_scale=0.3)
    cu, slots = torch.tensor([0, 80, 176]), torch.tensor([0, 1])
    states = torch.full((6, HV, K, V), NAN)
    save_at, save_slots = torch.tensor([32, 64]), torch.tensor([2, 3])
    whole = chunked_rows(*args(x, states), slots, cu, new_states=True, save_at=save_at, save_slots=save_slots)
    ref_states = torch.full((6, HV, K, V), NAN)
    reference_rows(*args(x, ref_states), slots, cu, new_states=True, save_at=save_at, save_slots=save_slots)
    close(states[[2, 3]], ref_states[[2, 3]], 10 * kernel_run.tol, "points")
    states[[4, 5]] = states[[2, 3]]  # the points copied into the continuing states' slots
    after = [(32, 80), (144, 176)]  # each state's tokens after its point
    per_token = {name: torch.cat([getattr(x, name)[a:b] for a, b in after]) for name in ("q", "k", "v", "a", "b")}
    part = SimpleNamespace(**{**vars(x), **per_token})
    part_cu = torch.tensor([0, 48, 80])
    extended = chunked_rows(*args(part, states), torch.tensor([4, 5]), part_cu, new_states=True, extend=True)
    assert torch.equal(extended, torch.cat([whole[a:b] for a, b in after]))
    assert torch.equal(states[[4, 5]], states[[0, 1]])
