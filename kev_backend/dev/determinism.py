"""Whether a question's answer depends on anything but its own request: its probabilities, bit for bit, alone on a
new state against inside random batch mixes (1 to `max_batch` requests, in any order, states new and banked, the
bank emptied at random between batches so states are evicted and computed again), with passes replayed from CUDA
graphs and run eagerly. The GPU test requires that none differ (tests/gpu/test_determinism.py); the bench records
the counts in its `determinism` field:

    python -m kev_backend.dev.bench --determinism 1000          (the questions; after the bench's workloads)
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

from ..gpu.scorer import FusedScorer
from ..protocol.encoding import Encoded

Answers = list[list[float]]  # a request's probabilities, question by question


@contextmanager
def eagerly(scorer: FusedScorer) -> Iterator[None]:
    """The scorer's passes run eagerly (its graphs kept aside, then put back)."""
    graphs, scorer.graphs = scorer.graphs, None
    try:
        yield
    finally:
        scorer.graphs = graphs


def alone(scorer: FusedScorer, encoded: Sequence[Encoded]) -> list[Answers]:
    """Each request scored by itself on an emptied bank (its state computed in its own pass)."""
    answers = []
    for e in encoded:
        scorer.bank.clear()
        answers.append(scorer.probabilities([e])[0])
    return answers


def batches(n: int, max_batch: int, rng: random.Random) -> list[list[int]]:
    """range(n) shuffled, cut into batches of random sizes from 1 to max_batch."""
    order = list(range(n))
    rng.shuffle(order)
    cuts, start = [], 0
    while start < n:
        size = rng.randint(1, max_batch)
        cuts.append(order[start : start + size])
        start += size
    return cuts


def differing(a: Answers, b: Answers) -> int:
    """Questions whose probabilities differ in any bit (fp32 values, exact as Python floats)."""
    return sum(pa != pb for pa, pb in zip(a, b, strict=True))


def check(
    scorer: FusedScorer,
    encoded: Sequence[Encoded],
    mixes: int = 3,
    max_batch: int = 64,
    evict: float = 0.25,
    seed: int = 0,
) -> dict[str, Any]:
    """Every request alone (graphs, then eagerly), then `mixes` batch mixes with graphs and as many eagerly, each
    batch's answers against the same requests' alone with graphs; before a batch the bank is emptied with chance
    `evict`. Counts questions."""
    started = time.perf_counter()
    reference = alone(scorer, encoded)
    with eagerly(scorer):
        eager_alone = alone(scorer, encoded)
    rng = random.Random(seed)
    compared = different = batch_count = 0
    for graphs in (True, False):
        for _ in range(mixes):
            scorer.bank.clear()
            for batch in batches(len(encoded), max_batch, rng):
                if rng.random() < evict:
                    scorer.bank.clear()
                with eagerly(scorer) if not graphs else nullcontext():
                    answers = scorer.probabilities([encoded[i] for i in batch])
                batch_count += 1
                for i, got in zip(batch, answers, strict=True):
                    compared += len(got)
                    different += differing(reference[i], got)
    return {
        "questions": sum(len(e.questions) for e in encoded),
        "requests": len(encoded),
        "mixes": mixes,
        "batches": batch_count,
        "compared": compared,
        "differing": different,
        "graphs_vs_eager_differing": sum(differing(r, e) for r, e in zip(reference, eager_alone, strict=True)),
        "seconds": round(time.perf_counter() - started, 1),
    }
