"""The state bank: continuation caches of states already computed, reused across requests.

An LRU keyed by the exact state tokens (the <state> token included) and bounded in bytes. A state is computed once
per batch however many requests share it; the bank only saves recomputing it in later batches, so it never changes
an answer.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


Entry = TypeVar("Entry", bound=Sized)


@dataclass
class BankStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0
    # Growing states (scoring/growth.py): misses computed from a banked state's point, the state tokens that point
    # held, and the state tokens computed for misses.
    prefix_hits: int = 0
    tokens_reused: int = 0
    tokens_computed: int = 0


class LruIndex(Generic[Entry]):
    """States by exact tokens, least recently used first; counts hits, misses and bytes. Subclasses decide when
    to evict, and `_remove` is the one place an entry leaves."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.stats = BankStats()

    def get(self, key: tuple[int, ...]) -> Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return entry

    def clear(self) -> None:
        for key in list(self._entries):
            self._remove(key)

    def __contains__(self, key: tuple[int, ...]) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _add(self, key: tuple[int, ...], entry: Entry) -> None:
        self._entries[key] = entry
        self.stats.bytes += entry.nbytes
        self.stats.entries = len(self._entries)

    def _remove(self, key: tuple[int, ...]) -> Entry:
        entry = self._entries.pop(key)
        self.stats.bytes -= entry.nbytes
        self.stats.entries = len(self._entries)
        return entry


class StateBank(LruIndex[Entry]):
    """The reference path's bank: entries hold their own tensors, evicted past `capacity_bytes`."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__()
        self.capacity_bytes = capacity_bytes

    def put(self, key: tuple[int, ...], entry: Entry) -> bool:
        """Keeps `entry` as most recent, evicting the least recent ones to make room; False if it cannot fit."""
        size = entry.nbytes
        if size > self.capacity_bytes:
            return False
        if key in self._entries:
            self._remove(key)
        while self.stats.bytes + size > self.capacity_bytes:
            self._remove(next(iter(self._entries)))
            self.stats.evictions += 1
        self._add(key, entry)
        return True
