"""The fused path's state bank: a preallocated pool on the GPU (DeltaNet slots, paged attention K/V) behind an LRU
keyed by exact state tokens. Fixed addresses, so passes (and their CUDA graphs) read states by index.

Growing states (scoring/growth.py has the idea and the reference path's form): a banked state of POINT_MIN_TOKENS or
more keeps a point, the DeltaNet conv and recurrent state after its last page boundary at least TAIL_TOKENS before
its end, in a slot of its own. A new state that continues a point shares the pages of the point's tokens with the
state keeping it (pages are counted by reference, freed with their last state) and starts from a copy of the point
in its own slot: only its tokens after the point are computed. Cost: a point is one more slot (slot_bytes: Kev-4B
48 MiB); a grown state adds its own pages only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..model.qwen35 import FULL_ATTENTION, Qwen35Config
from ..scoring.growth import PointIndex, boundary_keys, point_length

# The shortest state that keeps a point: a shorter one is computed again whole in about the time a turn takes.
POINT_MIN_TOKENS = 1024
# The fewest tokens a state computes after the point it continues: the conv's window, which a state's end window is
# read from (a state that continues a point is at least TAIL_TOKENS + 1 longer than it when it grew from its state).
EXTEND_MIN_TOKENS = 4


@dataclass(frozen=True)
class GpuPoint:
    """A state's DeltaNet conv and recurrent state after its first `length` tokens (a page boundary), in pool slot
    `slot`; `key` is boundary_keys(state, width, length)[-1]. The attention K/V of those tokens are the state's first
    pages."""

    length: int
    width: int
    key: int
    slot: int


@dataclass
class Slot:
    """Where one state lives in the pool: a DeltaNet slot and the pages of its attention K/V."""

    slot: int
    pages: list[int]
    length: int
    nbytes: int  # what it holds alone: its slot, its point's and the pages no other state shares
    point: GpuPoint | None = None

    def kv_index(self, page_size: int) -> np.ndarray:
        """The pool K/V index of each of the state's tokens (int64; numpy: a long state's is thousands)."""
        pages = np.asarray(self.pages, dtype=np.int64)
        return (pages[:, None] * page_size + np.arange(page_size)).ravel()[: self.length]


class StatePool:
    """Preallocated bank storage: per GDN layer a conv window [slots, conv_dim, W] and an fp32 recurrent state
    [slots, Hv, Dk, Dv]; per attention layer K and V in pages of `page_size` tokens. Fixed addresses, so passes
    (and their CUDA graphs) read states by index."""

    def __init__(
        self, config: Qwen35Config, n_slots: int, n_pages: int, page_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        gdn = sum(t != FULL_ATTENTION for t in config.layer_types)
        attn = len(config.layer_types) - gdn
        c = config
        self.page_size = page_size
        self.recurrent = torch.zeros(
            gdn,
            n_slots,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
            device=device,
            dtype=torch.float32,
        )
        self.conv = torch.zeros(gdn, n_slots, c.conv_dim, c.linear_conv_kernel_dim, device=device, dtype=dtype)
        kv_shape = (attn, n_pages * page_size, c.num_key_value_heads, c.head_dim)
        self.keys = torch.zeros(kv_shape, device=device, dtype=dtype)
        self.values = torch.zeros(kv_shape, device=device, dtype=dtype)
        self.slot_bytes = self.recurrent[:, 0].numel() * 4 + self.conv[:, 0].numel() * self.conv.element_size()
        self.page_bytes = 2 * attn * page_size * c.num_key_value_heads * c.head_dim * self.keys.element_size()
        # One slot and one page are scratch, never allocated: a captured pass's padding segments and tokens write
        # their (empty) states and K/V there, so a replay never touches a real state.
        self.scratch_slot = n_slots - 1
        self.scratch_token = (n_pages - 1) * page_size
        self.pages = n_pages - 1  # to give: all but the scratch page (and `scratch_slot` slots)
        self.free_slots = list(range(n_slots - 1))
        self.free_pages = list(range(n_pages - 1))
        self.page_refs = np.zeros(n_pages, dtype=np.int64)  # the states holding each page

    @property
    def nbytes(self) -> int:
        """What the pool holds on its device."""
        return sum(t.numel() * t.element_size() for t in (self.recurrent, self.conv, self.keys, self.values))

    @classmethod
    def sized(
        cls,
        config: Qwen35Config,
        capacity_bytes: int,
        device: torch.device,
        dtype: torch.dtype,
        page_size: int = 64,
        min_slots: int = 1,
        min_tokens: int = 0,
    ) -> StatePool:
        """Half the bytes for DeltaNet slots, half for K/V pages (at least what one batch must hold)."""
        probe = cls(config, 2, 2, page_size, torch.device("meta"), dtype)
        slots = max(min_slots, capacity_bytes // 2 // probe.slot_bytes) + 1  # + the scratch slot and page
        pages = max(math.ceil(min_tokens / page_size), capacity_bytes // 2 // max(probe.page_bytes, 1)) + 1
        return cls(config, int(slots), int(pages), page_size, device, dtype)

    @property
    def used_bytes(self) -> int:
        """What the states hold: their slots and points, and each page once however many states share it."""
        slots = self.scratch_slot - len(self.free_slots)
        return slots * self.slot_bytes + (self.pages - len(self.free_pages)) * self.page_bytes

    def allocate(self, length: int, shared: list[int] | None = None, points: int = 0) -> tuple[Slot, list[int]] | None:
        """A slot and pages for a state of `length` tokens whose first pages are `shared` (another state's, held by
        reference), and `points` more slots; None where the pool lacks room."""
        shared = shared or []
        n_pages = math.ceil(length / self.page_size) - len(shared)
        if len(self.free_slots) < 1 + points or len(self.free_pages) < n_pages:
            return None
        pages = [self.free_pages.pop() for _ in range(n_pages)]
        self.page_refs[shared + pages] += 1
        extra = [self.free_slots.pop() for _ in range(points)]
        nbytes = (1 + points) * self.slot_bytes + n_pages * self.page_bytes
        return Slot(self.free_slots.pop(), shared + pages, length, nbytes), extra

    def release(self, slot: Slot) -> None:
        self.free_slots.append(slot.slot)
        if slot.point is not None:
            self.free_slots.append(slot.point.slot)
        self.page_refs[slot.pages] -= 1
        self.free_pages.extend(page for page in slot.pages if not self.page_refs[page])

    def copy_point(self, point: GpuPoint, slot: int) -> None:
        """The point's conv and recurrent state into `slot` (enqueued on the current stream)."""
        self.recurrent[:, slot] = self.recurrent[:, point.slot]
        self.conv[:, slot] = self.conv[:, point.slot]


def slots_for(length: int, page: int) -> int:
    """The pool slots a new state of `length` tokens takes: its own, and its point's where it keeps one."""
    return 2 if point_length(length, page) >= POINT_MIN_TOKENS else 1


Continued = tuple[tuple[int, ...], Slot, GpuPoint]  # GpuBank.continued: the state keeping a point, its slot, the point


@dataclass(frozen=True)
class Extension:
    """How a new state is computed: from its token `start` on (0: whole; else the end of the point it continues,
    copied into its slot), its own point saved after its first `save` tokens (0: none)."""

    start: int = 0
    save: int = 0


class GpuBank(PointIndex[Slot]):
    """The fused path's bank: states in a StatePool, evicted when the pool has no room for a new one. States of
    the batch in flight are pinned."""

    def __init__(self, pool: StatePool) -> None:
        super().__init__()
        self.pool = pool

    def continued(self, key: tuple[int, ...]) -> Continued | None:
        """The furthest banked point a new state continues (with at least EXTEND_MIN_TOKENS of its own after it): the
        state keeping it, that state's slot and the point; None where it continues none."""
        return self.longest_prefix(key, self.pool.page_size, after=EXTEND_MIN_TOKENS)  # type: ignore[return-value]

    def continued_estimate(self, key: tuple[int, ...]) -> int:
        """Where the point `continued` would find lies (0: none), as read from any thread (PointIndex.continued_length:
        an estimate)."""
        return self.continued_length(key, self.pool.page_size, after=EXTEND_MIN_TOKENS)

    def allocate(
        self, key: tuple[int, ...], pinned: set[tuple[int, ...]], found: Continued | None
    ) -> tuple[Slot, Extension] | None:
        """A slot for a new state, and how to compute it: from `found`, the point it continues (`continued`; the state
        keeping it still banked), its pages shared and the point copied into the new slot; keeping a point of its own
        when it is long enough (POINT_MIN_TOKENS) and that point is further (found by later states once `publish`ed:
        after the pass computing it is enqueued). Evicts least recently used unpinned states (never the state whose
        point it continues); None if the pinned ones fill the pool."""
        page = self.pool.page_size
        start, shared, source = 0, [], None
        if found is not None:
            owner, entry, source = found
            start, shared = source.length, entry.pages[: source.length // page]
            pinned = pinned | {owner}
        keep = point_length(len(key), page)
        keep = keep if keep >= POINT_MIN_TOKENS and keep > start else 0
        made = self._allocate(key, pinned, shared, 1 if keep else 0)
        if made is None and keep:  # no slot for a point beside the pinned states: the state without one
            keep, made = 0, self._allocate(key, pinned, shared, 0)
        if made is None:
            return None
        slot, extra = made
        if keep:
            slot.point = GpuPoint(keep, page, boundary_keys(key, page, keep)[-1], extra[0])
        if source is not None:
            self.pool.copy_point(source, slot.slot)  # type: ignore[arg-type]
            self.stats.prefix_hits += 1
            self.stats.tokens_reused += start
        self.stats.tokens_computed += len(key) - start
        return slot, Extension(start, keep - start if keep else 0)

    def _allocate(
        self, key: tuple[int, ...], pinned: set[tuple[int, ...]], shared: list[int], points: int
    ) -> tuple[Slot, list[int]] | None:
        while (made := self.pool.allocate(len(key), shared, points)) is None:
            victim = next((k for k in self._entries if k not in pinned), None)
            if victim is None:
                return None
            self._remove(victim)
            self.stats.evictions += 1
        self._add(key, made[0])
        return made

    def forget(self, key: tuple[int, ...]) -> None:
        """Drops a state whose pass failed (its slot holds garbage)."""
        if key in self._entries:
            self._remove(key)

    def publish(self, key: tuple[int, ...]) -> None:
        """The banked state's point, if it keeps one, found by later states: its pass is enqueued, and anything that
        reads the point is enqueued after it."""
        slot = self._entries.get(key)
        if slot is not None and slot.point is not None:
            self._owners.setdefault(slot.point.key, {})[key] = None

    def _add(self, key: tuple[int, ...], entry: Slot) -> None:
        super()._add(key, entry)
        self.stats.bytes = self.pool.used_bytes

    def _remove(self, key: tuple[int, ...]) -> Slot:
        slot = super()._remove(key)
        self.pool.release(slot)
        self.stats.bytes = self.pool.used_bytes
        return slot
