"""A batch's model work as units: a scorer's `units(batch)` is a generator that does (or, on a GPU, enqueues) one
unit of work per step, yields between units, and returns the batch's pending probabilities. Whoever drives it decides
what runs between two units (engine/scheduler.py serves short batches between a long one's units); driving it to its
end at once is `launch`. The units are the same however they are driven, so the answers are too."""

from __future__ import annotations

from collections.abc import Generator

from .head import PendingProbabilities

Units = Generator[None, None, PendingProbabilities]


def run_units(units: Units) -> PendingProbabilities:
    """Every unit at once; the pending probabilities."""
    while True:
        try:
            next(units)
        except StopIteration as done:
            return done.value
