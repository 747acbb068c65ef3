"""The scorer contract: what the engine, the metrics and the bench ask of a scorer (the fp32 reference path,
scoring/reference.py, and the fused GPU path, gpu/scorer.py), so that none of them reaches into a scorer's attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..protocol.encoding import Encoded


class Pending(Protocol):
    """A launched batch's probabilities: `result` waits for them (per request, per question, per option)."""

    def result(self) -> list[list[list[float]]]: ...


@dataclass(frozen=True)
class ScorerStats:
    """A scorer's running totals and what it holds, for the metrics, the start-up line and the bench."""

    graph_replays: int = 0  # passes replayed from a CUDA graph
    graph_captures: int = 0  # CUDA graphs captured
    graph_capture_failures: int = 0  # captures that failed (their passes run eagerly)
    graphs: int | None = None  # CUDA graphs held; None where the scorer keeps none
    graph_bytes: int = 0  # memory the graphs' pool holds
    oom_retries: int = 0  # passes retried in parts after the GPU ran out of memory
    gemm_table: str | None = None  # the pre-tuned cuBLASLt table the projections use (its file)
    gemm_shapes: int | None = None  # the shapes it holds; None where the projections run on no such table
    gemm_passed_over: str = ""  # with no table in use: the tables looked at and what each was tuned on


class Scorer(Protocol):
    bank: Any
    on_progress: Callable[[], None] | None  # called after each unit of model work

    def probabilities(self, batch: Sequence[Encoded]) -> list[list[list[float]]]: ...

    def launch(self, batch: Sequence[Encoded]) -> Pending: ...

    def units(self, batch: Sequence[Encoded]) -> Generator[None, None, Pending]: ...

    # The request's model work in tokens were it run now, read on any thread (an estimate: the bank may change first).
    def work(self, encoded: Encoded) -> int: ...

    def warm_graphs(self) -> None: ...  # captures what the scorer replays (nothing where it replays nothing)

    def wide_states(self) -> int: ...  # long new states that make one busy pass for the warm-up (0: none needed)

    def warm_head(self) -> None: ...

    def bank_summary(self) -> str: ...  # for the start-up line: what the bank holds ("" when nothing to say)

    def stats(self) -> ScorerStats: ...
