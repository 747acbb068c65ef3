"""The GEMM tuner: times cuBLASLt's candidates for a checkpoint's projections at the graph buckets' token counts and
writes the table kev_backend.gpu.cublaslt reads at run time (kev_backend/gpu/gemm_algos/).

    python -m kev_backend.dev.gemm_tuner tune CHECKPOINT OUT.json
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from ..gpu.cublaslt import GemmAlgos, identity
from ..gpu.fused import FusedWeights
from ..gpu.graphs import all_buckets
from ..model.checkpoint import load_checkpoint


def _graph_us(fn: Callable[[], object], calls: int) -> float:
    """µs a call of `fn` (which makes `calls` GEMMs) replayed from a CUDA graph: GPU time without host launches."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / 3 / calls


def tune(shapes: Iterable[tuple[int, int, int]], device: torch.device, gain: float = 0.01) -> list[dict]:
    """For each (M, N, K): F.linear against the heuristic's non-split candidates (weights cold: two copies in turn),
    keeping the fastest when it is over `gain` faster and gives F.linear's output bit for bit."""
    algos = GemmAlgos({}, device)
    entries = []
    for m, n, k in shapes:
        torch.manual_seed(0)
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(2)]
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        y = torch.empty(m, n, device=device, dtype=torch.bfloat16)
        expected = F.linear(x, weights[0])
        linear_us = _graph_us(lambda x=x, ws=weights: [F.linear(x, w) for w in ws], len(weights))
        plan = algos.plan(m, n, k)
        best = None
        for algo in plan.candidates():
            run = lambda a=algo, p=plan, x=x, y=y, ws=weights: [p.run(a, x, w, y, algos.workspace) for w in ws]  # noqa: E731
            us = _graph_us(run, len(weights))
            plan.run(algo, x, weights[0], y, algos.workspace)
            if torch.equal(y, expected) and us < linear_us * (1 - gain) and (best is None or us < best[0]):
                best = (us, algo)
        if best is not None:
            words = [f"{word:x}" for word in best[1].data]
            entries.append(dict(m=m, n=n, k=k, algo=words, us=round(best[0], 2), linear_us=round(linear_us, 2)))
    return entries


def main(argv: list[str]) -> None:
    """python -m kev_backend.dev.gemm_tuner tune CHECKPOINT OUT.json: a table for this GPU, the checkpoint's
    projections at the token counts of the graphs' buckets (graph_max_tokens 4,096)."""

    if len(argv) != 3 or argv[0] != "tune":
        raise SystemExit(main.__doc__)
    device = torch.device("cuda")
    model = load_checkpoint(argv[1], device=device).model
    weights = FusedWeights(model)
    projections = sorted({tuple(w.shape) for layer in weights.layers for w in (layer.in_proj, layer.out_proj,
                          layer.gate_up, layer.down)})  # fmt: skip
    tokens = sorted({bucket.tokens for bucket in all_buckets(4096)})
    started = time.perf_counter()
    entries = tune([(m, n, k) for m in tokens for n, k in projections], device)
    data = identity(device) | {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "shapes": entries}
    Path(argv[2]).write_text(json.dumps(data, indent=1) + "\n")
    print(
        f"{len(entries)} of {len(tokens) * len(projections)} shapes on another algorithm, tuned in "
        f"{time.perf_counter() - started:.0f} s: {argv[2]}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
