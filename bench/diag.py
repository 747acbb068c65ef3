"""Diagnostics on the GPU machine (not a benchmark): where a short pass spends host time, and whether cuBLAS bf16
GEMMs give a row the same result whatever else rides in the batch. Prints a short report.
    python3 bench/diag.py [profile|gemm]"""

from __future__ import annotations

import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def gemm_invariance() -> None:
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        print("library", library, flush=True)
        gemm_rows()


def gemm_rows() -> None:
    torch.manual_seed(0)
    shapes = {"gdn_in": (12352, 2560), "out": (2560, 4096), "gate_up": (18432, 2560), "down": (2560, 9216)}
    rows = [1, 7, 34, 40, 64, 100, 218, 300, 1000]
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(2630, k, device="cuda", dtype=torch.bfloat16)
        full = F.linear(x, w)
        diffs = []
        for m in rows:
            part = F.linear(x[:m], w)
            diffs.append(f"{m}:{(part.float() - full[:m].float()).abs().max().item():.1e}")
        print("gemm", name, " ".join(diffs), flush=True)


def host_profile() -> None:
    from kev_backend import tiny
    from kev_backend.engine import Engine, EngineOptions
    from kev_backend.workloads import short6

    directory = Path(tempfile.mkdtemp())
    tiny.write_tokenizer(directory)
    checkpoint = tiny.synthetic_checkpoint(tiny.KEV4B_CONFIG, directory, "cuda")
    engine = Engine(checkpoint, EngineOptions(device="cuda", backend="fused", bank_bytes=8 << 30))
    for _ in range(3):
        engine.answer([short6(None)])
    t = time.perf_counter()
    for _ in range(10):
        engine.answer([short6(None)])
    print(f"short6 same: {(time.perf_counter() - t) * 100:.2f} ms per request", flush=True)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(10):
        engine.answer([short6(None)])
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(25)
    from kev_backend import kernels

    x = torch.randn(40, 2560, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(2560, device="cuda")
    for label, fn in (("triton rms_norm", lambda: kernels.rms_norm(x, w, 1e-6)), ("torch add", lambda: x + x)):
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(1000):
            fn()
        host = (time.perf_counter() - t) * 1000
        torch.cuda.synchronize()
        print(f"{label}: {host:.1f} us per launch (host)", flush=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what in ("gemm", "all"):
        gemm_invariance()
    if what in ("profile", "all"):
        host_profile()
