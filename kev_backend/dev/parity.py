"""Parity of a fast engine against the fp32 reference, and of a fast engine against itself (alone vs in a batch,
bank hit vs miss), on encoded requests. Used by the GPU tests and by the benchmark, which records the figures."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from ..engine.engine import Engine
from ..protocol.encoding import Encoded

Probabilities = list[list[list[float]]]


def scored(engine: Engine, encoded: Sequence[Encoded], batch_size: int) -> Probabilities:
    out: Probabilities = []
    for start in range(0, len(encoded), batch_size):
        out.extend(engine.scorer.probabilities(encoded[start : start + batch_size]))
    return out


# Top-two margin under which the first side's answer counts as a near-tie: there bf16 rounding alone (of the
# weights, before any kernel runs) can swap the argmax, so flips are also reported without them.
NEAR_TIE = 0.02


def compare(a: Probabilities, b: Probabilities) -> dict[str, Any]:
    """Max and mean |Δp| over every option, argmax flips (first maximum, as Kev picks `choice`), and the flips and
    count of questions whose top-two margin on side `a` is at least NEAR_TIE."""
    gaps, flips, decided, decided_flips, questions = [], 0, 0, 0, 0
    for pa_request, pb_request in zip(a, b, strict=True):
        for pa, pb in zip(pa_request, pb_request, strict=True):
            questions += 1
            gaps.extend(abs(x - y) for x, y in zip(pa, pb, strict=True))
            flipped = pa.index(max(pa)) != pb.index(max(pb))
            flips += flipped
            top = sorted(pa, reverse=True)
            if len(top) == 1 or top[0] - top[1] >= NEAR_TIE:
                decided += 1
                decided_flips += flipped
    return {
        "questions": questions,
        "max_abs": max(gaps),
        "mean_abs": sum(gaps) / len(gaps),
        "flips": flips,
        "decided_questions": decided,
        "decided_flips": decided_flips,
    }


def spread(probabilities: Probabilities) -> dict[str, float]:
    """How decided the answers are: random weights must be neither saturated nor flat for parity to mean much."""
    top, entropy = [], []
    for request in probabilities:
        for p in request:
            top.append(max(p))
            entropy.append(-sum(x * math.log(x) for x in p if x > 0) / math.log(len(p)) if len(p) > 1 else 0.0)
    top.sort()
    return {
        "top_p_median": top[len(top) // 2],
        "top_p_p10": top[len(top) // 10],
        "top_p_p90": top[9 * len(top) // 10],
        "share_top_over_0.99": sum(t > 0.99 for t in top) / len(top),
        "normalised_entropy_mean": sum(entropy) / len(entropy),
    }


def parity_report(reference: Engine, fast: Engine, requests: Sequence[Any], batch_size: int = 32) -> dict[str, Any]:
    """The parity figures: fast vs fp32 reference, alone vs batched, bank hit vs miss."""
    encoded = [reference.prepare(r)[1] for r in requests]
    seconds: dict[str, float] = {}

    def timed(name: str, engine: Engine, size: int) -> Probabilities:
        started = time.perf_counter()
        result = scored(engine, encoded, size)
        seconds[name] = round(time.perf_counter() - started, 2)
        return result

    expected = timed("reference", reference, 4)
    fast.bank.clear()
    batched = timed("batched", fast, batch_size)  # misses, except states repeated across requests
    hits = timed("hits", fast, batch_size)  # the same batches again: every state from the bank
    fast.bank.clear()
    alone = timed("alone", fast, 1)
    return {
        "seconds": seconds,
        "requests": len(encoded),
        "state_tokens": [min(len(e.state) for e in encoded), max(len(e.state) for e in encoded)],
        "vs_reference": compare(expected, batched),
        "alone_vs_batch": compare(alone, batched),
        "bank_hit_vs_miss": compare(hits, batched),
        "spread_reference": spread(expected),
    }


def main(argv: list[str] | None = None) -> None:
    """python -m kev_backend.dev.parity CHECKPOINT --out DIR: the fused path's parity report on realistic requests,
    as JSON (the GPU tests check the same figures against their bars)."""
    import argparse
    import json
    from pathlib import Path

    import torch

    from ..engine.engine import EngineOptions
    from ..model.checkpoint import load_checkpoint
    from .provenance import commit
    from .workloads import realistic

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--questions", type=int, default=1000)
    parser.add_argument("--max-words", type=int, default=2500)
    parser.add_argument("--commit", help="the commit the report names (default: git's HEAD)")
    args = parser.parse_args(argv)
    checkpoint = load_checkpoint(args.checkpoint, torch.device("cuda"))
    reference = Engine(checkpoint, EngineOptions(backend="reference", bank_bytes=0))
    fused = Engine(checkpoint, EngineOptions(backend="fused", bank_bytes=16 << 30))
    report = parity_report(reference, fused, realistic(args.questions, seed=0, max_words=args.max_words))
    report.update(
        gpu=torch.cuda.get_device_name(),
        date=time.strftime("%Y-%m-%d"),
        commit=commit(args.commit),
        long_kernels=fused.options.long_kernels,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{time.strftime('%Y-%m-%d')}-parity-{args.checkpoint.name}-{report['commit']}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["vs_reference"]), path)


if __name__ == "__main__":
    main()
