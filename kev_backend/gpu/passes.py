"""What one fused pass works on, and how it is built: described on the host (PassLayout, from the scorer's rows:
lay_out) and on the device (PassInput): new states' tokens first, then the tokens of new states that continue a
banked point (extensions: from the point on), then question rows' tokens, each kind split into kernel groups by
segment length (short segments, then long ones), plus the bank pool indices the mixers read and write. Eager passes
size it exactly (exact_input); captured passes (graphs.py) fill the same layout into a bucket's padded buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..protocol.encoding import EncodedQuestion, token_ids
from ..scoring.transfer import device_int_fields, device_ints
from .pool import Extension, Slot

# A segment this short is "short", a longer one "long": each class is a kernel group of its own (its kernels'
# configurations differ). The class depends on the segment alone, never on what shares its pass,
# so a question's answer does not depend on its batch.
RECURRENT_MAX_LEN = 64

# Batch invariance of the GEMMs: cuBLAS picks split-K by the row count M, and a split changes the summation order, so
# a row's bf16 output would depend on what shares its pass. On Kev-4B's projections (M = 1..4,096 against
# M = 8,192, docs/kernels.md) cuBLASLt's results are identical for every M >= 52, cuBLAS's only from M = 257. So the
# fused path prefers cuBLASLt and gives every GEMM at least MIN_GEMM_ROWS rows (pad rows that nothing reads); at these
# sizes the GEMMs are bound by reading the weights, so the padding costs nothing.
MIN_GEMM_ROWS = 64


def pad_rows(x: torch.Tensor, rows: int = MIN_GEMM_ROWS) -> torch.Tensor:
    """x with zero rows appended up to `rows` (x itself when it has enough)."""
    return x if x.shape[0] >= rows else F.pad(x, (0, 0, 0, rows - x.shape[0]))


def is_short(length: int) -> bool:
    return length <= RECURRENT_MAX_LEN


@dataclass
class KernelGroup:
    """Segments of one kind and one length class, contiguous in the pass: tokens [start, end). Short ones (up to
    RECURRENT_MAX_LEN tokens), long ones and rows run our kernels, which read or write the bank in place. The class
    depends on a segment's own length, never on its company."""

    short: bool
    start: int
    end: int
    max_len: int  # longest segment (for a captured pass, the bound its grids are sized for)
    cu: torch.Tensor  # int64 offsets from `start`, [segments + 1]
    slots: torch.Tensor  # the pool slot of each segment (its own, or the state a row continues)
    padded: bool = False  # a captured pass's group: `slots` and `cu` are its capacity, mostly empty segments
    # A captured pass's new states in one group (graphs.StaticInputs.pass_input): its first `short_segments`
    # segments are the short states' slots, the rest the long ones'. 0: one length class, as `short` says.
    short_segments: int = 0
    # New states keeping a point: after each segment's first save_at[n] tokens (0: none) the DeltaNet state goes into
    # pool slot save_slots[n] (kernels.delta_rule.chunked_rows); None: no segment of the group keeps one.
    save_at: torch.Tensor | None = None
    save_slots: torch.Tensor | None = None

    @property
    def span(self) -> slice:
        return slice(self.start, self.end)

    @classmethod
    def build(cls, start: int, lengths: list[int], slots: list[int], device: torch.device) -> KernelGroup:
        short = all(is_short(n) for n in lengths)
        assert short or not any(is_short(n) for n in lengths)
        cu_host = offsets(lengths)
        cu = device_ints(cu_host, device)
        return cls(
            short=short,
            start=start,
            end=start + cu_host[-1],
            max_len=max(lengths),
            cu=cu,
            slots=device_ints(slots, device),
        )


def offsets(lengths: list[int], start: int = 0) -> list[int]:
    """Cumulative offsets [start, start + n0, start + n0 + n1, ...] of consecutive segments (cu_seqlens)."""
    out = [start]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@dataclass
class Segments:
    """The new states, or the question rows, of a pass: tokens [start, end), short segments first, then long ones;
    `cu` and `max_len` cover them all (rows' attention runs over every row at once)."""

    start: int
    end: int
    max_len: int
    cu: torch.Tensor  # int64 offsets from `start` of every segment
    groups: list[KernelGroup]

    @classmethod
    def build(cls, start: int, lengths: list[int], slots: list[int], device: torch.device) -> Segments:
        """Segments in the given order, which must put every short one before every long one."""
        n_short = sum(is_short(n) for n in lengths)
        assert all(is_short(n) for n in lengths[:n_short])
        groups = []
        offset = start
        for part in (slice(0, n_short), slice(n_short, len(lengths))):
            if lengths[part]:
                group = KernelGroup.build(offset, lengths[part], slots[part], device)
                groups.append(group)
                offset = group.end
        # One length class (the usual case): the region's offsets are its group's, already on the device.
        cu = groups[0].cu if len(groups) == 1 else device_ints(offsets(lengths), device)
        return cls(start, offset, max(lengths), cu, groups)


@dataclass
class PassLayout:
    """A pass on the host: new states' tokens first, then the rows'. Row picks count from the first row token."""

    state_ids: list[int] | np.ndarray = field(default_factory=list)  # numpy from the scorer (StateTokens' ids)
    state_lengths: list[int] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)
    # Pool K/V index of each state token (a long state's are thousands: numpy, as the bank gives them, or a list).
    state_kv_dst: list[int] | np.ndarray = field(default_factory=list)
    row_ids: list[int] = field(default_factory=list)
    row_positions: list[int] = field(default_factory=list)
    row_lengths: list[int] = field(default_factory=list)
    row_slots: list[int] = field(default_factory=list)
    prefix: list[int] | np.ndarray = field(default_factory=list)  # each continued state's tokens' pool K/V index
    prefix_start: list[int] = field(default_factory=list)
    prefix_len: list[int] = field(default_factory=list)
    row_picks: list[int] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)  # (save_at, point slot) per new state
    # New states continuing a point (their tokens from `ext_starts` on), as the new states' fields.
    ext_ids: list[int] | np.ndarray = field(default_factory=list)
    ext_lengths: list[int] = field(default_factory=list)
    ext_starts: list[int] = field(default_factory=list)
    ext_slots: list[int] = field(default_factory=list)
    ext_kv_dst: list[int] | np.ndarray = field(default_factory=list)
    ext_prefix: list[int] | np.ndarray = field(default_factory=list)
    ext_saves: list[tuple[int, int]] = field(default_factory=list)

    def state_positions(self) -> np.ndarray:
        """Each new state's token positions, 0 … n − 1, one state after another (int64)."""
        if not self.state_lengths:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(n, dtype=np.int64) for n in self.state_lengths])

    @property
    def all_short(self) -> bool:
        return all(is_short(n) for n in self.state_lengths) and all(is_short(n) for n in self.row_lengths)


@dataclass
class PassInput:
    ids: torch.Tensor  # [T]: new-state tokens, then row tokens, then any padding
    positions: torch.Tensor  # [T]
    states: Segments | None  # new states computed in this pass
    state_kv_dst: torch.Tensor | None  # pool K/V index of each new-state token
    rows: Segments | None  # question rows (None: a pass of new states only)
    row_prefix: torch.Tensor  # pool K/V index of the tokens of each state the rows continue, one run per state
    row_prefix_start: torch.Tensor  # where each row's state run starts in row_prefix
    row_prefix_len: torch.Tensor  # its length (the state's tokens)
    picks: torch.Tensor  # pass token index of every </opt> and <decide> read by the head
    # The longest row prefix, on the host (a graph's: the longest it takes, graphs.LONG_PREFIX_MAX): it sizes the rows'
    # attention's parts (kernels.attention.FOLD_KEYS), which run in parallel (row_parts_parallel) or fold in turn
    row_prefix_max: int = 0
    row_parts_parallel: bool = True
    # New states continuing a banked point: their tokens from the point on, each
    # attending to its point's tokens' K/V through `extend_prefix` (the state's own first pages, shared with the
    # state keeping the point), one run a state.
    extends: Segments | None = None
    extend_kv_dst: torch.Tensor | None = None
    extend_prefix: torch.Tensor | None = None
    extend_prefix_start: torch.Tensor | None = None
    extend_prefix_len: torch.Tensor | None = None
    # The longest state they make (a point's tokens and its own), on the host (an extensions' graph's: the longest it
    # takes, graphs.LONG_PREFIX_MAX): it sizes their attention's parts (kernels.attention.FOLD_KEYS).
    extend_keys_max: int = 0
    # Points saved in this pass: the pass token indices of each one's last W conv inputs [points, W], and the point
    # slots their windows go to (the DeltaNet state is saved by the chain: KernelGroup.save_at).
    point_windows: tuple[torch.Tensor, torch.Tensor] | None = None


# --------------------------------------------------------------------------------------------------------------------
# building a pass: a group of question rows (Row) laid out on the host (lay_out), then on the device exactly sized
# (exact_input); a captured pass fills the same PassLayout into its bucket's padded buffers instead (graphs.py)


@dataclass
class Row:
    request: int
    question: int
    tokens: EncodedQuestion
    state: tuple[int, ...]


def lay_out(
    rows: list[Row],
    new: list[tuple[int, ...]],
    slots: dict[tuple[int, ...], Slot],
    page: int,
    how: dict[tuple[int, ...], Extension] | None = None,
) -> PassLayout:
    """The pass on the host: the `new` states' tokens (computed into their bank `slots`; those `how` says continue a
    point, from it on, after the others), then the `rows`' (each continuing its state from the bank), in the given
    orders; K/V indices by pages of `page` tokens."""
    out = PassLayout()
    how = how or {}
    kv_dst: list[np.ndarray] = []
    state_ids: list[np.ndarray] = []
    ext_ids: list[np.ndarray] = []
    ext_kv: list[np.ndarray] = []
    ext_prefix: list[np.ndarray] = []
    # Extensions' segments short first, as every region's (Segments.build): their class is their tokens after the point.
    order = sorted(new, key=lambda state: not is_short(len(state) - how.get(state, Extension()).start))
    for state in order:
        slot, extension = slots[state], how.get(state, Extension())
        point = slot.point.slot if extension.save else 0
        if extension.start:
            index = slot.kv_index(page)
            ext_ids.append(token_ids(state)[extension.start :])
            out.ext_lengths.append(len(state) - extension.start)
            out.ext_starts.append(extension.start)
            out.ext_slots.append(slot.slot)
            ext_kv.append(index[extension.start :])
            ext_prefix.append(index[: extension.start])
            out.ext_saves.append((extension.save, point))
            continue
        state_ids.append(token_ids(state))
        out.state_lengths.append(len(state))
        out.state_slots.append(slot.slot)
        kv_dst.append(slot.kv_index(page))
        out.state_saves.append((extension.save, point))
    # Each state's pool K/V index once; every row points at its state's run. A request's rows share its state's
    # tuple, so the run and slot are found by the tuple's identity first: hashing a long state's tuple on every
    # lookup would cost host time for each row.
    runs: dict[tuple[int, ...], int] = {}
    by_identity: dict[int, tuple[int, Slot]] = {}  # the tuples stay alive (in `rows`) while this runs
    prefix: list[np.ndarray] = []
    prefix_tokens = 0
    for row in rows:
        if (found := by_identity.get(id(row.state))) is None:
            slot = slots[row.state]
            if (run := runs.get(row.state)) is None:
                run = runs[row.state] = prefix_tokens
                prefix.append(slot.kv_index(page))
                prefix_tokens += len(prefix[-1])
            found = by_identity[id(row.state)] = (run, slot)
        run, slot = found
        out.prefix_start.append(run)
        out.prefix_len.append(len(row.state))
        start = len(out.row_ids)
        tokens = row.tokens.tokens
        out.row_ids.extend(tokens)
        out.row_positions.extend(range(len(row.state), len(row.state) + len(tokens)))
        out.row_lengths.append(len(tokens))
        out.row_slots.append(slot.slot)
        out.row_picks.append(start + row.tokens.decide)
        out.row_picks.extend(start + i for i in row.tokens.option_ends)
    # The new states' ids and K/V indices stay numpy arrays (a long state's are thousands, and an array is written
    # into the pinned buffer far faster than a list).
    if state_ids:
        out.state_ids = np.concatenate(state_ids)
        out.state_kv_dst = np.concatenate(kv_dst)
    if ext_ids:
        out.ext_ids = np.concatenate(ext_ids)
        out.ext_kv_dst = np.concatenate(ext_kv)
        out.ext_prefix = np.concatenate(ext_prefix)
    if prefix:
        out.prefix = np.concatenate(prefix)
    return out


def exact_input(layout: PassLayout, pad_id: int, device: torch.device) -> PassInput:
    """The pass on the device, exactly sized (padded only to MIN_GEMM_ROWS tokens)."""
    n_state, n_ext = len(layout.state_ids), len(layout.ext_ids)
    rows_at = n_state + n_ext
    padding = max(0, MIN_GEMM_ROWS - rows_at - len(layout.row_ids))
    ext_positions = [np.arange(a, a + n, dtype=np.int64) for a, n in zip(layout.ext_starts, layout.ext_lengths)]
    windows, window_slots = point_windows(layout)
    ext_runs = offsets(layout.ext_starts)
    fields = device_int_fields(
        [
            np.concatenate(
                [
                    np.asarray(layout.state_ids, np.int64),
                    np.asarray(layout.ext_ids, np.int64),
                    np.asarray(layout.row_ids, np.int64),
                    np.full(padding, pad_id, np.int64),
                ]
            ),
            np.concatenate(
                [
                    layout.state_positions(),
                    *ext_positions,
                    np.asarray(layout.row_positions, np.int64),
                    np.zeros(padding, np.int64),
                ]
            ),
            layout.state_kv_dst,
            layout.prefix,
            layout.prefix_start,
            layout.prefix_len,
            [rows_at + i for i in layout.row_picks],
            layout.ext_kv_dst,
            layout.ext_prefix,
            ext_runs[:-1],
            layout.ext_starts,
            windows,
            window_slots,
        ],
        device,
    )
    ids, positions, state_kv_dst, prefix, prefix_start, prefix_len, picks = fields[:7]
    ext_kv_dst, ext_prefix, ext_prefix_start, ext_prefix_len, windows_t, window_slots_t = fields[7:]
    states = None
    if n_state:
        states = Segments.build(0, layout.state_lengths, layout.state_slots, device)
        with_saves(states, layout.state_saves, device)
    extends = None
    if n_ext:
        extends = Segments.build(n_state, layout.ext_lengths, layout.ext_slots, device)
        with_saves(extends, layout.ext_saves, device)
    return PassInput(
        ids=ids,
        positions=positions,
        states=states,
        state_kv_dst=state_kv_dst if n_state else None,
        rows=Segments.build(rows_at, layout.row_lengths, layout.row_slots, device) if layout.row_ids else None,
        row_prefix=prefix,
        row_prefix_start=prefix_start,
        row_prefix_len=prefix_len,
        picks=picks,
        row_prefix_max=max(layout.prefix_len, default=0),
        extends=extends,
        extend_kv_dst=ext_kv_dst if n_ext else None,
        extend_prefix=ext_prefix if n_ext else None,
        extend_prefix_start=ext_prefix_start if n_ext else None,
        extend_prefix_len=ext_prefix_len if n_ext else None,
        extend_keys_max=max(map(sum, zip(layout.ext_starts, layout.ext_lengths)), default=0),
        point_windows=(windows_t.view(-1, CONV_WINDOW), window_slots_t) if len(window_slots) else None,
    )


# The conv's window (Qwen3.5's conv kernel size): a point keeps the last CONV_WINDOW inputs before it.
CONV_WINDOW = 4


def point_windows(layout: PassLayout) -> tuple[list[int], list[int]]:
    """For every point the pass saves: the pass token indices of its last CONV_WINDOW conv inputs (flat, a point's
    in order), and its slot."""
    tokens: list[int] = []
    slots: list[int] = []
    at = 0
    for lengths, saves in ((layout.state_lengths, layout.state_saves), (layout.ext_lengths, layout.ext_saves)):
        for n, (save, slot) in zip(lengths, saves, strict=True):
            if save:
                tokens.extend(range(at + save - CONV_WINDOW, at + save))
                slots.append(slot)
            at += n
    return tokens, slots


def with_saves(segments: Segments, saves: list[tuple[int, int]], device: torch.device) -> None:
    """The points its segments save (save_at, slot), on each kernel group that has any."""
    first = 0
    for group in segments.groups:
        n = group.slots.shape[0]
        mine = saves[first : first + n]
        first += n
        if any(at for at, _ in mine):
            group.save_at = device_ints([at for at, _ in mine], device)
            group.save_slots = device_ints([slot for _, slot in mine], device)
