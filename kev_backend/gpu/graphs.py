"""CUDA graphs of the fused pass: one per bucket of pass shapes, replayed with the pass's indices in fixed buffers.

A pass is padded to a bucket: its new states' tokens to one size of STATE_BUCKETS (or none), or its extensions' (new
states continuing a point) to one of EXT_BUCKETS, its rows' tokens to one of ROW_BUCKETS. Segment, pick and prefix
capacities follow from the bucket, so the bucket alone fixes every shape and grid. Rows must all be short (at most
RECURRENT_MAX_LEN tokens). New states may be long too: the conv and the chunked delta rule find segments by binary
search on the device (kernels/segments.py), with no host-built chunk maps.

In a graph the short and the long new states form one kernel group over the whole state region, short segments
first (Bucket.states of them), then long, with offsets counted from the region's start (as in an eager pass): two
groups would run one class's conv and delta-rule prep over empty segments every DeltaNet layer whenever a pass has
new states of the other class only. Attention still runs per class (KernelGroup.short_segments), and the chain
takes the first long segment in a launch of its own beside the others (chunked_rows' `lead_apart`).

Padding segments are empty and write to the pool's scratch slot and page; padding tokens belong to no segment;
padding picks are never read. Every kernel gives a row numbers that depend on that row alone (the GEMMs on cuBLASLt
algorithms without split-K, at least 64 rows either way), so a replayed pass answers exactly like an eager one. All
graphs share one memory pool (they never run at once); the LRU keeps at most `max_graphs`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..scoring.transfer import aligned_size
from .fused import FusedQwen35
from .kernels import attention
from .passes import (
    CONV_WINDOW,
    MIN_GEMM_ROWS,
    RECURRENT_MAX_LEN,
    KernelGroup,
    PassInput,
    PassLayout,
    Segments,
    is_short,
    offsets,
)
from .pool import StatePool

# Row tokens by powers of two, with 1.5x steps where rows fill most of the pass (ROW_STEPS, only with a state
# region no larger than the rows); state tokens finer above 1,024, where one long state fills a pass and padding it
# costs GEMM rows (2,200 tokens pad to 2,560, not 4,096). Why the 1.5x steps: cuBLASLt's GEMMs run in 64-row tiles
# and their time follows the padded total. One short6 request (a 33-token state and 185 row tokens) would take
# s64r256, 320 tokens; s64r192 is 256 (docs/kernels.md).
ROW_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
ROW_STEPS = (192, 384, 768, 1536, 3072, 6144)
STATE_BUCKETS = (64, 128, 256, 512, 1024, 1536, 2048, 2560, 3072, 4096, 6144, 8192)
# A bucket whose projections alone come to more than EAGER_ABOVE_FLOPS (FusedWeights.projection_flops × its tokens)
# is not captured: such a pass runs eagerly. Its GPU time (over ~120 ms at the bf16 rate) hides every launch of an
# eager pass (Kev-27B's 64 layers: ~1,200 launches in ~35 ms of host time), while a bucket's padding tokens cost GPU
# time: Kev-27B's long5 (2,630 tokens, ~128 TFLOP) took 225 ms eagerly against 232 ms from its 2,688-token bucket
# (docs/kernels.md). Kev-9B's largest bucket is ~57 TFLOP, so only Kev-27B's buckets over ~2,050 tokens go.
EAGER_ABOVE_FLOPS = 100e12
# Fewest tokens per segment assumed when sizing a bucket's segment capacities; a pass with more (shorter) segments
# than that takes a larger bucket. Long states (over RECURRENT_MAX_LEN) get their own, smaller capacity: each of
# their kernels' grids grows with it.
MIN_STATE_TOKENS = 8
MIN_ROW_TOKENS = 4
MIN_LONG_STATE_TOKENS = 128
# At most this many short new states in any bucket: a request brings one state, and Triton's batches hold at most
# max_batch_size (64) requests. Every kernel of the short group runs programs for its padding segments too: without
# the cap s2560 (long5's bucket) would hold 320 empty short slots, tens of thousands of delta-rule programs per layer
# for nothing. A pass with more short new states runs eagerly.
MAX_PASS_STATES = 64
# Trimmed buckets: a long-state bucket of 128 or more row tokens also comes TRIM tokens shorter, its rows ending at
# the pass's end (right after the new states' tokens when the two regions' paddings add up to TRIM or more). Why:
# cuBLASLt's kernels at these sizes tile the tokens by 128 (nvjet 256x128, 144x128, 320x128 on the H200), and the two
# regions' paddings can hold a whole tile: long5 (2,465 + 166 tokens) padded to s2560r256 is 2,816 tokens, 22 tiles,
# where its 2,631 need 21.
TRIM = 128
TRIMMED_FROM_STATES = 1024
# Every bucket's rows attend to states of up to LONG_PREFIX_MAX tokens, their parts (kernels.attention.FOLD_KEYS)
# folded in turn; passes of rows only over a state of more than FOLD_KEYS tokens (same-state requests on long
# documents) take buckets of their own where they fit one (LONG_PREFIX_ROWS), whose rows read their parts in parallel,
# launched with the parts of a LONG_PREFIX_MAX-token prefix (a row's programs past its own parts return). Either way
# a row's answer is the eager pass's, bit for bit. Why: a lone question over a 32k-token state walked its keys in a
# few dozen programs, the GPU mostly idle; an eager pass of rows is ~385 launches, bound by their host time
# (docs/kernels.md). Rows over longer states run eagerly.
LONG_PREFIX_ROWS = (64, 128, 192, 256, 384, 512)
LONG_PREFIX_MAX = 65_536  # Kev's state limit
# The prefix index a graph's pass holds: the K/V pages of the states its rows continue (1 MB of int64); the same again
# for the points its extensions continue.
PREFIX_TOKENS = 2 * LONG_PREFIX_MAX
# Passes of new states continuing a point (extensions: a conversation's next turn) with their rows: extension tokens
# by EXT_BUCKETS, rows by EXT_ROW_BUCKETS, no new state computed whole beside them. A turn adding up to ~250 tokens
# computes 16-80 more after its point and asks a few questions (six: ~190 row tokens), so one turn takes e384r192;
# a few together the larger ones. Their rows' attention is the split launch (the long-prefix buckets'), whose rows of
# one part end as the unsplit kernel does: one set of buckets for conversations of any length. Extensions of
# RECURRENT_MAX_LEN tokens or fewer (a turn adding a few words) and larger passes run eagerly.
EXT_BUCKETS = (128, 256, 384, 512, 1024)
EXT_ROW_BUCKETS = (64, 128, 192, 256, 512)

log = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class Bucket:
    state_tokens: int  # 0: a pass of rows only
    row_tokens: int  # 0: a pass of new states only
    # Tokens cut from the pass's end (TRIM, or 0): the rows' region [tokens − row_tokens, tokens) then overlaps the
    # states' [0, state_tokens), and the rows sit at its end, after the new states' tokens (`fits` checks the total).
    trim: int = 0
    long_prefix: bool = False  # rows only, over states of more than FOLD_KEYS tokens (LONG_PREFIX_ROWS)
    ext_tokens: int = 0  # extensions' tokens (EXT_BUCKETS), after the new states' region; 0: none

    @property
    def tokens(self) -> int:
        return self.state_tokens + self.ext_tokens + self.row_tokens - self.trim

    @property
    def row_start(self) -> int:
        """Where the rows' region starts in the pass."""
        return self.tokens - self.row_tokens

    @property
    def states(self) -> int:
        return min(self.state_tokens // MIN_STATE_TOKENS, MAX_PASS_STATES)

    @property
    def long_states(self) -> int:
        return self.state_tokens // MIN_LONG_STATE_TOKENS

    @property
    def extends(self) -> int:
        """Extension capacity: each is longer than RECURRENT_MAX_LEN."""
        return self.ext_tokens // RECURRENT_MAX_LEN

    @property
    def split_rows(self) -> bool:
        """Whether the rows read their parts in parallel (passes.PassInput.row_parts_parallel), not in turn."""
        return self.long_prefix or self.ext_tokens > 0

    @property
    def rows(self) -> int:
        return self.row_tokens // MIN_ROW_TOKENS

    @property
    def picks(self) -> int:
        return self.row_tokens // 2  # a row is ≥ 2 tokens per pick (<decide> and each option's </opt>)

    def fits(self, layout: PassLayout, long_states: int) -> bool:
        """Whether the pass fits; `long_states`: how many of its new states are long (counted once by the caller)."""
        return (
            len(layout.state_ids) <= self.state_tokens
            and len(layout.state_lengths) - long_states <= self.states
            and long_states <= self.long_states
            and len(layout.row_ids) <= self.row_tokens
            and len(layout.row_lengths) <= self.rows
            and len(layout.row_picks) <= self.picks
            and len(layout.ext_ids) <= self.ext_tokens
            and len(layout.ext_lengths) <= self.extends
            and len(layout.state_ids) + len(layout.ext_ids) + len(layout.row_ids) <= self.tokens
        )

    def rows_at(self, row_tokens: int) -> int:
        """Where a pass's rows (row_tokens of them) start: the rows' region's start, or in a trimmed bucket at the
        pass's end (the region then starts inside the states' padding)."""
        return self.tokens - row_tokens if self.trim else self.state_tokens + self.ext_tokens

    @property
    def name(self) -> str:
        return (
            (f"e{self.ext_tokens}" if self.ext_tokens else f"s{self.state_tokens}")
            + f"r{self.row_tokens}"
            + (f"t{self.tokens}" if self.trim else "")
            + ("p" if self.long_prefix else "")
        )


def all_buckets(max_tokens: int) -> list[Bucket]:
    """Every bucket up to `max_tokens` tokens, smallest first (136 up to 4,096, 179 up to 8,192): a trimmed one (TRIM)
    before its untrimmed twin, then the long-prefix ones (6), then the extensions' (25), smallest first. Each has at
    least MIN_GEMM_ROWS tokens."""
    shapes = [(s, r) for s in (0, *STATE_BUCKETS) for r in (0, *ROW_BUCKETS)]
    shapes += [(s, r) for s in (0, *STATE_BUCKETS) for r in ROW_STEPS if s <= r]
    buckets = [Bucket(s, r) for s, r in shapes if 0 < s + r <= max_tokens]
    trimmed = [Bucket(s, r, TRIM) for s, r in shapes if s >= TRIMMED_FROM_STATES and TRIM <= r <= 2 * TRIM]
    buckets += [b for b in trimmed if b.tokens <= max_tokens]  # (at the top, without its twin)
    buckets.sort(key=lambda b: (b.state_tokens, b.row_tokens, -b.trim))
    buckets += [Bucket(0, r, long_prefix=True) for r in LONG_PREFIX_ROWS if r <= max_tokens]
    grown = [Bucket(0, r, ext_tokens=e) for e in EXT_BUCKETS for r in EXT_ROW_BUCKETS if e + r <= max_tokens]
    buckets += sorted(grown, key=lambda b: (b.tokens, b.ext_tokens))
    assert all(b.tokens >= MIN_GEMM_ROWS for b in buckets)
    return buckets


def smallest_bucket(buckets: list[Bucket], layout: PassLayout, prefix_tokens: int) -> Bucket | None:
    """The smallest of `buckets` (sorted) that holds the pass, or None: a long row, a prefix index over
    `prefix_tokens`, a row over a state of more than LONG_PREFIX_MAX tokens, extensions with new states computed
    whole, of RECURRENT_MAX_LEN tokens or fewer or making a state of more than LONG_PREFIX_MAX, or too large for any
    (the pass runs eagerly). Rows only over a state of more than FOLD_KEYS tokens take a long-prefix bucket where
    one holds them; extensions an extensions' bucket."""
    if not all(is_short(n) for n in layout.row_lengths) or len(layout.prefix) > prefix_tokens:
        return None
    longest = max(layout.prefix_len, default=0)
    if longest > LONG_PREFIX_MAX:
        return None
    if layout.ext_lengths:
        if (
            layout.state_lengths
            or any(is_short(n) for n in layout.ext_lengths)
            or max(map(sum, zip(layout.ext_starts, layout.ext_lengths))) > LONG_PREFIX_MAX
            or len(layout.ext_prefix) > prefix_tokens
        ):
            return None
        return next((b for b in buckets if b.ext_tokens and b.fits(layout, 0)), None)
    if longest > attention.FOLD_KEYS and not layout.state_lengths:
        bucket = next((b for b in buckets if b.long_prefix and b.fits(layout, 0)), None)
        if bucket is not None:
            return bucket
    long = sum(not is_short(n) for n in layout.state_lengths)
    return next((b for b in buckets if not b.ext_tokens and not b.long_prefix and b.fits(layout, long)), None)


class StaticInputs:
    """Device buffers at fixed addresses for every bucket's inputs (views of one int64 tensor, sized for the
    largest bucket), filled from one pinned host tensor by one copy per pass."""

    def __init__(self, largest: Bucket, prefix_tokens: int, device: torch.device) -> None:
        sizes = {
            "ids": largest.tokens,
            "positions": largest.tokens,
            # the short states' segments, then the long ones' (a bucket's capacities: Bucket.states, .long_states)
            "state_cu": largest.states + largest.long_states + 1,
            "state_slots": largest.states + largest.long_states,
            "state_kv_dst": largest.state_tokens,
            # the points the long new states save (passes.PassInput.point_windows; short ones keep none)
            "state_save_at": largest.states + largest.long_states,
            "state_save_slots": largest.states + largest.long_states,
            "point_tokens": CONV_WINDOW * largest.long_states,
            "point_slots": largest.long_states,
            "row_cu": largest.rows + 1,
            "row_slots": largest.rows,
            "prefix_start": largest.rows,
            "prefix_len": largest.rows,
            "picks": largest.picks,
            "prefix": prefix_tokens,
            # the extensions' (a bucket's capacity: Bucket.extends), as the new states' and rows' fields
            "ext_cu": largest.extends + 1,
            "ext_slots": largest.extends,
            "ext_kv_dst": largest.ext_tokens,
            "ext_prefix": prefix_tokens,
            "ext_prefix_start": largest.extends,
            "ext_prefix_len": largest.extends,
            "ext_save_at": largest.extends,
            "ext_save_slots": largest.extends,
            "ext_point_tokens": CONV_WINDOW * largest.extends,
            "ext_point_slots": largest.extends,
        }
        self.offsets: dict[str, tuple[int, int]] = {}
        total = 0
        for name, n in sizes.items():  # each starting on 16 bytes (transfer.ALIGNED_INTS)
            self.offsets[name] = (total, max(n, 1))
            total += aligned_size(max(n, 1))
        self.device = device
        self.prefix_tokens = prefix_tokens
        self.flat = torch.zeros(total, dtype=torch.int64, device=device)
        # Two host buffers, used in turn: filling one waits only for the copy out of it two passes back, which has run
        # unless the model thread is two batches ahead of the GPU.
        self.hosts = [torch.zeros(total, dtype=torch.int64, pin_memory=device.type == "cuda") for _ in range(2)]
        self.arrays = [host.numpy() for host in self.hosts]  # the same memory
        # Each buffer's last host→device copy (events made once, recorded once here so that waiting on them is valid
        # from the start: creating an event per pass would cost host time on the request path).
        self.copied = [torch.cuda.Event() for _ in range(2)] if device.type == "cuda" else [None, None]
        for event in self.copied:
            if event is not None:
                event.record()
        self.turn = 0

    def view(self, name: str, n: int) -> torch.Tensor:
        """A field's first n entries."""
        start, size = self.offsets[name]
        assert n <= size
        return self.flat[start : start + n]

    def pass_input(self, bucket: Bucket) -> PassInput:
        """The bucket's PassInput: views of the buffers, every shape fixed by the bucket. The state region holds the
        long new states too (capacity bucket.long_states, each up to the whole region), in one group with the short
        ones, short segments first (the module's doc)."""
        s, r = bucket.state_tokens, bucket.row_tokens

        def group(
            start: int, tokens: int, cu: str, slots: str, n: int, short: bool, short_segments: int = 0
        ) -> KernelGroup:
            return KernelGroup(
                short=short,
                start=start,
                end=start + tokens,
                max_len=RECURRENT_MAX_LEN if short else tokens,
                cu=self.view(cu, n + 1),
                slots=self.view(slots, n),
                padded=True,
                short_segments=short_segments,
            )

        states = None
        windows = None
        if s:
            n_short, n_long = bucket.states, bucket.long_states
            if n_long:  # the long states' segments follow the short ones' in the same buffers
                region = group(0, s, "state_cu", "state_slots", n_short + n_long, short=False, short_segments=n_short)
                # the points long states save (short ones keep none: their entries say 0)
                region.save_at = self.view("state_save_at", n_short + n_long)
                region.save_slots = self.view("state_save_slots", n_short + n_long)
                tokens = self.view("point_tokens", CONV_WINDOW * n_long).view(n_long, CONV_WINDOW)
                windows = (tokens, self.view("point_slots", n_long))
            else:
                region = group(0, s, "state_cu", "state_slots", n_short, short=True)
            states = Segments(0, s, s, region.cu, [region])  # `cu` of a region is read for rows only
        extends = None
        if e := bucket.ext_tokens:  # one group of long extensions (smallest_bucket), after any new states
            n = bucket.extends
            ext = group(s, e, "ext_cu", "ext_slots", n, short=False)
            ext.save_at, ext.save_slots = self.view("ext_save_at", n), self.view("ext_save_slots", n)
            extends = Segments(s, s + e, e, ext.cu, [ext])
            tokens = self.view("ext_point_tokens", CONV_WINDOW * n).view(n, CONV_WINDOW)
            windows = (tokens, self.view("ext_point_slots", n))
        rows = None
        if r:
            row_group = group(bucket.row_start, r, "row_cu", "row_slots", bucket.rows, short=True)
            rows = Segments(bucket.row_start, bucket.tokens, RECURRENT_MAX_LEN, row_group.cu, [row_group])
        return PassInput(
            ids=self.view("ids", bucket.tokens),
            positions=self.view("positions", bucket.tokens),
            states=states,
            state_kv_dst=self.view("state_kv_dst", s) if s else None,
            rows=rows,
            row_prefix=self.view("prefix", self.prefix_tokens),
            row_prefix_start=self.view("prefix_start", bucket.rows),
            row_prefix_len=self.view("prefix_len", bucket.rows),
            picks=self.view("picks", bucket.picks),
            row_prefix_max=LONG_PREFIX_MAX,
            row_parts_parallel=bucket.split_rows,
            point_windows=windows,
            extends=extends,
            extend_kv_dst=self.view("ext_kv_dst", e) if e else None,
            extend_prefix=self.view("ext_prefix", self.prefix_tokens) if e else None,
            extend_prefix_start=self.view("ext_prefix_start", bucket.extends) if e else None,
            extend_prefix_len=self.view("ext_prefix_len", bucket.extends) if e else None,
            extend_keys_max=LONG_PREFIX_MAX if e else 0,
        )

    def fill(self, bucket: Bucket, layout: PassLayout, pool: StatePool, pad_id: int) -> None:
        """Writes the layout, padded to the bucket, into the buffers: one copy to the device. numpy writes each list
        into the pinned buffer in place and each run of padding as one value (a tensor and a copy per field cost
        ~10x more host time, and padded lists ~2x: all of it before the replay can start)."""
        self.turn ^= 1
        if (copied := self.copied[self.turn]) is not None:
            copied.synchronize()  # the copy out of this host buffer has read it
        host = self.arrays[self.turn]
        end = 0

        def put(name: str, values, n: int, pad: int, at: int = 0) -> None:
            """values at the field's position `at`, then `pad` up to its n-th place (nothing past n)."""
            nonlocal end
            start, size = self.offsets[name]
            filled = at + len(values)
            assert filled <= n <= size
            host[start + at : start + filled] = values
            host[start + filled : start + n] = pad
            if n:
                end = max(end, start + n)

        s = bucket.state_tokens
        at = bucket.rows_at(len(layout.row_ids))  # the rows' first token in the pass
        if bucket.ext_tokens:  # extensions and rows only (smallest_bucket): the extensions' tokens first
            positions = [np.arange(a, a + n, dtype=np.int64) for a, n in zip(layout.ext_starts, layout.ext_lengths)]
            put("ids", layout.ext_ids, at, pad_id)
            put("positions", np.concatenate(positions) if positions else [], at, 0)
        else:
            put("ids", layout.state_ids, at, pad_id)
            put("positions", layout.state_positions(), at, 0)
        put("ids", layout.row_ids, bucket.tokens, pad_id, at=at)
        put("positions", layout.row_positions, bucket.tokens, 0, at=at)
        # Short new states first, then long ones (as the scorer orders them); both groups count from the region's start.
        n_short = sum(is_short(n) for n in layout.state_lengths)
        short, long = layout.state_lengths[:n_short], layout.state_lengths[n_short:]
        assert all(is_short(n) for n in short) and not any(is_short(n) for n in long)
        # Each class's segments end in empty ones (its padding), the long states' after the short states' capacity.
        cu = offsets(short)
        put("state_cu", cu, bucket.states + 1, cu[-1])
        put("state_slots", layout.state_slots[:n_short], bucket.states, pool.scratch_slot)
        capacity = bucket.states + bucket.long_states
        cu = offsets(long, start=cu[-1])
        put("state_cu", cu[1:], capacity + 1, cu[-1], at=bucket.states + 1)
        put("state_slots", layout.state_slots[n_short:], capacity, pool.scratch_slot, at=bucket.states)
        put("state_kv_dst", layout.state_kv_dst, s, pool.scratch_token)
        if bucket.long_states:  # the points long states save; every other entry saves none
            saves = layout.state_saves[n_short:]
            put("state_save_at", [], bucket.states, 0)
            put("state_save_at", [save for save, _ in saves], capacity, 0, at=bucket.states)
            put("state_save_slots", [], bucket.states, pool.scratch_slot)
            put("state_save_slots", [slot for _, slot in saves], capacity, pool.scratch_slot, at=bucket.states)
            tokens, slots = padded_windows(offsets(long, start=sum(short)), saves, pool.scratch_slot)
            put("point_tokens", tokens, CONV_WINDOW * bucket.long_states, 0)
            put("point_slots", slots, bucket.long_states, pool.scratch_slot)
        if n := bucket.extends:  # their segments padded with empty ones on the scratch slot, their points' runs
            cu = offsets(layout.ext_lengths)
            put("ext_cu", cu, n + 1, cu[-1])
            put("ext_slots", layout.ext_slots, n, pool.scratch_slot)
            put("ext_kv_dst", layout.ext_kv_dst, bucket.ext_tokens, pool.scratch_token)
            put("ext_prefix", layout.ext_prefix, len(layout.ext_prefix), 0)
            put("ext_prefix_start", offsets(layout.ext_starts)[:-1], n, 0)
            put("ext_prefix_len", layout.ext_starts, n, 0)
            # the points they save: after save_at tokens, the DeltaNet state by the chain and the conv's last inputs
            tokens, slots = padded_windows(cu, layout.ext_saves, pool.scratch_slot)
            put("ext_save_at", [save for save, _ in layout.ext_saves], n, 0)
            put("ext_save_slots", slots, n, pool.scratch_slot)
            put("ext_point_tokens", tokens, CONV_WINDOW * n, 0)
            put("ext_point_slots", slots, n, pool.scratch_slot)
        cu = offsets(layout.row_lengths, start=at - bucket.row_start)  # from the rows' region's start
        put("row_cu", cu, bucket.rows + 1, cu[-1])
        put("row_slots", layout.row_slots, bucket.rows, pool.scratch_slot)
        put("prefix_start", layout.prefix_start, bucket.rows, 0)
        put("prefix_len", layout.prefix_len, bucket.rows, 0)
        # Padding picks name the rows' region's first token: a valid index counted from the pass or from the rows.
        put("picks", [at + i for i in layout.row_picks] if at else layout.row_picks, bucket.picks, bucket.row_start)
        put("prefix", layout.prefix, len(layout.prefix), 0)
        self.flat[:end].copy_(self.hosts[self.turn][:end], non_blocking=True)
        if copied is not None:
            copied.record()


def padded_windows(starts: list[int], saves: list[tuple[int, int]], scratch_slot: int) -> tuple[list[int], list[int]]:
    """Each segment's point window, one entry a segment (a captured pass's fixed shape; passes.point_windows lists
    only the points saved): the pass token indices of the CONV_WINDOW conv inputs before its point and the point's
    slot, or zeros and the scratch slot where it saves none. `starts`: each segment's first token in the pass."""
    tokens: list[int] = []
    slots: list[int] = []
    for start, (save, slot) in zip(starts, saves):  # `starts` may have one more (offsets)
        tokens.extend(range(start + save - CONV_WINDOW, start + save) if save else [0] * CONV_WINDOW)
        slots.append(slot if save else scratch_slot)
    return tokens, slots


@dataclass
class GraphStats:
    runs: int = 0  # passes run padded to a bucket (replayed, or eagerly without CUDA)
    long_runs: int = 0  # of which with a long new state
    captures: int = 0
    replays: int = 0
    evictions: int = 0
    capture_failures: int = 0
    count: int = 0
    bytes: int = 0  # memory the graphs' pool holds (reserved while capturing)
    warm_s: float = 0.0  # seconds in eager passes before captures (first launches stay out of the graphs)
    capture_s: float = 0.0  # seconds capturing and instantiating


class PassGraphs:
    """Captures and replays the fused forward per bucket. With `capture` False (no CUDA) the same padded passes run
    eagerly from the same buffers: tests check the padding and the buffers on a CPU."""

    def __init__(
        self,
        model: FusedQwen35,
        pool: StatePool,
        pad_id: int,
        max_tokens: int,
        max_graphs: int,
        prefix_tokens: int = PREFIX_TOKENS,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.pool = pool
        self.pad_id = pad_id
        most = EAGER_ABOVE_FLOPS / model.w.projection_flops
        self.buckets = [b for b in all_buckets(max_tokens) if b.long_prefix or b.tokens <= most]
        self.max_graphs = max_graphs
        self.capture = capture
        device = pool.recurrent.device
        self.device = device
        largest_rows = max(b.row_tokens for b in self.buckets)
        largest_states = max(b.state_tokens for b in self.buckets)
        largest_ext = max(b.ext_tokens for b in self.buckets)
        self.inputs = StaticInputs(Bucket(largest_states, largest_rows, ext_tokens=largest_ext), prefix_tokens, device)
        self.graphs: OrderedDict[Bucket, tuple[object, torch.Tensor]] = OrderedDict()
        self.seen: set[Bucket] = set()  # buckets passes have used (what a warm-up list could name)
        self.failed: dict[Bucket, str] = {}  # buckets whose capture failed, and why
        # One pool and one capture stream for every graph. A graph may reuse memory that an earlier capture freed,
        # including where another graph's output lives; replays never overlap and the caller of `run` reads a graph's
        # output (enqueues the head's projection of it) before anything else replays, so any replay order is safe.
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.stream = torch.cuda.Stream(device) if capture else None
        self.stats = GraphStats()

    def bucket_for(self, layout: PassLayout) -> Bucket | None:
        return smallest_bucket(self.buckets, layout, self.inputs.prefix_tokens)

    def run(self, bucket: Bucket, layout: PassLayout) -> torch.Tensor:
        """The pass's picked hidden states [picks, hidden] (fp32), replaying (or first capturing) its bucket: a view of
        the graph's output, which the caller reads (enqueues its reads) before anything else replays."""
        entry = self.graphs.get(bucket)
        if entry is None and self.capture and bucket not in self.failed:
            entry = self._try_capture(bucket)
        self.inputs.fill(bucket, layout, self.pool, self.pad_id)
        self.stats.runs += 1
        self.stats.long_runs += not all(is_short(n) for n in layout.state_lengths)
        self.seen.add(bucket)
        if entry is None:  # no CUDA, or the capture failed: the padded pass, eagerly
            out = self.model.forward(self.inputs.pass_input(bucket))
        else:
            self.graphs.move_to_end(bucket)
            graph, out = entry
            graph.replay()  # type: ignore[attr-defined]
            self.stats.replays += 1
        return out[: len(layout.row_picks)]

    def warm(self, buckets: list[Bucket] | None = None) -> None:
        """Captures the given buckets (all of them by default) before traffic arrives."""
        if not self.capture:
            return
        for bucket in buckets if buckets is not None else self.buckets[: self.max_graphs]:
            if bucket not in self.graphs and bucket not in self.failed:
                self._try_capture(bucket)

    def _try_capture(self, bucket: Bucket) -> tuple[object, torch.Tensor] | None:
        """Captures the bucket, or records why it could not be (an operation that refuses capture): its passes then
        run padded and eagerly, with the same kernels, and the server keeps starting and serving. After a failed
        capture no more are tried: torch's capture_end throws on an invalidated capture before it stops routing the
        stream's allocations to the graphs' pool and before it ends the CUDA generator's capture, so every later
        capture fails too ("already recording to mempool_id", torch 2.11), and ending the routing by hand does not
        bring them back."""
        if self.failed:
            return None
        try:
            return self._capture(bucket, warm=not self.stats.captures)
        except RuntimeError as error:
            self.failed[bucket] = repr(error)[:500]
            self.stats.capture_failures += 1
            log.error(
                "kev: CUDA graph capture of bucket %s failed: %r; no more graphs are captured, passes without one "
                "run eagerly",
                bucket.name,
                error,
            )
            return None

    def _capture(self, bucket: Bucket, warm: bool = True) -> tuple[object, torch.Tensor]:
        """Captures the bucket's pass; `warm`: an eager pass first, on the capture stream (the first capture's), so
        that first launches (Triton compiles, cuBLASLt picks) stay out of the graph. Later buckets' kernels that run
        for the first time compile inside their capture, with the same answers and a faster start."""
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
            self.stats.evictions += 1
        inputs = self.inputs.pass_input(bucket)
        # An empty pass: every segment empty, so warm-up and capture write only the scratch slot and page.
        self.inputs.fill(bucket, PassLayout(), self.pool, self.pad_id)
        stream = self.stream
        started = time.perf_counter()
        if warm:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # first launches (Triton compiles, cuBLASLt picks) stay out of the graph
                self.model.forward(inputs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # torch.cuda.graph empties the allocator's cache on entry: measured from an empty cache, what capture adds to
        # the reserved memory is what the graphs' pool grew by (it keeps its segments while any graph lives).
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        captured = time.perf_counter()
        current = torch.cuda.current_stream(self.device)
        try:
            # thread_local: the pipeline's delivery thread may be waiting on a batch's event meanwhile, which a
            # "global" capture forbids in every thread (a capture after warm-up: a bucket evicted, or warm off).
            with torch.cuda.graph(graph, pool=self.mempool, stream=stream, capture_error_mode="thread_local"):
                out = self.model.forward(inputs)
        finally:
            torch.cuda.set_stream(current)  # torch.cuda.graph leaves its stream current when capture_end raises
        self.stats.warm_s += captured - started
        self.stats.capture_s += time.perf_counter() - captured
        self.stats.bytes += torch.cuda.memory_reserved(self.device) - reserved
        self.stats.captures += 1
        self.graphs[bucket] = (graph, out)
        self.stats.count = len(self.graphs)
        return graph, out
