"""Growing states on the reference path: a new state whose tokens begin with a banked state's is computed from a
point kept with that state, then only its own tokens after the point.

A state is computed in chunks of `width` tokens (`Qwen35TextModel.chunks`), each continuing the cache the one before
left. A *point* is that cache at a chunk boundary b: the attention layers' keys and values of the first b tokens (the
first b of the banked state's own: a view, no copy) and the DeltaNet layers' conv and recurrent state after token b
(kept: n_deltanet_layers · (conv_dim · (W-1) + Hv · Dk · Dv) fp32 values a point). Continuing a point with the rest
of a state runs exactly the chunks that computing it whole runs after b, on the same inputs, so the state's cache, and
every answer read from it, is the same bit for bit as computing it from nothing.

Each banked state keeps one point: the last chunk boundary at least TAIL_TOKENS before its end. A text state that
grows can tokenize its last few tokens differently (a word continued across the join), and a JSON state renders its
closing brackets again after what was added, so the point leaves its last tokens out. A state shorter than one chunk
plus that tail keeps none.

Finding a prefix: each boundary of a state has a key chained from the one before and its chunk's tokens, so the
furthest point a new state shares is found with one hash a chunk, then confirmed token by token (a hash never decides
alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

from ..model.qwen35 import SequenceCache
from ..protocol.encoding import token_ids
from .bank import LruIndex, StateBank

TAIL_TOKENS = 16  # a state's last tokens that a grown state may not share


def point_length(tokens: int, width: int) -> int:
    """Where a state of `tokens` tokens keeps its point: the last chunk boundary at least TAIL_TOKENS before its end
    (0: none)."""
    return max(0, tokens - TAIL_TOKENS) // width * width


def boundary_keys(tokens: Sequence[int], width: int, upto: int) -> list[int]:
    """The key of each chunk boundary of `tokens` up to `upto` tokens: each hashes the one before and its chunk. A
    state's (StateTokens) are computed once a width, on the first thread that asks (the request's preparation, where
    the pipeline estimates its work), not again on the model's."""
    chains = getattr(tokens, "chains", None)
    if chains is not None and (known := chains.get(width)) is not None:
        return known[: max(0, upto) // width]
    keys, key = [], 0
    for end in range(width, (len(tokens) if chains is not None else upto) + 1, width):
        key = hash((key, width, tuple(tokens[end - width : end])))
        keys.append(key)
    if chains is not None:
        chains[width] = keys
        return keys[: max(0, upto) // width]
    return keys


@dataclass(frozen=True)
class Point:
    """A state's DeltaNet layers' conv and recurrent state after its first `length` tokens (None in attention layers),
    computed in chunks of `width`. The attention layers' keys and values of those tokens are the banked state's own."""

    length: int
    width: int
    key: int  # boundary_keys(state, width, length)[-1]
    conv: list[torch.Tensor | None]
    recurrent: list[torch.Tensor | None]

    @classmethod
    def of(cls, state: Sequence[int], cache: SequenceCache, width: int) -> Point:
        """The point of `cache`, the cache of `state`'s first `cache.length` tokens (a chunk boundary). It keeps the
        cache's conv and recurrent tensors, which nothing changes in place."""
        key = boundary_keys(state, width, cache.length)[-1]
        return cls(cache.length, width, key, list(cache.conv), list(cache.recurrent))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.recurrent) if t is not None)

    def cache(self, banked: SequenceCache) -> SequenceCache:
        """The cache after this point's tokens, from `banked`, the full cache of the state keeping it: keys and values
        as views of its first `length` tokens."""
        return SequenceCache(
            length=self.length,
            keys=[None if k is None else k[:, :, : self.length] for k in banked.keys],
            values=[None if v is None else v[:, :, : self.length] for v in banked.values],
            conv=list(self.conv),
            recurrent=list(self.recurrent),
        )


@dataclass
class Banked:
    """A banked state: its cache, and its point if it is long enough to keep one (a point shared with the state it
    grew from is counted in both entries' bytes)."""

    cache: SequenceCache
    point: Point | None = None

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes + (self.point.nbytes if self.point is not None else 0)


class Keyed(Protocol):
    """A point as PointIndex finds it: where it is (`length` tokens in chunks of `width`) and its boundary key."""

    @property
    def length(self) -> int: ...

    @property
    def width(self) -> int: ...

    @property
    def key(self) -> int: ...


class WithPoint(Protocol):
    @property
    def nbytes(self) -> int: ...

    @property
    def point(self) -> Keyed | None: ...


Entry = TypeVar("Entry", bound=WithPoint)


class PointIndex(LruIndex[Entry], Generic[Entry]):
    """A bank whose states may keep a point, indexed by the point's key. A point goes with its state when the state
    is evicted; using a state's point counts as using the state, so a conversation's latest state stays banked while
    it grows."""

    def __init__(self, *args: int) -> None:
        super().__init__(*args)  # the bank's own arguments (cooperative: PrefixBank's StateBank)
        self._owners: dict[int, dict[tuple[int, ...], None]] = {}  # a point's key: the banked states keeping it

    def longest_prefix(
        self, state: Sequence[int], width: int, after: int = 1
    ) -> tuple[tuple[int, ...], Entry, Keyed] | None:
        """The banked point furthest into `state` that `state` continues (its tokens up to the point are the banked
        state's), with at least `after` tokens of `state` after it: the state keeping it, its entry and the point;
        None when there is none."""
        keys = boundary_keys(state, width, len(state) - after)
        for length, key in zip(range(len(keys) * width, 0, -width), reversed(keys), strict=True):
            for owner in reversed(self._owners.get(key, {})):
                entry = self._entries[owner]
                point = entry.point
                if point is None or (point.length, point.width) != (length, width):
                    continue
                if np.array_equal(token_ids(state)[:length], token_ids(owner)[:length]):  # StateTokens: no tuples
                    self._entries.move_to_end(owner)
                    return owner, entry, point
        return None

    def continued_length(self, state: Sequence[int], width: int, after: int = 1) -> int:
        """How far into `state` the furthest point `longest_prefix` may find lies (0: none), from the keys alone: the
        tokens are not compared and nothing is touched, so a thread other than the bank's user may ask, for an
        estimate (a point found here may be evicted, or rarely a hash's false match, before the bank's user looks)."""
        keys = boundary_keys(state, width, len(state) - after)
        for length, key in zip(range(len(keys) * width, 0, -width), reversed(keys), strict=True):
            if self._owners.get(key):  # one dict lookup: atomic beside the bank user's changes
                return length
        return 0

    def _add(self, key: tuple[int, ...], entry: Entry) -> None:
        super()._add(key, entry)
        if entry.point is not None:
            self._owners.setdefault(entry.point.key, {})[key] = None

    def _remove(self, key: tuple[int, ...]) -> Entry:
        entry = super()._remove(key)
        if entry.point is not None:
            owners = self._owners.get(entry.point.key, {})
            owners.pop(key, None)
            if not owners:
                self._owners.pop(entry.point.key, None)
        return entry


class PrefixBank(PointIndex[Banked], StateBank[Banked]):
    """The reference path's bank: an LRU of `capacity_bytes` whose states' points are indexed by key."""
