"""The GEMM tuner: times cuBLASLt's candidates for a checkpoint's projections at the graph buckets' token counts and
writes the table kev_backend.gpu.cublaslt reads at run time (kev_backend/gpu/gemm_algos/).

    python -m kev_backend.dev.gemm_tuner tune CHECKPOINT|SIZE OUT.json
    python -m kev_backend.dev.gemm_tuner merge OUT.json TABLE...

A SIZE (kev_backend.dev.sizes.SIZES: 0.8b, 4b, 9b, 27b) takes the projections from its config, loading no weights
(the tuner times random matrices of each shape anyway). At run time one table per GPU and cuBLASLt version is used
(cublaslt.pretuned: the first that matches), so tables of several sizes are merged into one before they ship.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from ..engine.engine import EngineOptions
from ..gpu.cublaslt import GemmAlgos, identity, read_table
from ..gpu.graphs import all_buckets
from ..gpu.weights import FusedWeights
from ..model.checkpoint import load_checkpoint
from ..model.qwen35 import Qwen35Config
from .sizes import SIZES, fused_projections


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
    """For each (M, N, K): the shape without a table (the heuristic's first candidate without split-K) against the
    heuristic's other non-split candidates (weights cold: two copies in turn), keeping the fastest when it is over
    `gain` faster and gives the same output bit for bit. An entry's `linear_us` is the shape's time without it."""
    algos = GemmAlgos({}, device)
    entries = []
    for m, n, k in shapes:
        torch.manual_seed(0)
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(2)]
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        y = torch.empty(m, n, device=device, dtype=torch.bfloat16)
        expected = algos.linear(x, weights[0])
        linear_us = _graph_us(lambda x=x, ws=weights: [algos.linear(x, w) for w in ws], len(weights))
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


def checkpoint_projections(path: str, device: torch.device) -> set[tuple[int, int]]:
    """(out, in) features of a checkpoint's fused projections, from its loaded weights."""
    weights = FusedWeights(load_checkpoint(path, device=device).model)
    return {
        tuple(w.shape) for layer in weights.layers for w in (layer.in_proj, layer.out_proj, layer.gate_up, layer.down)
    }


def size_projections(size: str) -> set[tuple[int, int]]:
    """(out, in) features of a Kev size's fused projections, from its config."""
    config = Qwen35Config.from_dict(SIZES[size].config)
    return {shape for shapes in fused_projections(config).values() for shape in shapes}


def tune_table(source: str, out: Path) -> None:
    """A table for this GPU: `source`'s projections (a SIZE's or a checkpoint's) at the token counts of the graphs'
    buckets (the shipped graph_max_tokens)."""
    device = torch.device("cuda")
    projections = sorted(size_projections(source) if source in SIZES else checkpoint_projections(source, device))
    tokens = sorted({bucket.tokens for bucket in all_buckets(EngineOptions().graph_max_tokens)})
    started = time.perf_counter()
    entries = tune([(m, n, k) for m in tokens for n, k in projections], device)
    data = identity(device) | {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "shapes": entries}
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(
        f"{len(entries)} of {len(tokens) * len(projections)} shapes on another algorithm, tuned in "
        f"{time.perf_counter() - started:.0f} s: {out}"
    )


def merge_tables(out: Path, tables: list[Path]) -> dict:
    """One table holding every shape of `tables`, which must be of one GPU and cuBLASLt version (read_table checks
    each); a shape in several keeps its fastest entry. The first table's torch and date are kept."""
    merged: dict[tuple[int, int, int], dict] = {}
    first: dict | None = None
    for path in tables:
        tuned_on, _ = read_table(path)
        data = json.loads(path.read_text())
        if first is None:
            first = data
        elif tuned_on != {key: first[key] for key in tuned_on}:
            raise ValueError(f"{path}: tuned on {tuned_on}, not on {first['gpu']} / {first['cublaslt_version']}")
        for entry in data["shapes"]:
            shape = (entry["m"], entry["n"], entry["k"])
            if shape not in merged or entry["us"] < merged[shape]["us"]:
                merged[shape] = entry
    if first is None:
        raise ValueError("no tables to merge")
    result = {key: value for key, value in first.items() if key != "shapes"}
    result["shapes"] = [merged[shape] for shape in sorted(merged)]
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str]) -> None:
    """python -m kev_backend.dev.gemm_tuner tune CHECKPOINT|SIZE OUT.json: a table for this GPU, the projections of
    a checkpoint or a Kev size at the token counts of the graphs' buckets (graph_max_tokens 4,096);
    python -m kev_backend.dev.gemm_tuner merge OUT.json TABLE...: tables of one GPU merged into one."""
    if len(argv) == 3 and argv[0] == "tune":
        tune_table(argv[1], Path(argv[2]))
    elif len(argv) >= 3 and argv[0] == "merge":
        result = merge_tables(Path(argv[1]), [Path(table) for table in argv[2:]])
        print(f"{len(result['shapes'])} shapes: {argv[1]}")
    else:
        raise SystemExit(main.__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
