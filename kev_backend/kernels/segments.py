"""Tiles over varlen segments without host-side maps: every segment [cu[n], cu[n + 1]) is cut into tiles of BT
tokens from its start (an empty one into one empty tile), tiles numbered segment after segment. A grid of
cdiv(T, BT) + N programs covers every tile of N segments holding T tokens whatever their lengths, so it is fixed by
(T, N) alone and a captured graph can replay it for any lengths within them."""

from __future__ import annotations

import triton
import triton.language as tl


def tile_grid(tokens: int, segments: int, block: int) -> int:
    """Programs enough for every tile of `segments` segments over `tokens` tokens."""
    return triton.cdiv(tokens, block) + segments


@triton.jit
def segment_of_tile(cu, N, i_g, BT: tl.constexpr):
    """The i_g-th tile: (segment n, its bos and eos, the tile's first token), n = -1 past the last tile. A walk over
    the N offsets (long segments: few of them)."""
    seg = -1
    bos_hit = tl.full([], 0, tl.int64)
    eos_hit = tl.full([], 0, tl.int64)
    first = tl.full([], 0, tl.int64)
    done = tl.full([], 0, tl.int64)  # tiles of the segments before n
    for n in range(N):
        bos = tl.load(cu + n).to(tl.int64)
        eos = tl.load(cu + n + 1).to(tl.int64)
        tiles = tl.maximum((eos - bos + BT - 1) // BT, 1)  # an empty segment too (a new one writes its window)
        hit = (i_g >= done) & (i_g < done + tiles)
        seg = tl.where(hit, n, seg)
        bos_hit = tl.where(hit, bos, bos_hit)
        eos_hit = tl.where(hit, eos, eos_hit)
        first = tl.where(hit, bos + (i_g - done) * BT, first)
        done += tiles
    return seg, bos_hit, eos_hit, first
