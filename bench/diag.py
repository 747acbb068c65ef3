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


def gemm_speed() -> None:
    """Median ms of each projection's GEMM at pass sizes from one short request to a busy long batch."""
    torch.backends.cuda.preferred_blas_library("cublas")
    shapes = {"gdn_in": (12352, 2560), "out": (2560, 4096), "gate_up": (18432, 2560), "down": (2560, 9216)}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        line = []
        for m in (40, 218, 1000, 6540, 20000):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                F.linear(x, w)
            times = []
            for _ in range(20):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                F.linear(x, w)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            ms = sorted(times)[10]
            line.append(f"{m}:{ms:.3f}ms/{2 * m * n * k / ms / 1e9:.0f}TF")
        print("speed", name, " ".join(line), flush=True)


def kernel_breakdown() -> None:
    """GPU time by kernel for a busy short6 batch (32 new), a long5 batch (8 new) and one short6 on a banked state."""
    from torch.profiler import ProfilerActivity, profile

    from kev_backend import tiny
    from kev_backend.engine import Engine, EngineOptions
    from kev_backend.workloads import long5, short6

    directory = Path(tempfile.mkdtemp())
    tiny.write_tokenizer(directory)
    checkpoint = tiny.synthetic_checkpoint(tiny.KEV4B_CONFIG, directory, "cuda")
    engine = Engine(checkpoint, EngineOptions(device="cuda", backend="fused", bank_bytes=8 << 30))
    counter = iter(range(10**6))
    cases = {
        "short6x32new": lambda: [short6(next(counter)) for _ in range(32)],
        "long5x8new": lambda: [long5(next(counter)) for _ in range(8)],
        "short6same": lambda: [short6(None)],
    }
    for label, make in cases.items():
        engine.answer(make())
        engine.answer(make())
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            engine.answer(make())
            wall = (time.perf_counter() - t) * 1000
        print(f"== {label}: wall {wall:.1f} ms", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


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
    if what == "speed":
        gemm_speed()
    if what == "kernels":
        kernel_breakdown()
    if what in ("gemm", "all"):
        gemm_invariance()
    if what in ("profile", "all"):
        host_profile()
