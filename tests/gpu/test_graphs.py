"""The CUDA-graph buckets and their fixed input buffers, on a CPU: which passes get a bucket, and how a pass is padded
to it (empty segments and padding tokens pointing at the pool's scratch slot and page). The padded passes'
answers are checked against the reference in gpu/test_fused_cpu.py; replay against eager on the GPU."""

from __future__ import annotations

import torch

from kev_backend.gpu.graphs import (
    LONG_PREFIX_MAX,
    LONG_PREFIX_ROWS,
    MAX_PASS_STATES,
    Bucket,
    StaticInputs,
    all_buckets,
    smallest_bucket,
)
from kev_backend.gpu.kernels import attention
from kev_backend.gpu.passes import MIN_GEMM_ROWS, PassLayout


class ScratchPool:
    scratch_slot = 9
    scratch_token = 640


def layout(state_lengths: list[int], row_lengths: list[int], picks_per_row: int = 3) -> PassLayout:
    out = PassLayout()
    for i, n in enumerate(state_lengths):
        out.state_ids.extend([10 + i] * n)
        out.state_lengths.append(n)
        out.state_slots.append(i)
        out.state_kv_dst.extend(range(100 * i, 100 * i + n))
    for j, n in enumerate(row_lengths):
        start = len(out.row_ids)
        out.row_ids.extend([20 + j] * n)
        out.row_positions.extend(range(50, 50 + n))
        out.row_lengths.append(n)
        out.row_slots.append(j % max(1, len(state_lengths)))
        out.prefix_start.append(0)
        out.prefix_len.append(5)
        out.row_picks.extend(start + n - 1 - k for k in range(picks_per_row))
    out.prefix.extend(range(5))
    return out


def test_buckets_cover_every_size_with_enough_gemm_rows() -> None:
    buckets = all_buckets(4096)
    assert len(buckets) == len(set(buckets)) == 136
    assert all(MIN_GEMM_ROWS <= b.tokens <= 4096 for b in buckets)
    grown = buckets[111:]  # extensions with rows, smallest first, after the others
    assert all(b.ext_tokens and b.row_tokens and not b.state_tokens for b in grown) and grown[0].name == "e128r64"
    assert [b.tokens for b in grown] == sorted(b.tokens for b in grown) and Bucket(0, 192, ext_tokens=384) in grown
    long_prefix = [b for b in buckets if b.long_prefix]  # rows only, after the others but the extensions'
    assert buckets[105:111] == long_prefix and [b.row_tokens for b in long_prefix] == [*LONG_PREFIX_ROWS]
    assert all(b.state_tokens == 0 for b in long_prefix) and long_prefix[0].name == "s0r64p"
    assert Bucket(0, 64) in buckets and Bucket(64, 0) in buckets and Bucket(4096, 0) in buckets
    assert Bucket(64, 192) in buckets and Bucket(1024, 192) not in buckets
    # Long-state buckets of 128 or 256 row tokens come trimmed by a 128-token GEMM tile too, each before its twin.
    trimmed = [b for b in buckets if b.trim]
    assert len(trimmed) == 11 and all(b.state_tokens >= 1024 and b.row_tokens in (128, 256) for b in trimmed)
    t2688 = Bucket(2560, 256, 128)
    assert t2688.tokens == 2688 and t2688.row_start == 2432 and t2688.name == "s2560r256t2688"
    assert buckets.index(t2688) + 1 == buckets.index(Bucket(2560, 256))


def test_the_smallest_bucket_that_holds_the_pass() -> None:
    buckets = all_buckets(4096)

    def bucket_for(pass_layout: PassLayout) -> Bucket | None:
        return smallest_bucket(buckets, pass_layout, prefix_tokens=1000)

    assert bucket_for(layout([34], [39] * 6)) == Bucket(64, 256)  # Kev's short6 on a new state
    assert bucket_for(layout([], [39] * 6)) == Bucket(0, 256)  # the same state again
    # short6 as the bench's tokenizer splits it (185 row tokens): a 1.5x row step, 256 tokens in all rather than 320
    assert bucket_for(layout([33], [38, 52, 26, 19, 30, 20])) == Bucket(64, 192)
    assert bucket_for(layout([40] * 8, [30] * 6)) == Bucket(512, 256)  # 1.5x row steps only where rows fill the pass
    assert bucket_for(layout([34] * 9, [10])) == Bucket(512, 64)  # nine states: more than 64 // 8 segments
    assert bucket_for(layout([65], [10])) == Bucket(128, 64)  # a long new state
    long5 = layout([2200], [40] * 5)  # one padded to 2,560 state tokens, not 4,096, and trimmed: 2,688 in all
    assert smallest_bucket(buckets, long5, 1000) == Bucket(2560, 256, 128)
    fuller = layout([2500], [40] * 5)  # 2,700 tokens: one tile more
    assert smallest_bucket(buckets, fuller, 1000) == Bucket(2560, 256)
    many_long = layout([70] * 9, [10])  # nine long states need 9 × 128 tokens of capacity
    assert smallest_bucket(buckets, many_long, 1000) == Bucket(1536, 64)
    assert smallest_bucket(buckets, layout([], [65]), 1000) is None  # a long row: eager
    assert bucket_for(layout([], [10] * 2000)) is None  # beyond the largest bucket
    split = layout([], [39] * 6)  # rows only, on a banked state of more than one part: their parts in parallel
    split.prefix_len[0] = attention.FOLD_KEYS + 1
    assert smallest_bucket(buckets, split, 1 << 20) == Bucket(0, 256, long_prefix=True)
    split.prefix_len[0] = LONG_PREFIX_MAX + 1  # past the graphs' parts: eager
    assert smallest_bucket(buckets, split, 1 << 20) is None
    split.prefix_len[0] = attention.FOLD_KEYS  # one part: captured as any other
    assert smallest_bucket(buckets, split, 1 << 20) == Bucket(0, 256)
    many = layout([], [39] * 20)  # more rows than any long-prefix bucket holds: their parts in turn
    many.prefix_len[0] = attention.FOLD_KEYS + 1
    assert smallest_bucket(buckets, many, 1 << 20) == Bucket(0, 1024)
    with_new_state = layout([34], [39] * 6)  # a new state beside them: their parts in turn, in the pass's bucket
    with_new_state.prefix_len[0] = LONG_PREFIX_MAX
    assert smallest_bucket(buckets, with_new_state, 1 << 20) == Bucket(64, 256)
    # At most MAX_PASS_STATES (64) short new states in any bucket: long5's s2560 holds 64 short slots, not 320; a pass
    # with more short new states than a batch of requests can bring runs eagerly.
    assert Bucket(2560, 256).states == MAX_PASS_STATES == 64 and Bucket(256, 0).states == 32
    assert bucket_for(layout([8] * 64, [])) == Bucket(512, 0)
    assert bucket_for(layout([8] * 65, [])) is None
    too_long_prefix = layout([], [10])
    too_long_prefix.prefix.extend(range(1000))
    assert bucket_for(too_long_prefix) is None


def extension_layout(lengths: list[int], starts: list[int], row_lengths: list[int]) -> PassLayout:
    """Extensions (each continuing a point at `starts`, saving its own 64 tokens after it) and rows."""
    out = layout([], row_lengths)
    for i, (n, start) in enumerate(zip(lengths, starts)):
        out.ext_ids.extend([30 + i] * n)
        out.ext_lengths.append(n)
        out.ext_starts.append(start)
        out.ext_slots.append(4 + i)
        out.ext_kv_dst.extend(range(1000 * (i + 1) + start, 1000 * (i + 1) + start + n))
        out.ext_prefix.extend(range(1000 * (i + 1), 1000 * (i + 1) + start))
        out.ext_saves.append((64, 6 + i))
    return out


def test_extensions_take_the_extensions_buckets() -> None:
    """A turn (an extension of a few hundred tokens and its rows) takes an extensions' bucket, whatever its state's
    length; extensions beside a new state computed whole, of RECURRENT_MAX_LEN tokens or fewer, making a state of more
    than LONG_PREFIX_MAX tokens (a graph launches the parts of that many keys), or whose points' runs pass the prefix
    index run eagerly."""
    buckets = all_buckets(4096)
    turn = extension_layout([300], [2048], [31, 30, 33, 30, 31, 30])
    assert smallest_bucket(buckets, turn, 1 << 20) == Bucket(0, 192, ext_tokens=384)
    turn.prefix_len = [attention.FOLD_KEYS + 1] * 6  # rows on a long conversation: the same bucket
    assert smallest_bucket(buckets, turn, 1 << 20) == Bucket(0, 192, ext_tokens=384)
    three = extension_layout([300, 200, 90], [1024, 2048, 4096], [31] * 6)
    assert smallest_bucket(buckets, three, 1 << 20) == Bucket(0, 192, ext_tokens=1024)
    assert smallest_bucket(buckets, three, 7000) is None  # 7,168 prefix entries
    assert smallest_bucket(buckets, extension_layout([64], [1024], [31]), 1 << 20) is None
    longest = extension_layout([300], [LONG_PREFIX_MAX - 300], [31])
    assert smallest_bucket(buckets, longest, 1 << 20) == Bucket(0, 64, ext_tokens=384)
    longer = extension_layout([300], [LONG_PREFIX_MAX - 256], [31])
    assert smallest_bucket(buckets, longer, 1 << 20) is None
    beside = extension_layout([300], [2048], [31])
    beside.state_ids, beside.state_lengths, beside.state_slots, beside.state_kv_dst = [1] * 40, [40], [3], range(40)
    assert smallest_bucket(buckets, beside, 1 << 20) is None


def test_an_extensions_pass_pads_to_its_bucket() -> None:
    """The extensions' tokens from the pass's start at their positions after their points, their segments then empty
    ones on the scratch slot, each one's run of its point's K/V, the points they save (the last conv inputs before
    them), and the rows after the extensions' region, their attention split-capable."""
    bucket = Bucket(0, 128, ext_tokens=384)
    inputs = StaticInputs(Bucket(4096, 4096, ext_tokens=1024), prefix_tokens=1 << 14, device=torch.device("cpu"))
    inputs.fill(bucket, extension_layout([100, 150], [1024, 2048], [39, 12]), ScratchPool(), pad_id=1)
    p = inputs.pass_input(bucket)
    assert p.states is None and p.ids.shape == (512,) and p.rows.start == 384 and p.row_prefix_max == LONG_PREFIX_MAX
    assert p.extend_keys_max == LONG_PREFIX_MAX  # its states' attention: the parts of the longest state it takes
    assert p.ids[:100].eq(30).all() and p.ids[100:250].eq(31).all() and p.ids[250:384].eq(1).all()
    assert p.positions[:250].tolist() == list(range(1024, 1124)) + list(range(2048, 2198))
    assert p.ids[384:423].eq(20).all() and p.positions[384:423].tolist() == list(range(50, 89))
    (group,) = p.extends.groups
    assert (group.start, group.end, group.padded, group.short) == (0, 384, True, False) and bucket.extends == 6
    assert group.cu.tolist() == [0, 100, 250, 250, 250, 250, 250] and group.slots.tolist() == [4, 5, 9, 9, 9, 9]
    assert group.save_at.tolist() == [64, 64, 0, 0, 0, 0] and group.save_slots.tolist() == [6, 7, 9, 9, 9, 9]
    assert p.extend_kv_dst.tolist() == [*range(2024, 2124), *range(4048, 4198)] + [640] * 134
    assert p.extend_prefix_start.tolist() == [0, 1024, 0, 0, 0, 0] and p.extend_prefix_len.tolist()[:3] == [
        1024,
        2048,
        0,
    ]
    assert p.extend_prefix[:1024].tolist() == list(range(1000, 2024)) and p.extend_prefix[3071] == 2000 + 2047
    tokens, slots = p.point_windows
    assert tokens.tolist()[:2] == [[60, 61, 62, 63], [160, 161, 162, 163]] and slots.tolist() == [6, 7, 9, 9, 9, 9]


def test_padding_writes_only_scratch() -> None:
    bucket = Bucket(64, 128)
    inputs = StaticInputs(Bucket(4096, 4096), prefix_tokens=1000, device=torch.device("cpu"))
    pass_layout = layout([34, 5], [39, 12])
    inputs.fill(bucket, pass_layout, ScratchPool(), pad_id=1)
    p = inputs.pass_input(bucket)
    assert p.ids.shape == (192,) and p.ids[:34].eq(10).all() and p.ids[39:64].eq(1).all() and p.ids[64:103].eq(20).all()
    assert p.ids[115:].eq(1).all()
    assert p.states.cu.tolist() == [0, 34, 39] + [39] * (bucket.states - 2)  # empty segments at the end
    assert p.states.groups[0].slots.tolist() == [0, 1] + [9] * (bucket.states - 2)
    assert p.state_kv_dst.tolist() == list(range(34)) + list(range(100, 105)) + [640] * 25
    assert p.rows.start == 64 and p.rows.end == 192 and p.rows.cu.tolist()[:3] == [0, 39, 51]
    assert p.rows.groups[0].slots.tolist()[2:] == [9] * (bucket.rows - 2)
    assert p.row_prefix_len.tolist() == [5, 5] + [0] * (bucket.rows - 2)
    assert p.picks.tolist()[:6] == [64 + i for i in (38, 37, 36, 50, 49, 48)]
    assert p.positions[64:103].tolist() == list(range(50, 89)) and p.positions[39:64].eq(0).all()


def test_a_long_prefix_bucket_launches_the_rows_parts_in_parallel() -> None:
    """Every bucket's pass sizes the rows' attention for a LONG_PREFIX_MAX-token prefix (the parts of any row it may
    hold): a long-prefix bucket's reads them in parallel, every other rows bucket's folds them in turn."""
    inputs = StaticInputs(Bucket(4096, 4096), prefix_tokens=1000, device=torch.device("cpu"))
    split = inputs.pass_input(Bucket(0, 256, long_prefix=True))
    assert split.row_prefix_max == LONG_PREFIX_MAX and split.row_parts_parallel
    in_turn = inputs.pass_input(Bucket(64, 256))
    assert in_turn.row_prefix_max == LONG_PREFIX_MAX and not in_turn.row_parts_parallel


def test_long_and_short_new_states_share_the_state_region() -> None:
    """A padded pass with long new states: one kernel group over the whole region, the short states' slots first
    (Bucket.states of them, `short_segments`), then the long ones', offsets from the region's start, padding segments
    empty and on the scratch slot."""
    bucket = Bucket(2560, 64)
    inputs = StaticInputs(Bucket(4096, 4096), prefix_tokens=1000, device=torch.device("cpu"))
    inputs.fill(bucket, layout([34, 5, 100, 2000], [39]), ScratchPool(), pad_id=1)
    (both,) = inputs.pass_input(bucket).states.groups
    assert not both.short and both.padded and (both.start, both.end, both.max_len) == (0, 2560, 2560)
    assert both.short_segments == bucket.states == 64 and len(both.slots) == 64 + bucket.long_states == 84
    short_cu = [0, 34, 39] + [39] * (bucket.states - 2)
    assert both.cu.tolist() == short_cu + [139, 2139] + [2139] * 18
    assert both.slots.tolist() == [0, 1] + [9] * 62 + [2, 3] + [9] * 18
    p = inputs.pass_input(bucket)
    assert p.positions[39:139].tolist() == list(range(100)) and p.positions[2139:2560].eq(0).all()
    assert p.state_kv_dst.tolist()[139:141] == [300, 301] and p.state_kv_dst[2139:].eq(640).all()
    # A bucket too small for a long state: the short group alone.
    small = Bucket(64, 64)
    inputs.fill(small, layout([34, 5], [39]), ScratchPool(), pad_id=1)
    (group,) = inputs.pass_input(small).states.groups
    assert group.short and group.short_segments == 0 and group.cu.tolist() == [0, 34, 39] + [39] * 6


def test_a_trimmed_bucket_puts_the_rows_at_the_pass_end() -> None:
    """In a trimmed bucket the rows' region overlaps the states' padding, and the rows sit at the pass's end: their
    offsets count from the region's start, their picks from the pass's; the states' region keeps its capacity."""
    bucket = Bucket(2560, 256, 128)
    inputs = StaticInputs(Bucket(4096, 4096), prefix_tokens=1000, device=torch.device("cpu"))
    inputs.fill(bucket, layout([2400], [39, 12]), ScratchPool(), pad_id=1)
    p = inputs.pass_input(bucket)
    at = 2688 - 51  # the rows' first token
    assert p.ids.shape == (2688,) and p.ids[:2400].eq(10).all() and p.ids[2400:at].eq(1).all()
    assert p.ids[at : at + 39].eq(20).all() and p.ids[at + 39 :].eq(21).all()
    assert p.positions[at : at + 39].tolist() == list(range(50, 89)) and p.positions[2400:at].eq(0).all()
    assert (p.rows.start, p.rows.end) == (2432, 2688) and p.rows.cu.tolist()[:3] == [at - 2432, at - 2393, 256]
    assert p.rows.cu.tolist()[3:] == [256] * (bucket.rows - 2)
    assert p.picks.tolist()[:6] == [at + i for i in (38, 37, 36, 50, 49, 48)] and p.picks[6:].eq(2432).all()
    assert (p.states.start, p.states.end) == (0, 2560) and p.state_kv_dst.shape == (2560,)
    (states,) = p.states.groups  # the long state after the bucket's (empty) short slots
    assert states.cu.tolist()[bucket.states : bucket.states + 2] == [0, 2400]
