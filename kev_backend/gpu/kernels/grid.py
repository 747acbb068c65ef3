"""CUDA's limit on a grid's second dimension, and launches split by segments to stay under it.

The kernels that run a program per (segment, head) put segments × heads on the grid's second dimension, which CUDA
caps at 65,535: with Kev-4B's 32 value heads a pass of 2,048 segments or more would be refused ("Triton Error
[CUDA]: invalid argument"), and a batch with that many questions reaches it. Such passes launch once per span of
segments instead; every program computes what it would in one launch. (The delta rule puts its items on the grid's
first dimension, which holds 2^31 − 1: the conv and attention kernels use the spans.)
"""

from __future__ import annotations

MAX_GRID_Y = 65_535


def segment_spans(segments: int, programs_per_segment: int) -> list[tuple[int, int]]:
    """[start, end) spans of `segments` whose programs fit the grid's second dimension, in order."""
    per_launch = max(1, MAX_GRID_Y // programs_per_segment)
    return [(start, min(start + per_launch, segments)) for start in range(0, segments, per_launch)]
