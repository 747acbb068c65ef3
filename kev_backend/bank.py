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


class StateBank(Generic[Entry]):
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
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
        self._entries[key] = entry
        self.stats.bytes += size
        self.stats.entries = len(self._entries)
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.stats.bytes = self.stats.entries = 0

    def __contains__(self, key: tuple[int, ...]) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _remove(self, key: tuple[int, ...]) -> None:
        self.stats.bytes -= self._entries.pop(key).nbytes
        self.stats.entries = len(self._entries)
