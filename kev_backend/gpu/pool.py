"""The fused path's state bank: a preallocated pool on the GPU (DeltaNet slots, paged attention K/V) behind an LRU
keyed by exact state tokens. Fixed addresses, so passes (and their CUDA graphs) read states by index."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..model.qwen35 import FULL_ATTENTION, Qwen35Config
from ..scoring.bank import LruIndex


@dataclass
class Slot:
    """Where one state lives in the pool: a DeltaNet slot and the pages of its attention K/V."""

    slot: int
    pages: list[int]
    length: int
    nbytes: int

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

    def allocate(self, length: int) -> Slot | None:
        n_pages = math.ceil(length / self.page_size)
        if not self.free_slots or len(self.free_pages) < n_pages:
            return None
        pages = [self.free_pages.pop() for _ in range(n_pages)]
        return Slot(self.free_slots.pop(), pages, length, self.slot_bytes + n_pages * self.page_bytes)

    def release(self, slot: Slot) -> None:
        self.free_slots.append(slot.slot)
        self.free_pages.extend(slot.pages)


class GpuBank(LruIndex[Slot]):
    """The fused path's bank: states in a StatePool, evicted when the pool has no room for a new one. States of
    the batch in flight are pinned."""

    def __init__(self, pool: StatePool) -> None:
        super().__init__()
        self.pool = pool

    def allocate(self, key: tuple[int, ...], pinned: set[tuple[int, ...]]) -> Slot | None:
        """A slot for a new state, evicting least recently used unpinned states; None if the pinned ones fill it."""
        while (slot := self.pool.allocate(len(key))) is None:
            victim = next((k for k in self._entries if k not in pinned), None)
            if victim is None:
                return None
            self._remove(victim)
            self.stats.evictions += 1
        self._add(key, slot)
        return slot

    def forget(self, key: tuple[int, ...]) -> None:
        """Drops a state whose pass failed (its slot holds garbage)."""
        if key in self._entries:
            self._remove(key)

    def _remove(self, key: tuple[int, ...]) -> Slot:
        slot = super()._remove(key)
        self.pool.release(slot)
        return slot
