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


# The bars a fused path is held to (docs/benchmarking.md, Rules): against the fp32 reference, the largest |Δp| and
# decided answers flipped at most 1 in 300; alone against batched and bank hit against miss.
BARS = {
    "vs_reference_max_abs": 0.03,
    "decided_flips_per_question": 1 / 300,
    "alone_max_abs": 0.01,
    "bank_max_abs": 0.01,
}


def verdict(report: dict[str, Any]) -> dict[str, bool]:
    """Each bar of BARS met or not by a parity report."""
    reference = report["vs_reference"]
    return {
        "vs_reference_max_abs": reference["max_abs"] <= BARS["vs_reference_max_abs"],
        "decided_flips": reference["decided_flips"] <= reference["questions"] * BARS["decided_flips_per_question"],
        "alone_vs_batch": report["alone_vs_batch"]["max_abs"] <= BARS["alone_max_abs"],
        "bank_hit_vs_miss": report["bank_hit_vs_miss"]["max_abs"] <= BARS["bank_max_abs"],
    }


def size_checkpoint(size: str, device: Any, layers: int | None = None) -> tuple[Any, dict[str, Any]]:
    """A Kev size's random weights in fp32 on `device` (synthetic.synthetic_model: LoRA merged for a LoRA size), at the
    depth its fp32 reference fits at (Size.parity_config, or the first `layers`), with the tiny tokenizer; and what
    the report says of it."""
    import torch

    from . import synthetic
    from .sizes import SIZES, truncated

    spec = SIZES[size]
    config = truncated(spec.config, layers) if layers else spec.parity_config()
    checkpoint = synthetic.size_checkpoint(spec, device, torch.float32, config)
    depth, full = config["num_hidden_layers"], spec.config["num_hidden_layers"]
    about = {"model": spec.label, "weights": spec.weights, "layers": depth, "model_layers": full}
    if depth < full:
        about["depth"] = (
            f"the first {depth} of {full} layers (the same 3:1 DeltaNet/attention order): the fp32 reference of "
            "the whole model does not fit on the GPU beside the bf16 one"
        )
    return checkpoint, about


def main(argv: list[str] | None = None) -> None:
    """python -m kev_backend.dev.parity (CHECKPOINT | --size SIZE) --out DIR: the fused path's parity report on
    realistic requests, as JSON (the GPU tests check the same figures against their bars). A CHECKPOINT is loaded in
    fp32 (its LoRA merged in fp32), the reference's weights; the fused engine runs them in bf16. A SIZE is random
    weights of a Kev size's shapes (sizes.SIZES), at a truncated depth where its fp32 copy would not fit."""
    import argparse
    import json
    from pathlib import Path

    import torch

    from ..engine.engine import EngineOptions
    from ..model.checkpoint import LoadOptions, load_checkpoint
    from .provenance import commit
    from .sizes import SIZES
    from .workloads import realistic

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("checkpoint", type=Path, nargs="?")
    parser.add_argument("--size", choices=list(SIZES), help="random weights of a Kev size's shapes instead")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--questions", type=int, default=1000)
    parser.add_argument("--max-words", type=int, default=2500)
    parser.add_argument("--layers", type=int, help="with --size: its first LAYERS layers (default: SIZES' depth)")
    parser.add_argument("--bank-gib", type=float, default=16.0, help="the fused engine's state bank")
    parser.add_argument("--commit", help="the commit the report names (default: git's HEAD)")
    args = parser.parse_args(argv)
    if (args.checkpoint is None) == (args.size is None):
        parser.error("give one of CHECKPOINT and --size")
    device = torch.device("cuda")
    if args.size:
        checkpoint, about = size_checkpoint(args.size, device, args.layers)
        name = about["model"]
    else:
        checkpoint = load_checkpoint(args.checkpoint, device, LoadOptions(dtype="fp32"))
        about, name = {"checkpoint": str(args.checkpoint)}, args.checkpoint.name
    reference = Engine(checkpoint, EngineOptions(backend="reference", bank_bytes=0))
    fused = Engine(checkpoint, EngineOptions(backend="fused", bank_bytes=int(args.bank_gib * (1 << 30))))
    report = about | parity_report(reference, fused, realistic(args.questions, seed=0, max_words=args.max_words))
    report.update(
        verdict=verdict(report),
        gpu=torch.cuda.get_device_name(),
        date=time.strftime("%Y-%m-%d"),
        commit=commit(args.commit),
        gpu_gib_peak=torch.cuda.max_memory_allocated() / (1 << 30),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{time.strftime('%Y-%m-%d')}-parity-{name}-{report['commit']}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"vs_reference": report["vs_reference"], "verdict": report["verdict"]}), path)


if __name__ == "__main__":
    main()
