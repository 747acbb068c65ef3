"""Which batch's next unit of model work runs: short work is never held behind more than one unit of long work.

A batch is long when its requests hold more than LONG_WORK_TOKENS tokens of model work (a state near Kev's 65,536
tokens, a /permute of 64 orders of 255 options); the pipeline gives each long request a batch of its own and keeps
every other request of a Triton batch together in one normal batch. A batch runs as units (scoring/units.py): a chunk
of a state or of a row pass on the CPU, a pass on the GPU.

- Normal batches run first come, first served, each to its end, as they would without long ones.
- Long batches take turns, one unit each (so one client's long requests do not hold another's back), and alternate
  with the normal ones: after a long unit, the normal batches waiting by then all run before the next long unit. So
  a short request waits for at most the one long unit under way, and long work still gets a turn however much normal
  work arrives. "Waiting" includes the batch its caller is preparing, or about to (the pipeline's `grant`): Triton
  forms its next batch only once the last one is handed over, from the requests that queued during the long unit.
- On a GPU the units run asynchronously behind each other on one stream: a long unit is only enqueued once the long
  unit before it has finished on the device (`ready`), so at most one is ever ahead of the normal work enqueued
  meanwhile.

The order decides only when work runs, never what it computes: every unit is the same whatever runs between two of
a batch's units, so answers do not depend on the schedule.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

# A request with more model work than this (its state and every question's branch, in tokens) is scheduled as long.
# A long5 request (a 2,200-token document, five questions) is ~2,600 tokens, a short6 one ~250; a 64k-token state
# runs ~1.3 s on an H200 (Kev-4B) and over a minute on a CPU.
LONG_WORK_TOKENS = 16_384


class Work(Protocol):
    long: bool


W = TypeVar("W", bound=Work)


class Scheduler(Generic[W]):
    def __init__(self) -> None:
        self.normal: deque[W] = deque()
        self.long: deque[W] = deque()
        self.normal_turns = 0  # normal batches to run before the next long unit
        self.long_ran = False  # the last unit chosen was long: the normal batches waiting now get their turn
        self.long_in_flight: Callable[[], bool] | None = None  # the last long unit is still running on the device

    def __len__(self) -> int:
        return len(self.normal) + len(self.long)

    def add(self, work: W) -> None:
        if work.long and not self.long:  # the normal work already waiting goes first
            self.normal_turns = len(self.normal)
        (self.long if work.long else self.normal).append(work)

    def next(self) -> W | None:
        """The batch whose unit runs next (asking changes nothing; `ran` commits the choice); None while only long
        work is left and the last long unit still runs on the device."""
        turns = len(self.normal) if self.long_ran else self.normal_turns
        long_ready = bool(self.long) and not (self.long_in_flight is not None and self.long_in_flight())
        if self.normal and (turns > 0 or not long_ready):
            return self.normal[0]
        return self.long[0] if long_ready else None

    def grant(self) -> None:
        """A normal batch that was on its way when the normal turns ran out (the caller saw it coming) gets a turn."""
        if not self.long_ran:
            self.normal_turns += 1

    def ran(self, work: W, in_flight: Callable[[], bool] | None = None) -> None:
        """`work`, chosen by `next`, ran (or enqueued) a unit; for a long one, `in_flight` says whether that unit still
        runs on the device."""
        if self.long_ran:  # the normal batches waiting after a long unit get their turns
            self.normal_turns = len(self.normal)
            self.long_ran = False
        if work.long:
            self.long.rotate(-1)  # turns: the batch that ran goes to the back
            self.long_ran = True
            self.long_in_flight = in_flight

    def finished(self, work: W) -> None:
        """`work` has run its last unit (or failed): it leaves."""
        if work.long:
            self.long.remove(work)
        else:
            self.normal.remove(work)
            self.normal_turns = max(0, self.normal_turns - 1)
