"""Diagnostics on the GPU machine (not a benchmark): where a pass spends GPU and host time, kernel configurations
timed against each other and fla's, start-up phases, and whether answers depend on the batch. Prints a short report.
    python3 bench/diag.py [kernels|gaps|long [rows]|chunkvariants|rowsattn|longattn|convscan|ncuprobe|recurrent|
                           timeline|hostsplit|hostops|hostpath|latency|startup|coldstart|speed|sweep|invariance|profile|gemm]
(KEV_GRAPHS=1: engines replay CUDA graphs; bench/gpu_run.sh runs these as steps.)"""

from __future__ import annotations

import cProfile
import functools
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def cuda_ms(fn, repeat: int = 10, warmup: int = 3) -> float:
    """Mean GPU time of `fn` over `repeat` back-to-back calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def graph_ms(fn, repeat: int = 20) -> float:
    """Mean time of `fn` replayed from a CUDA graph (`repeat` calls captured back to back, as a pass's graph holds
    them): GPU time without the host's launches, which bound small eager calls (~0.14 ms a delta-rule call)."""
    fn()  # compiled and warm before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def graph_kernel_us(fn, repeat: int = 20) -> dict[str, float]:
    """µs a call of each kernel `fn` launches, replayed from a CUDA graph of `repeat` calls (torch's profiler sees a
    graph's kernels): which of several kernels a graph_ms difference is in."""
    from collections import defaultdict

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            total[event.name] += event.device_time_total / repeat
    return dict(total)


def kev4b_checkpoint():
    """Random Kev-4B weights on the GPU (fp32, LoRA merged) with the tiny tokenizer."""
    from kev_backend.dev import tiny

    directory = Path(tempfile.mkdtemp())
    tiny.write_tokenizer(directory)
    return tiny.synthetic_checkpoint(tiny.KEV4B_CONFIG, directory, "cuda", seed=0)


def kev4b_engine(checkpoint=None, **options):
    """An engine on random Kev-4B weights (8 GiB bank; `checkpoint`: kev4b_checkpoint's, made here if not given);
    KEV_GRAPHS=1 replays CUDA graphs as the GPU config does, KEV_GRAPH_MAX_TOKENS sets their largest bucket."""
    import os

    from kev_backend.engine.engine import Engine, EngineOptions

    checkpoint = checkpoint or kev4b_checkpoint()
    options = {"bank_bytes": 8 << 30, "graphs": os.environ.get("KEV_GRAPHS") == "1", **options}
    if "KEV_GRAPH_MAX_TOKENS" in os.environ:  # buckets up to this many tokens, all of them kept
        options.update(graph_max_tokens=int(os.environ["KEV_GRAPH_MAX_TOKENS"]), max_graphs=200)
    return Engine(checkpoint, EngineOptions(device="cuda", backend="fused", **options))


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
            ms = cuda_ms(lambda x=x, w=w: F.linear(x, w), repeat=20)
            line.append(f"{m}:{ms:.3f}ms/{2 * m * n * k / ms / 1e9:.0f}TF")
        print("speed", name, " ".join(line), flush=True)


def kernel_breakdown() -> None:
    """GPU time by kernel for a busy short6 batch (32 new), a long5 batch (8 new), one new short6 and one short6 on
    a banked state, one new long5 (KEV_GRAPHS=1: as the graphs replay them)."""
    from collections import defaultdict

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from kev_backend.dev.workloads import long5, short6

    engine = kev4b_engine()
    counter = iter(range(10**6))
    cases = {
        "short6x32new": lambda: [short6(next(counter)) for _ in range(32)],
        "long5x8new": lambda: [long5(next(counter)) for _ in range(8)],
        "short6new": lambda: [short6(next(counter))],
        "short6same": lambda: [short6(None)],
        "long5new": lambda: [long5(next(counter))],
    }
    for label, make in cases.items():
        engine.answer(make())
        engine.answer(make())
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            engine.answer(make())
            wall = (time.perf_counter() - t) * 1000
        by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for event in prof.events():
            if event.device_type == DeviceType.CUDA:
                by_name[event.name][0] += 1
                by_name[event.name][1] += event.device_time_total / 1000
        busy = sum(ms for _, ms in by_name.values())
        count = sum(n for n, _ in by_name.values())
        print(f"== {label}: wall {wall:.1f} ms, {count} kernels, GPU {busy:.2f} ms", flush=True)
        for name, (n, ms) in sorted(by_name.items(), key=lambda item: -item[1][1])[:22]:
            print(f"  {ms:7.3f} ms {n:4d}x  {name[:90]}", flush=True)
        # One layer's calls in launch order (µs): which of a pass's kernel groups (long states, short states, rows)
        # the segment kernels' time goes to, padding groups included.
        calls: dict[str, list[float]] = defaultdict(list)
        for event in sorted(prof.events(), key=lambda e: e.time_range.start):
            if event.device_type == DeviceType.CUDA and event.name in LAYER_KERNELS:
                calls[event.name].append(event.device_time_total)
        for name in LAYER_KERNELS:
            per_layer = len(calls[name]) // max(1, LAYER_KERNELS[name])
            first = " ".join(f"{us:.1f}" for us in calls[name][:per_layer])
            print(f"  first layer {name}: {first} µs", flush=True)


# The segment kernels and how many layers call them (Kev-4B: 24 DeltaNet layers, 8 attention layers).
LAYER_KERNELS = {
    "_conv_scan_kernel": 24,
    "_chunk_prep_kernel": 24,
    "_chunked_delta_rule_kernel": 24,
    "_recurrent_rows_kernel": 24,
    "_rows_attention_kernel": 8,
}


def invariance_sweep() -> None:
    """For each BLAS library: the pass sizes M at which a row's GEMM output differs from the same row in a pass of
    8,192 tokens (split-K chosen by M), over M = 1..4,096; and each library's speed at a few M."""
    print("default blas library", torch.backends.cuda.preferred_blas_library(), flush=True)
    shapes = {"gdn_in": (12352, 2560), "out": (2560, 4096), "gate_up": (18432, 2560), "down": (2560, 9216)}
    sizes = sorted(set(range(1, 129)) | set(range(129, 4097, 13)) | {256, 512, 1024, 2048, 4096})
    for library in ("cublaslt", "cublas"):
        torch.backends.cuda.preferred_blas_library(library)
        for name, (n, k) in shapes.items():
            torch.manual_seed(0)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(8192, k, device="cuda", dtype=torch.bfloat16)
            full = F.linear(x, w)
            differ = [m for m in sizes if not torch.equal(F.linear(x[:m], w), full[:m])]
            ranges = f"{differ[0]}..{differ[-1]} ({len(differ)} sizes)" if differ else "none"
            times = []
            for m in (64, 218, 1000, 6540):
                xm = x[:m].contiguous()
                times.append(f"{m}:{cuda_ms(lambda xm=xm, w=w: F.linear(xm, w), repeat=20):.3f}")
            print(f"{library} {name}: differ at M={ranges}; ms {' '.join(times)}", flush=True)
    try:
        a = torch.randn(64, 2560, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(2560, 512, device="cuda", dtype=torch.bfloat16)
        print("mm out_dtype fp32:", torch.mm(a, b, out_dtype=torch.float32).dtype, flush=True)
    except Exception as error:  # noqa: BLE001
        print("mm out_dtype fp32 unsupported:", repr(error)[:200], flush=True)


KEV4B_HEADS = (16, 32, 128, 128)  # DeltaNet key heads, value heads, key dim, value dim


def delta_rule_inputs(T: int):
    """Random bf16 conv output [T, conv_dim] with its q, k, v views and raw gates a, b [T, Hv] (strided, as slices of
    the projection), at Kev-4B's DeltaNet shapes."""
    H, HV, K, V = KEV4B_HEADS
    mixed = torch.randn(T, 2 * H * K + HV * V, device="cuda", dtype=torch.bfloat16)
    q = mixed[:, : H * K].view(T, H, K)
    k = mixed[:, H * K : 2 * H * K].view(T, H, K)
    v = mixed[:, 2 * H * K :].view(T, HV, V)
    gates = torch.randn(T, 2 * HV, device="cuda", dtype=torch.bfloat16)
    return mixed, q, k, v, gates[:, :HV], gates[:, HV:]


def recurrent_configs() -> None:
    """The delta-rule kernel's (value block, warps) on Kev-4B heads: 192 rows of 39 tokens (a busy short6 batch)
    and 6 rows (one short6 request), rows continuing banked states."""
    from kev_backend.gpu import kernels
    from kev_backend.gpu.kernels import delta_rule

    _, HV, K, V = KEV4B_HEADS
    pool = torch.randn(256, HV, K, V, device="cuda") * 0.01
    # (segments, tokens each, new states): one short6 request's rows, a busy batch's, one short6's new state, 32.
    for rows, length, new in ((6, 39, False), (40, 40, False), (192, 39, False), (1, 40, True), (32, 40, True)):
        T = rows * length
        _, q, k, v, a, b = delta_rule_inputs(T)
        a_log, dt_bias = torch.randn(HV, device="cuda"), torch.randn(HV, device="cuda")
        slots = torch.randperm(256, device="cuda")[:rows]  # distinct: new states write their slots
        cu = torch.arange(0, T + 1, length, device="cuda")
        line = []
        chosen = delta_rule.RECURRENT_BV, delta_rule.RECURRENT_WARPS
        args = (q, k, v, a, b, a_log, dt_bias, pool, slots, cu)
        run = lambda args=args, new=new: kernels.recurrent_rows(*args, new_states=new)  # noqa: E731
        reference = run().float()
        for bv, warps in ((16, 1), (8, 1), (4, 1), (16, 2), (32, 2)):
            delta_rule.RECURRENT_BV, delta_rule.RECURRENT_WARPS = bv, warps  # read at each launch
            diff = (run().float() - reference).abs().max().item()
            line.append(f"BV{bv}/w{warps}:{cuda_ms(run):.3f}ms({diff:.0e})")
        delta_rule.RECURRENT_BV, delta_rule.RECURRENT_WARPS = chosen
        print(f"recurrent {'new' if new else 'rows'}={rows}x{length}:", " ".join(line), flush=True)


def long_segments(only_rows: bool = False) -> None:
    """Our chunked delta rule against fla's chunked kernel on Kev-4B heads (new states from zero; rows continuing
    banked states): time and largest difference; on short segments our token-by-token kernel too. And the conv for
    new states: fla's against our token-by-token one."""
    for lengths, new in (
        ([2200], True),
        ([2200] * 8, True),
        ([2200] * 24, True),
        ([100] * 40, False),
        ([39] * 192, False),
        ([34] * 32, True),
        ([39] * 6, False),  # one short6 request's rows and state: latency, where the chunked kernel's 3 steps
        ([34], True),  # might beat the token-by-token kernel's 39
    ):
        if not (only_rows and new):
            long_case(lengths, new)


def segments_case(lengths: list[int]):
    """Seeded delta-rule inputs for segments of these lengths (delta_rule_inputs), gate constants, a bank of one slot
    per segment plus scratch, its slots and the offsets on the host and the GPU."""
    from kev_backend.gpu.passes import offsets

    _, HV, K, V = KEV4B_HEADS
    torch.manual_seed(0)
    mixed, q, k, v, a, b = delta_rule_inputs(sum(lengths))
    a_log, dt_bias = torch.randn(HV, device="cuda") * 0.5, torch.randn(HV, device="cuda")
    pool = torch.randn(len(lengths) + 1, HV, K, V, device="cuda") * 0.05
    cu_cpu = torch.tensor(offsets(lengths))
    return mixed, q, k, v, a, b, a_log, dt_bias, pool, torch.arange(len(lengths), device="cuda"), cu_cpu, cu_cpu.cuda()


def sweep_entry(name: str, run, reference: torch.Tensor | None, timer=None) -> tuple[str, torch.Tensor | None]:
    """One setting of a kernel sweep: "NAME ms (largest difference from the reference)", or why it did not run; and
    the reference (the sweep's first output)."""
    try:
        out = run().float()
    except Exception as error:  # noqa: BLE001 (a setting that does not compile: reported, skipped)
        return f"{name} failed {type(error).__name__}", reference
    reference = out if reference is None else reference
    return f"{name} {(timer or graph_ms)(run):.4f} ({(out - reference).abs().max().item():.1e})", reference


def chunk_variants() -> None:
    """The chunked delta rule by the sequential pass's (value block, warps, register cap, product operands) and the
    prep's warps on Kev-4B heads: ms for new long states one at a time and many at once (throughput: programs sharing
    SMs), and rows; the largest difference from the first (the default)."""
    from kev_backend.gpu import kernels
    from kev_backend.gpu.kernels import delta_rule as R

    names = ("CHUNK_NARROW", "CHUNK_WIDE", "CHUNK_DOTS", "PREP_WARPS")
    chosen = tuple(getattr(R, name) for name in names)
    # The default (the chain's configuration chosen by program count), then: its tf32 form, and configurations forced
    # on every pass: (value block, warps, register cap) twice, chain operands, prep warps.
    narrow, wide = chosen[:2]
    variants = [
        chosen,
        (narrow, wide, "tf32", chosen[3]),
        (narrow, wide, "bf16", 4),
        (narrow, narrow, "bf16", chosen[3]),
        (wide, wide, "bf16", chosen[3]),
        ((16, 1, None), (16, 1, None), "bf16", 2),
        ((16, 2, None), (16, 2, None), "bf16", 2),
        ((32, 2, None), (32, 2, None), "bf16", 2),
        ((64, 8, None), (64, 8, None), "bf16", 2),
    ]

    def describe(variant) -> str:
        narrow, wide, *rest = variant
        chain = "auto" if (narrow, wide) == chosen[:2] and narrow != wide else "/".join(map(str, narrow))
        return "/".join(map(str, [chain, *rest]))

    for lengths, new in (([2200], True), ([2200] * 8, True), ([2200] * 24, True), ([100] * 40, False)):
        _, q, k, v, a, b, a_log, dt_bias, pool, slots, _, cu = segments_case(lengths)
        n = len(lengths)
        args = (q, k, v, a, b, a_log, dt_bias, pool, slots, cu)
        run = lambda args=args, new=new: kernels.chunked_rows(*args, new_states=new)  # noqa: E731
        reference, line = None, []
        for variant in variants:
            for name, value in zip(names, variant, strict=True):
                setattr(R, name, value)
            entry, reference = sweep_entry(describe(variant), run, reference, cuda_ms)
            line.append(entry)
        label = f"{n}x{lengths[0]} {'new' if new else 'rows'}"
        print(f"chunkvariants {label}: " + ", ".join(line), flush=True)
    for name, value in zip(names, chosen, strict=True):
        setattr(R, name, value)


def chain_waves() -> None:
    """The chained pass's value block by new long-state count: a program per (state, value head, value block), each
    carrying its state through all of its chunks, so a launch whose programs fill part of a last wave of resident
    programs waits a whole program's time for it (64 columns: 64 programs a state, two an SM: 264 slots on the H200;
    13 states make 3.15 waves, run in 4). Prep and chain ms a layer, from a CUDA graph, for 1-24 new 2,465-token states,
    narrow (CHUNK_NARROW) and wide (CHUNK_WIDE) forced, and the choice by count; the outputs must not differ."""
    from kev_backend.gpu import kernels
    from kev_backend.gpu.kernels import delta_rule as R

    narrow, wide = R.CHUNK_NARROW, R.CHUNK_WIDE
    for n in (1, 2, 4, 6, 8, 10, 12, 13, 14, 16, 17, 18, 20, 24):
        _, q, k, v, a, b, a_log, dt_bias, pool, slots, _, cu = segments_case([2465] * n)
        args = (q, k, v, a, b, a_log, dt_bias, pool, slots, cu)
        run = lambda args=args: kernels.chunked_rows(*args, new_states=True)  # noqa: E731
        line, reference = [], None
        for name, (R.CHUNK_NARROW, R.CHUNK_WIDE) in {
            "by count": (narrow, wide),
            "narrow": (narrow, narrow),
            "wide": (wide, wide),
        }.items():
            entry, reference = sweep_entry(name, run, reference)
            line.append(entry)
        R.CHUNK_NARROW, R.CHUNK_WIDE = narrow, wide
        print(f"chainwaves {n}x2465: " + ", ".join(line), flush=True)


def prep_registers() -> None:
    """The chunked delta rule (prep and chain) by the prep's warps and register cap (PREP_WARPS, PREP_MAXNREG): ms a
    layer, replayed from a CUDA graph, for 1 / 8 / 24 new long5-sized states (2,465 tokens) and one short6's rows; the
    largest difference from the default; the prep's own µs. A cap that fits more programs an SM may hide more of the
    prep's latency (230 registers on 2 warps: four an SM) or spill."""
    from kev_backend.gpu import kernels
    from kev_backend.gpu.kernels import delta_rule as R

    chosen = R.PREP_WARPS, R.PREP_MAXNREG
    # More warps for 32-token chunks (KEV_CHUNK=32), whose tiles spill on 2 (1,780 bytes at the cap, sm_90a).
    settings = [chosen, (2, None), (2, 144), (2, 192), (4, None), (4, 168), (8, None)]
    for lengths, new in (([2465], True), ([2465] * 8, True), ([2465] * 24, True), ([31] * 6, False)):
        _, q, k, v, a, b, a_log, dt_bias, pool, slots, _, cu = segments_case(lengths)
        args = (q, k, v, a, b, a_log, dt_bias, pool, slots, cu)
        run = lambda args=args, new=new: kernels.chunked_rows(*args, new_states=new)  # noqa: E731
        line, reference = [], None
        for R.PREP_WARPS, R.PREP_MAXNREG in settings:
            entry, reference = sweep_entry(f"{R.PREP_WARPS}/{R.PREP_MAXNREG}", run, reference)
            prep_us = sum(us for name, us in graph_kernel_us(run).items() if "prep" in name)
            line.append(f"{entry} [prep {prep_us:.1f} µs]")
        R.PREP_WARPS, R.PREP_MAXNREG = chosen
        print(f"prepregs {len(lengths)}x{lengths[0]} {'new' if new else 'rows'}: " + ", ".join(line), flush=True)


def launch_rounds() -> None:
    """Captured groups' chain (programs taking items in turn) by LAUNCH_ROUNDS and the narrow configuration (value
    block, warps): prep and chain, ms a layer from a CUDA graph, for one short6's rows in r192 (48 slots), long5's
    five rows in r256 (64), 32 short6 requests' rows in r6144 (1,536) and one long5 state in s2560's long group (20);
    the largest difference from the default."""
    from kev_backend.gpu import kernels
    from kev_backend.gpu.kernels import delta_rule as R

    chosen = R.LAUNCH_ROUNDS, R.CHUNK_NARROW
    rounds = [r for r in (1, 2, 4) if r != chosen[0]]
    settings = [chosen, *((r, chosen[1]) for r in rounds), (2, (16, 2, None)), (4, (16, 2, None)), (2, (16, 1, None))]
    for label, lengths, capacity, new in (
        ("short6 rows r192", [31] * 6, 48, False),
        ("long5 rows r256", [38, 52, 26, 30, 20], 64, False),
        ("32 short6 rows r6144", [31] * 192, 1536, False),
        ("long5 state s2560", [2465], 20, True),
    ):
        _, q, k, v, a, b, a_log, dt_bias, pool, slots, _, cu = segments_case(lengths)
        n = len(lengths)
        slots = torch.cat([slots, torch.full((capacity - n,), n, device="cuda", dtype=slots.dtype)])
        cu = torch.cat([cu, cu[-1:].repeat(capacity - n)])
        args = (q, k, v, a, b, a_log, dt_bias, pool, slots, cu)
        run = lambda args=args, new=new: kernels.chunked_rows(*args, new_states=new, padded=True)  # noqa: E731
        line, reference = [], None
        for R.LAUNCH_ROUNDS, R.CHUNK_NARROW in settings:
            name = f"{R.LAUNCH_ROUNDS}x{'/'.join(map(str, R.CHUNK_NARROW[:2]))}"
            entry, reference = sweep_entry(name, run, reference)
            line.append(entry)
        R.LAUNCH_ROUNDS, R.CHUNK_NARROW = chosen
        print(f"rounds {label}: " + ", ".join(line), flush=True)


def padded_groups() -> None:
    """The delta rule on a captured pass's groups, whose segments count the bucket's capacity and end in empty padding
    segments on a scratch slot: a program per item against programs taking items in turn (`padded`,
    kernels.delta_rule.LAUNCH_ROUNDS; the token-by-token kernel with RECURRENT_LOOP), and the same segments unpadded.
    ms a layer on Kev-4B heads, replayed from a CUDA graph as a captured pass runs them (eager calls of one request's
    groups are bound by host launches: ~0.14 ms a call on the H200 whatever the setting). Outputs must be
    identical."""
    from kev_backend.gpu import kernels
    from kev_backend.gpu.kernels import delta_rule as R

    # (label, segment lengths, capacity, new states): one short6 request's rows in r192 (48 row slots) and its state
    # in s64 (8), 32 short6 requests' rows in r6144 (1,536), one long5 state in s2560's long group (20), and long
    # groups of three and six states in s4096's (32). A long group also runs with its first segment apart.
    for label, lengths, capacity, new in (
        ("short6 rows r192", [31] * 6, 48, False),
        ("short6 state s64", [33], 8, True),
        ("32 short6 rows r6144", [31] * 192, 1536, False),
        ("long5 state s2560", [2200], 20, True),
        ("long5 rows r768", [100] * 5, 192, False),
        ("three long states s4096", [1500, 900, 600], 32, True),
        ("six long states s4096", [600] * 6, 32, True),
    ):
        _, q, k, v, a, b, a_log, dt_bias, pool, slots, _, cu = segments_case(lengths)
        n = len(lengths)
        scratch = torch.full((capacity - n,), n, device="cuda", dtype=slots.dtype)  # segments_case's spare slot
        padded_slots = torch.cat([slots, scratch])
        padded_cu = torch.cat([cu, cu[-1:].repeat(capacity - n)])
        kernel_names = ["chunked"] + (["recurrent"] if max(lengths) <= 64 else [])
        for name in kernel_names:
            kernel = kernels.chunked_rows if name == "chunked" else kernels.recurrent_rows
            line, reference = [], None
            wide = R.CHUNK_WIDE
            per_sm = R.CHUNK_PER_SM
            settings = {
                "unpadded": (slots, cu, False, False, per_sm, False),
                "per item": (padded_slots, padded_cu, False, False, per_sm, False),
                "in turn": (padded_slots, padded_cu, True, True, per_sm, False),
                "in turn 1/SM": (padded_slots, padded_cu, True, True, 1, False),
            }
            if new and name == "chunked" and max(lengths) > 64:  # a long group: its first segment apart (LEAD_APART)
                settings |= {
                    "lead apart": (padded_slots, padded_cu, True, True, per_sm, True),
                    "lead apart, rest 1/SM": (padded_slots, padded_cu, True, True, 1, True),
                }
            for setting, (use_slots, use_cu, padded, loop, chunk_per_sm, lead_apart) in settings.items():
                # per item: narrow, as a padded group ran before LAUNCH_ROUNDS. 1/SM: the chain's programs taking items
                # in turn one an SM (does a second program on an SM, or co-resident empty ones, slow a long state's
                # chain?); with the lead apart, the rest's.
                R.RECURRENT_LOOP, R.CHUNK_WIDE = loop, R.CHUNK_NARROW if setting == "per item" else wide
                R.CHUNK_PER_SM = chunk_per_sm
                extra = {"lead_apart": True} if lead_apart else {}
                args = (q, k, v, a, b, a_log, dt_bias, pool, use_slots, use_cu)
                run = lambda kernel=kernel, args=args, new=new, padded=padded, extra=extra: kernel(  # noqa: E731
                    *args, new_states=new, padded=padded, **extra
                )
                out = run().float()
                reference = out if reference is None else reference
                same = torch.equal(out, reference)
                # Each kernel's share (the chunked rule's prep and chain), from a profiled replay.
                parts = " ".join(
                    f"{kernel_name.strip('_').split('_kernel')[0]} {us:.1f}"
                    for kernel_name, us in graph_kernel_us(run).items()
                    if "delta_rule" in kernel_name or "prep" in kernel_name or "recurrent" in kernel_name
                )
                line.append(f"{setting} {graph_ms(run):.4f} [{parts} µs]{'' if same else ' DIFFERS'}")
            R.CHUNK_WIDE, R.CHUNK_PER_SM = wide, per_sm
            R.RECURRENT_LOOP = False
            print(f"padded {label} {name}: " + ", ".join(line), flush=True)


def rows_attention_tiles() -> None:
    """Rows' attention by (query rows per program, keys per step, pipeline stages, SPLIT_DIAGONAL, EXP2) on Kev-4B
    heads (16 query heads, 4 key/value heads of 256): ms for one long5 (five rows over a 2,200-token state), the same
    with its K/V in one contiguous run (whether the pool's page gather bounds the key loop), a 64-client long5 batch
    (17 of them), one short6 on its banked state (six rows over 34 tokens) and a busy short6 batch (32 of them); and
    each variant's largest output difference from the default."""
    from kev_backend.gpu.kernels import attention as A

    HQ, HKV, D, PAGE = 16, 4, 256, 64
    row_lengths = [44, 57, 41, 36, 47, 40]
    cases = {
        "long5": (1, 2200, 5, False),
        "long5contig": (1, 2200, 5, True),
        "long5x17": (17, 2200, 5, False),
        "short6same": (1, 34, 6, False),
        "short6x32": (32, 34, 6, False),
    }
    # (rows, keys, stages, SPLIT_DIAGONAL, EXP2)
    default = (A.TILE_ROWS, A.WIDE_HEAD_KEYS, A.WIDE_HEAD_STAGES, A.SPLIT_DIAGONAL, A.EXP2)
    variants = [(64, 32, 3, False, False), (64, 32, 3, True, True), (64, 32, 2, True, True), (64, 64, 2, False, False)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for label, (states, prefix_len, rows, contiguous) in cases.items():
        pages = -(-prefix_len // PAGE)
        pool_tokens = states * pages * PAGE
        kp = torch.randn(pool_tokens, HKV, D, device="cuda", generator=gen).bfloat16()
        vp = torch.randn(pool_tokens, HKV, D, device="cuda", generator=gen).bfloat16()
        # Each state's tokens in whole 64-token pages (as the bank keeps them), pages in random order; or one run.
        order = torch.arange(states * pages, device="cuda")
        if not contiguous:
            order = order[torch.randperm(states * pages, device="cuda", generator=gen)]
        within = torch.arange(PAGE, device="cuda")
        runs = (order.view(states, pages, 1) * PAGE + within).view(states, pages * PAGE)[:, :prefix_len]
        prefix = runs.reshape(-1)
        lengths = [row_lengths[r] for _ in range(states) for r in range(rows)]
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
        starts = torch.tensor([s * prefix_len for s in range(states) for _ in range(rows)], device="cuda")
        plens = torch.full_like(starts, prefix_len)
        T = int(cu[-1])
        q = torch.randn(T, HQ, D, device="cuda", generator=gen).bfloat16()
        k = torch.randn(T, HKV, D, device="cuda", generator=gen).bfloat16()
        v = torch.randn(T, HKV, D, device="cuda", generator=gen).bfloat16()
        outputs = {}
        run = functools.partial(A.rows_attention, q, k, v, kp, vp, prefix, starts, plens, cu, max(lengths))
        for variant in [default, *[other for other in variants if other != default]]:
            A.TILE_ROWS, A.WIDE_HEAD_KEYS, A.WIDE_HEAD_STAGES, A.SPLIT_DIAGONAL, A.EXP2 = variant
            try:
                outputs[variant] = run().float()
            except Exception as error:  # noqa: BLE001 (a variant that does not fit shared memory: reported)
                print(f"rowsattn {label:11s} {variant}: failed {type(error).__name__}", flush=True)
                continue
            ms = cuda_ms(run, repeat=20)
            diff = (outputs[variant] - outputs[default]).abs().max().item()
            tile_rows, keys, stages, split, exp2 = variant
            print(
                f"rowsattn {label:11s} rows {tile_rows:3d} keys {keys:3d} stages {stages} split {split:d} exp2 "
                f"{exp2:d}: {ms:.4f} ms, "
                f"max diff {diff:.2e}",
                flush=True,
            )
        A.TILE_ROWS, A.WIDE_HEAD_KEYS, A.WIDE_HEAD_STAGES, A.SPLIT_DIAGONAL, A.EXP2 = default


def long_attention_tiles() -> None:
    """New long states' causal attention (Kev-4B heads: 16 query heads, 4 key/value heads of 256): torch's varlen
    attention (FlashAttention 2, the pass's) against our rows' kernel without a prefix, by (query rows per program,
    keys per step, warps); ms for one and eight 2,200-token states and the largest difference from varlen's output."""
    from torch.nn.attention.varlen import varlen_attn

    from kev_backend.gpu.kernels import attention as A

    HQ, HKV, D = 16, 4, 256
    chosen = A.LONG_TILE_ROWS, A.WIDE_HEAD_KEYS, A.WIDE_HEAD_WARPS, A.WIDE_HEAD_STAGES, A.SPLIT_DIAGONAL, A.EXP2
    gen = torch.Generator(device="cuda").manual_seed(0)
    for states in (1, 8):
        lengths = [2200 - 37 * i for i in range(states)]
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
        cu32 = cu.to(torch.int32)
        T = int(cu[-1])
        q = torch.randn(T, HQ, D, device="cuda", generator=gen).bfloat16()
        k = torch.randn(T, HKV, D, device="cuda", generator=gen).bfloat16()
        v = torch.randn(T, HKV, D, device="cuda", generator=gen).bfloat16()
        flops = sum(n * (n + 1) / 2 for n in lengths) * HQ * D * 4
        fa = functools.partial(varlen_attn, q, k, v, cu32, cu32, max(lengths), max(lengths), window_size=(-1, 0))
        reference = fa().float()
        ms = cuda_ms(fa)
        print(f"longattn {states}x2200 varlen: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
        for name, run in sdpa_variants(q, k, v, lengths).items():
            print(f"longattn {states}x2200 sdpa {name}: {attention_result(run, reference, flops)}", flush=True)
        ours = functools.partial(A.rows_attention, q, k, v, k, v, None, None, None, cu, max(lengths))
        # (rows, keys, warps, stages) and (SPLIT_DIAGONAL, EXP2); the first the default.
        for tile, (A.SPLIT_DIAGONAL, A.EXP2) in (
            (chosen[:4], chosen[4:]),
            ((128, 32, 8, 3), (True, True)),
            ((128, 32, 8, 3), (False, False)),
            ((128, 64, 4, 2), (True, True)),
            ((128, 128, 8, 1), (True, True)),
            ((64, 64, 8, 2), (True, True)),
        ):
            A.LONG_TILE_ROWS, A.WIDE_HEAD_KEYS, A.WIDE_HEAD_WARPS, A.WIDE_HEAD_STAGES = tile
            print(
                f"longattn {states}x2200 ours rows {A.LONG_TILE_ROWS} keys {A.WIDE_HEAD_KEYS} warps "
                f"{A.WIDE_HEAD_WARPS} stages {A.WIDE_HEAD_STAGES} split {A.SPLIT_DIAGONAL:d} exp2 {A.EXP2:d}: "
                f"{attention_result(ours, reference, flops)}",
                flush=True,
            )
        A.LONG_TILE_ROWS, A.WIDE_HEAD_KEYS, A.WIDE_HEAD_WARPS, A.WIDE_HEAD_STAGES, A.SPLIT_DIAGONAL, A.EXP2 = chosen


def attention_result(run, reference: torch.Tensor, flops: float) -> str:
    """One attention variant's ms, TFLOP/s and largest difference from the reference output, or why it did not run."""
    try:
        diff = (run().float() - reference).abs().max().item()
        ms = cuda_ms(run)
    except Exception as error:  # a backend refusing these shapes, a tile out of shared memory: report, go on
        return f"failed: {type(error).__name__}: {str(error)[:80]}"
    return f"{ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s), max diff {diff:.1e}"


def sdpa_variants(q, k, v, lengths: list[int]) -> dict:
    """torch's scaled_dot_product_attention by backend, a call per state ([1, heads, n, D] views of the packed
    [T, heads, D] tensors), key/value heads shared (enable_gqa) or repeated: each a function writing the packed
    [T, HQ, D] output."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    groups = q.shape[1] // k.shape[1]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]

    def run(backend, gqa: bool):
        out = torch.empty_like(q)
        with sdpa_kernel(backend):
            for start, n in zip(starts, lengths):
                qq, kk, vv = (x[start : start + n].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                if not gqa:
                    kk, vv = kk.repeat_interleave(groups, dim=1), vv.repeat_interleave(groups, dim=1)
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=gqa)
                out[start : start + n] = o[0].transpose(0, 1)
        return out

    backends = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    return {
        f"{name}{' gqa' if gqa else ' repeated'}": functools.partial(run, backend, gqa)
        for name, backend in backends.items()
        for gqa in (True, False)
    }


def ncu_probe() -> None:
    """Three calls each (the first two warm) of the chunked delta rule on 8 new 2,200-token states and of the
    token-by-token one on 6 rows of 40 tokens: for Nsight Compute to profile the third (bench/gpu_run.sh ncu)."""
    from kev_backend.gpu import kernels

    _, HV, K, V = KEV4B_HEADS
    for lengths, new in (([2200] * 8, True), ([40] * 6, False)):
        T, n = sum(lengths), len(lengths)
        _, q, k, v, a, b = delta_rule_inputs(T)
        a_log, dt_bias = torch.randn(HV, device="cuda"), torch.randn(HV, device="cuda")
        pool = torch.randn(n + 1, HV, K, V, device="cuda") * 0.01
        slots = torch.arange(n, device="cuda")
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
        rule = kernels.chunked_rows if new else kernels.recurrent_rows
        for _ in range(3):
            rule(q, k, v, a, b, a_log, dt_bias, pool, slots, cu, new_states=new)
        torch.cuda.synchronize()


def request_timeline() -> None:
    """Where one request's model time goes besides its kernels (KEV_GRAPHS=1: as the GPU config runs it), new state
    and same state, for each workload of KEV_TIMELINE_SHAPES (default short6): model time (launch to probabilities
    on the host) against the GPU's busy time, the wait from launch to its first kernel, the idle gaps between
    kernels, and from the last kernel to the answer; then the host functions of 20 requests on new states of the
    first workload by own time (cProfile)."""
    import os

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    from kev_backend.dev import bench

    from kev_backend.dev import workloads

    engine = kev4b_engine()
    shapes = os.environ.get("KEV_TIMELINE_SHAPES", "short6").split(",")
    cases = [
        (f"{shape} {label}", make)
        for shape in shapes
        for label, make in (
            ("new", lambda shape=shape: getattr(workloads, shape)(next(bench.NEW_STATE))),
            ("same", lambda shape=shape: getattr(workloads, shape)(None)),
        )
    ]
    for label, make in cases:
        for _ in range(5):
            engine.answer([make()])
        torch.cuda.synchronize()
        body = make()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("kev_answer"):
                engine.answer([body])
            model_ms = engine.last_batch.model_ms
        events = prof.events()
        kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
        call = next(e.time_range for e in events if e.name == "kev_answer" and e.device_type == DeviceType.CPU)
        busy, gaps, end = 0.0, [], kernels[0][0]
        for lo, hi in kernels:
            if lo > end:
                gaps.append(lo - end)
            busy += max(0.0, hi - max(lo, end))
            end = max(end, hi)
        span = (kernels[-1][1] - kernels[0][0]) / 1000
        print(
            f"timeline {label}: model {model_ms:.2f} ms, kernels {len(kernels)} over {span:.2f} ms, busy "
            f"{busy / 1000:.2f} ms, {len(gaps)} gaps {sum(gaps) / 1000:.2f} ms (over 5 us: "
            f"{sum(g for g in gaps if g > 5) / 1000:.2f} ms); answer call {(call.end - call.start) / 1000:.2f} ms, "
            f"its first kernel after {(kernels[0][0] - call.start) / 1000:.2f} ms, its end "
            f"{(call.end - kernels[-1][1]) / 1000:.2f} ms after the last",
            flush=True,
        )
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        engine.answer([getattr(workloads, shapes[0])(next(bench.NEW_STATE))])
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(22)


def launch_path() -> None:
    """Whether a graph's launch delays its first kernel (KEV_GRAPHS=1): a short6 on its banked state and a new long5
    are answered once, then their buckets' graphs replayed with those inputs, plainly and behind a ~2 ms sleep kernel
    (the launch done while the GPU sleeps): the host time of replay(), the GPU time from before the replay to after
    it, and from the sleep's end. The plain figure less the one behind the sleep is what the launch adds."""
    from kev_backend.dev import bench
    from kev_backend.dev.workloads import long5, short6

    engine = kev4b_engine(graphs=True, long_kernels="ours")
    graphs = engine.scorer.graphs
    timer = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    for label, make in (("short6 same", lambda: short6(None)), ("long5 new", lambda: long5(next(bench.NEW_STATE)))):
        for _ in range(3):
            engine.answer([make()])
        bucket = next(reversed(graphs.graphs))  # the last replayed moves to the end
        graph = graphs.graphs[bucket][0]
        torch.cuda.synchronize()
        for behind_sleep in (False, True, False, True):
            start, slept, end = timer(), timer(), timer()
            start.record()
            if behind_sleep:
                torch.cuda._sleep(4_000_000)
            slept.record()
            t = time.perf_counter()
            graph.replay()
            host_ms = (time.perf_counter() - t) * 1000
            end.record()
            torch.cuda.synchronize()
            print(
                f"launch {label} {bucket.name} {'behind sleep' if behind_sleep else 'plain'}: replay() {host_ms:.3f} "
                f"ms on the host, GPU {start.elapsed_time(end):.3f} ms, from the sleep's end "
                f"{slept.elapsed_time(end):.3f} ms",
                flush=True,
            )


def host_split() -> None:
    """Where one request's model time (launch to probabilities on the host) goes, from graphs (KEV_GRAPHS=1), for
    short6 and long5 on new and banked states: the host's phases before the replay (bank, layout, bucket, fill), the
    replay() call and the head's launches, each timed on the host, against the GPU's spans from the launch to the
    graph's start, the graph (which starts with the fill and replay() on the host), and the head's projection and
    softmax after it; the rest ("after gpu") is the copy to the host, the wait and the lists. Medians of 30."""
    import statistics

    from kev_backend.dev import bench
    from kev_backend.dev.workloads import long5, short6

    engine = kev4b_engine(graphs=True, long_kernels="ours")
    scorer = engine.scorer
    graphs = scorer.graphs
    host: dict[str, float] = {}
    marks: dict[str, torch.cuda.Event] = {}

    def timed(name: str, fn, mark: str | None = None):
        def wrapper(*args, **kwargs):
            if mark is not None:
                marks[f"{mark} start"] = event = torch.cuda.Event(enable_timing=True)
                event.record()
            started = time.perf_counter()
            out = fn(*args, **kwargs)
            host[name] = host.get(name, 0.0) + (time.perf_counter() - started) * 1000
            if mark is not None:
                marks[f"{mark} end"] = event = torch.cuda.Event(enable_timing=True)
                event.record()
            return out

        return wrapper

    scorer.layout = timed("layout", scorer.layout)
    graphs.bucket_for = timed("bucket", graphs.bucket_for)
    graphs.inputs.fill = timed("fill", graphs.inputs.fill)
    graphs.run = timed("run", graphs.run, mark="graph")  # the fill, then the replay (run's host time less fill's)
    scorer.pointer.project = timed("project", scorer.pointer.project)  # the head: its projection, then softmax
    scorer.pointer.softmax = timed("head", scorer.pointer.softmax, mark="head")
    scorer._launch = timed("launch", scorer._launch, mark="launch")
    cases = (
        ("short6 same", lambda: short6(None)),
        ("short6 new", lambda: short6(next(bench.NEW_STATE))),
        ("long5 same", lambda: long5(None)),
        ("long5 new", lambda: long5(next(bench.NEW_STATE))),
    )
    for label, make in cases:
        rows: list[dict[str, float]] = []
        for i in range(35):
            batch = engine.prepare_batch([make()])
            torch.cuda.synchronize()
            host.clear()
            marks.clear()
            engine.score(batch)
            torch.cuda.synchronize()
            if i < 5:
                continue

            def gpu(a: str, b: str) -> float:
                return marks[a].elapsed_time(marks[b])

            rows.append(
                {
                    "model": engine.last_batch.model_ms,
                    "host launch": host["launch"],
                    "layout": host["layout"],
                    "bucket": host["bucket"],
                    "fill": host["fill"],
                    "replay": host["run"] - host["fill"],
                    "head launch": host["head"] + host["project"],
                    "other host": host["launch"]
                    - host["layout"]
                    - host["bucket"]
                    - host["run"]
                    - host["head"]
                    - host["project"],
                    "gpu to graph": gpu("launch start", "graph start"),
                    "gpu graph": gpu("graph start", "graph end"),
                    "gpu head": gpu("graph end", "head end"),
                    "after gpu": engine.last_batch.model_ms - gpu("launch start", "head end"),
                }
            )
        medians = {name: statistics.median(row[name] for row in rows) for name in rows[0]}
        print(f"hostsplit {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()), flush=True)


def host_path() -> None:
    """The host's work before a pass can start, on this machine's CPU (no GPU needed): the scorer's plan, the bank,
    the layout and the fill of a graph bucket's buffers for long5 and short6 requests on new states, and short6 on its
    banked state (the pass itself
    stubbed), µs, medians of 40 after 5, on the tiny model with the fused path's bookkeeping at full size (graphs up to
    4,096 tokens, 1 GiB bank)."""
    import statistics
    from dataclasses import fields

    from kev_backend.dev import bench

    from kev_backend.dev import tiny
    from kev_backend.engine.engine import Engine, EngineOptions
    from kev_backend.gpu.fused import PassKernels
    from kev_backend.gpu.scorer import FusedScorer, Row
    from kev_backend.dev.workloads import long5, short6

    directory = Path(tempfile.mkdtemp())
    tiny.build(directory)
    reference = Engine.from_checkpoint(directory / "kev", EngineOptions(bank_bytes=0))
    ck = reference.checkpoint
    no_kernels = PassKernels(*[None] * len(fields(PassKernels)))  # the pass is stubbed: no kernel runs
    scorer = FusedScorer(
        ck.model,
        ck.head,
        ck.temperature,
        reference.tokenizer.delimiters.pad,
        bank_bytes=1 << 30,
        dtype=torch.float32,
        kernels=no_kernels,
        graphs=True,
        long_kernels="ours",
    )
    graphs = scorer.graphs
    phases: dict[str, float] = {}

    def timed(name: str, fn):
        def wrapper(*args):
            started = time.perf_counter()
            out = fn(*args)
            phases[name] = (time.perf_counter() - started) * 1e6
            return out

        return wrapper

    scorer.layout = timed("layout", scorer.layout)
    graphs.inputs.fill = timed("fill", graphs.inputs.fill)
    picked = torch.zeros(512, ck.model.config.hidden_size)

    def stubbed_run(bucket, layout):  # PassGraphs.run without the replay
        graphs.inputs.fill(bucket, layout, scorer.bank.pool, scorer.pad_id)
        return picked[: len(layout.row_picks)]

    graphs.run = stubbed_run
    for label, make, state in (("long5", long5, "new"), ("short6", short6, "new"), ("short6", short6, "same")):
        runs = []
        for _ in range(45):
            _, encoded = reference.prepare(make(next(bench.NEW_STATE) if state == "new" else None))
            rows = [Row(0, q, tokens, encoded.state) for q, tokens in enumerate(encoded.questions)]
            started = time.perf_counter()
            for group in scorer.plan(rows):
                scorer.run_group(group)
            runs.append({"before the pass": (time.perf_counter() - started) * 1e6, **phases})
        medians = {name: statistics.median(run[name] for run in runs[5:]) for name in runs[0]}
        print(f"hostpath {label} {state} (µs): " + ", ".join(f"{k} {v:.0f}" for k, v in medians.items()), flush=True)


def host_ops() -> None:
    """What the host's primitive steps cost on this machine, µs a call (median of 5 runs of 200): a Python loop, a
    small kernel launch, CUDA events, a pinned copy, numpy writing a list into pinned memory; then short6's layout and
    fill alone (a banked state's rows, from graphs): whether hostsplit's phases are this CPU or something in them."""
    import statistics

    from kev_backend.dev.workloads import short6

    def us(fn, n: int = 200) -> float:
        runs = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(n):
                fn()
            runs.append((time.perf_counter() - started) / n * 1e6)
        return statistics.median(runs)

    x = torch.zeros(256, device="cuda")
    pinned = torch.zeros(4096, dtype=torch.int64, pin_memory=True)
    flat = torch.zeros(4096, dtype=torch.int64, device="cuda")
    values = list(range(192))
    done = torch.cuda.Event()
    done.record()
    torch.cuda.synchronize()

    def loop() -> None:
        total = 0
        for i in range(1000):
            total += i

    def numpy_write() -> None:
        pinned.numpy()[:192] = values

    cases = {
        "python 1000 adds": loop,
        "add_ launch": lambda: x.add_(1),
        "empty cuda": lambda: torch.empty(256, device="cuda"),
        "event create+record": lambda: torch.cuda.Event().record(),
        "done event synchronize": done.synchronize,
        "pinned copy 4 KB": lambda: flat[:512].copy_(pinned[:512], non_blocking=True),
        "numpy list into pinned": numpy_write,
    }
    for name, fn in cases.items():
        print(f"hostops {name}: {us(fn):.2f} us", flush=True)
        torch.cuda.synchronize()
    engine = kev4b_engine(graphs=True, long_kernels="ours")
    scorer, graphs = engine.scorer, engine.scorer.graphs
    engine.answer([short6(None)])
    batch = engine.prepare_batch([short6(None)])
    rows = [row for r, (_, _, encoded) in enumerate(batch.accepted) for row in scorer_rows(r, encoded)]
    slots = {rows[0].state: scorer.bank.get(rows[0].state)}
    layout = scorer.layout(rows, [], slots)
    bucket = graphs.bucket_for(layout)
    print(f"hostops short6 same layout: {us(lambda: scorer.layout(rows, [], slots)):.2f} us", flush=True)
    print(f"hostops short6 same bucket: {us(lambda: graphs.bucket_for(layout)):.2f} us", flush=True)
    fill = lambda: graphs.inputs.fill(bucket, layout, scorer.bank.pool, scorer.pad_id)  # noqa: E731
    print(f"hostops short6 same fill: {us(fill):.2f} us", flush=True)


def scorer_rows(request: int, encoded):
    from kev_backend.gpu.scorer import Row

    return [Row(request, q, tokens, encoded.state) for q, tokens in enumerate(encoded.questions)]


def conv_scan() -> None:
    """The pass's conv (conv_tokens) on Kev-4B's 8,192 channels, by (tokens, channels, warps) a program: ms for new
    states (1, 8 and 24 of 2,200 tokens) and rows (6×31, 6×40, 192×39, 40×100), and the largest difference from the
    token-by-token conv_rows."""
    from kev_backend.gpu import kernels

    C = 8192
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = {"new 1x2200": [2200], "new 8x2200": [2200] * 8, "new 24x2200": [2200] * 24}
    cases |= {"rows 6x31": [31] * 6, "rows 6x40": [40] * 6, "rows 192x39": [39] * 192, "rows 40x100": [100] * 40}
    weight = torch.randn(C, 4, device="cuda", generator=gen).bfloat16()
    for label, lengths in cases.items():
        new = label.startswith("new")
        n = len(lengths)
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
        x = torch.randn(int(cu[-1]), C, device="cuda", generator=gen).bfloat16()
        slots = torch.arange(n, device="cuda")
        pool = torch.randn(n, C, 4, device="cuda", generator=gen).bfloat16()
        reference = kernels.conv_rows(x, weight, pool.clone(), slots, cu, new_states=new).float()
        run = functools.partial(kernels.conv_tokens, x, weight, pool, slots, cu, new_states=new)
        diff = (run().float() - reference).abs().max().item()
        print(f"convscan {label}: {cuda_ms(run):.4f} ms, max diff from conv_rows {diff:.1e}", flush=True)
        conv_tile_sweep(f"convscan {label}", run)


def long_case(lengths: list[int], new: bool) -> None:
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from kev_backend.gpu import kernels
    from kev_backend.gpu.kernels import delta_rule

    mixed, q, k, v, a, b, a_log, dt_bias, pool, slots, cu_cpu, cu = segments_case(lengths)
    n = len(lengths)
    ours = lambda: kernels.chunked_rows(q, k, v, a, b, a_log, dt_bias, pool, slots, cu, new_states=new)  # noqa: E731
    g = (-a_log.exp() * F.softplus(a.float() + dt_bias)).unsqueeze(0)

    def theirs():
        return chunk_gated_delta_rule(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            g=g,
            beta=torch.sigmoid(b).unsqueeze(0),
            initial_state=None if new else pool.index_select(0, slots),
            output_final_state=new,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu,
        )[0][0]

    diff = (ours().float() - theirs().float()).abs().max().item()
    label = f"{n}x{lengths[0]} {'new' if new else 'rows'}"
    if lengths[0] <= 64:  # short segments: our token-by-token kernel too
        recurrent = lambda: kernels.recurrent_rows(q, k, v, a, b, a_log, dt_bias, pool, slots, cu, new_states=new)  # noqa: E731
        print(f"recurrent {label}: {cuda_ms(recurrent):.3f} ms", flush=True)
    print(
        f"delta rule {label}: ours {cuda_ms(ours):.3f} ms, fla {cuda_ms(theirs):.3f} ms, max diff {diff:.2e}",
        flush=True,
    )
    if lengths[0] > 64:  # the sequential pass's value block and warps (64/8 spills 4 bytes on sm_90a)
        chosen = delta_rule.CHUNK_NARROW, delta_rule.CHUNK_WIDE
        timings = []
        for config in ((16, 4, None), (32, 4, None), (64, 8, None), (64, 4, 168)):
            delta_rule.CHUNK_NARROW = delta_rule.CHUNK_WIDE = config
            timings.append(f"{'/'.join(map(str, config))} {cuda_ms(ours):.3f}")
        delta_rule.CHUNK_NARROW, delta_rule.CHUNK_WIDE = chosen
        print(f"  chunked {label} by value block/warps/register cap: " + ", ".join(timings), flush=True)
    # Longer chunks: fewer steps on the sequential chain, bigger products per step (and per prep program).
    chosen = delta_rule.CHUNK, delta_rule.PREP_WARPS
    timings = []
    for delta_rule.CHUNK, delta_rule.PREP_WARPS in ((16, 2), (16, 4), (32, 4), (32, 8)):
        setting = f"{delta_rule.CHUNK}/{delta_rule.PREP_WARPS}"
        diff = (ours().float() - theirs().float()).abs().max().item()
        timings.append(f"{setting} {cuda_ms(ours):.3f} (diff {diff:.1e})")
    delta_rule.CHUNK, delta_rule.PREP_WARPS = chosen
    print(f"  chunked {label} by chunk/prep warps: " + ", ".join(timings), flush=True)
    conv_w = torch.randn(mixed.shape[1], 4, device="cuda", dtype=torch.bfloat16)
    if new:
        window = torch.zeros(n + 1, mixed.shape[1], 4, device="cuda", dtype=torch.bfloat16)
        ours_conv = lambda: kernels.conv_rows(mixed, conv_w, window, slots, cu, new_states=True)  # noqa: E731
        tokens = lambda: kernels.conv_tokens(mixed, conv_w, window, slots, cu, new_states=True)  # noqa: E731
        fla_conv = lambda: causal_conv1d(  # noqa: E731
            mixed.unsqueeze(0),
            conv_w,
            output_final_state=True,
            activation="silu",
            cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu,
        )
        print(
            f"conv {label}: token by token {cuda_ms(ours_conv):.3f} ms, tokens (the pass's) {cuda_ms(tokens):.3f} ms, "
            f"fla {cuda_ms(fla_conv):.3f} ms",
            flush=True,
        )
        conv_tile_sweep(label, tokens)
    else:  # rows continue their state's window, read in place from the bank
        window = torch.randn(n + 1, mixed.shape[1], 4, device="cuda", dtype=torch.bfloat16)
        rows = lambda: kernels.conv_tokens(mixed, conv_w, window, slots, cu, new_states=False)  # noqa: E731
        conv_tile_sweep(label, rows)


SCAN_CONFIGS = (
    *((8, 256, 2), (16, 256, 2), (32, 256, 2), (64, 256, 2), (128, 256, 2), (32, 128, 1), (32, 512, 4)),
    *((4, 128, 1), (8, 128, 1), (16, 128, 1), (8, 64, 1)),
)


def conv_tile_sweep(label: str, run) -> None:
    """Times `run` (conv_tokens for new states or rows) replayed from a CUDA graph (as a pass runs it: eager calls of
    small inputs are bound by their launches) at each of SCAN_CONFIGS (tokens, channels, warps); the largest
    difference from its output at the chosen configuration."""
    from kev_backend.gpu.kernels import conv

    chosen = conv.SCAN_TOKENS, conv.SCAN_CHANNELS, conv.SCAN_WARPS, conv.SCAN_SMALL_TOKENS  # read at each launch
    reference = run()
    timings = [f"chosen {graph_ms(run):.4f}"]
    conv.SCAN_SMALL_TOKENS = 0  # every pass size at SCAN_*
    for conv.SCAN_TOKENS, conv.SCAN_CHANNELS, conv.SCAN_WARPS in SCAN_CONFIGS:
        diff = (run().float() - reference.float()).abs().max().item()
        timings.append(f"{conv.SCAN_TOKENS}x{conv.SCAN_CHANNELS}/{conv.SCAN_WARPS} {graph_ms(run):.4f} ({diff:.0e})")
    conv.SCAN_TOKENS, conv.SCAN_CHANNELS, conv.SCAN_WARPS, conv.SCAN_SMALL_TOKENS = chosen
    print(f"  conv {label} by tokens x channels/warps: " + ", ".join(timings), flush=True)


def quick_latency() -> None:
    """The bench's latency figures alone (median of 20, model time) for short6 and long5, new and same state, and
    requests/s at 64 clients (3 s each): a quick engine-level comparison of kernel choices (KEV_LONG_KERNELS,
    KEV_SHORT_DELTA_RULE)."""
    from kev_backend.dev import bench
    from kev_backend.dev.workloads import long5, short6

    engine = kev4b_engine()
    from kev_backend.gpu.kernels import delta_rule

    options = engine.options
    print("kernels", options.long_kernels, options.short_delta_rule, "chunk", delta_rule.CHUNK, flush=True)
    for label, make in (("short6", short6), ("long5", long5)):
        print(label, bench.latency(engine, make), flush=True)
        for pipelined in (True, False):
            bench.throughput(engine, make, 64, 1.0, pipelined)
            measured = bench.throughput(engine, make, 64, 3.0, pipelined)
            print(label, "64 clients", "pipelined" if pipelined else "serial", measured, flush=True)


def profiled(make):
    """make()'s value, and its host profile when KEV_PROFILE=1 (else None)."""
    if os.environ.get("KEV_PROFILE") != "1":
        return make(), None
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        return make(), profiler
    finally:
        profiler.disable()


def startup() -> None:
    """The engine's start-up phases with every graph bucket captured (as the GPU config loads it): seconds in eager
    warm-up passes and in captures, and (KEV_PROFILE=1) where the host spends them."""
    engine, profiler = profiled(lambda: kev4b_engine(graphs=True, long_kernels="ours"))
    stats = engine.scorer.graphs.stats
    phases = {phase: round(seconds, 2) for phase, seconds in engine.startup.items()}
    print(
        f"startup {phases} graphs {stats.count} ({stats.capture_failures} failed) "
        f"{stats.bytes / 2**20:.0f} MiB; warm passes {stats.warm_s:.2f} s, captures {stats.capture_s:.2f} s",
        flush=True,
    )
    for bucket, error in engine.scorer.graphs.failed.items():
        print(f"startup bucket {bucket.name}: {error}", flush=True)
    if profiler is not None:
        stats = pstats.Stats(profiler).sort_stats("tottime")
        stats.print_stats(20)
        stats.print_callers("builtins.compile")


def coldstart() -> None:
    """Start-up as a Triton instance sees it, from a Kev-4B checkpoint on disk (/tmp/kev4b, written if missing): the
    imports' cost by top-level package (-X importtime), then Engine.from_checkpoint with the GPU config's options in a
    fresh process on an empty kernel cache and again on the kept one, the second under cProfile (cumulative seconds
    of our functions and the libraries they call)."""
    import re
    import subprocess

    checkpoint = Path("/tmp/kev4b/kev")
    if not checkpoint.exists():
        tiny = [sys.executable, "-m", "kev_backend.dev.tiny", "/tmp/kev4b", "--kev4b", "--device", "cuda"]
        subprocess.run(tiny, check=True)
    imports = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import kev_backend.engine.engine, kev_backend.gpu.fused, kev_backend.gpu.graphs"],
        capture_output=True,
        text=True,
    ).stderr
    top: dict[str, int] = {}
    for line in imports.splitlines():  # "import time: self [us] | cumulative | imported package"
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S+)$", line)
        if match:
            top[match[2]] = int(match[1])
    ranked = sorted(top.items(), key=lambda item: -item[1])[:12]
    print("coldstart imports (s, top-level): " + ", ".join(f"{name} {us / 1e6:.2f}" for name, us in ranked), flush=True)
    for modules in ("torch", "torch, triton", "torch, fla.ops.gated_delta_rule", "torch, kev_backend.gpu.kernels"):
        timed = f"import time; t = time.perf_counter(); import {modules}; print(time.perf_counter() - t)"
        seconds = subprocess.run([sys.executable, "-c", timed], capture_output=True, text=True).stdout.strip()
        print(f"coldstart import {modules}: {seconds} s in a fresh process", flush=True)
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    pyc = sum(1 for _ in site.glob("*/__pycache__/*.pyc"))
    print(
        f"coldstart python: dont_write_bytecode {sys.dont_write_bytecode}, pycache_prefix {sys.pycache_prefix}, "
        f"{site} writable {os.access(site, os.W_OK)}, {pyc} .pyc files one level down",
        flush=True,
    )
    env = {**os.environ, "TRITON_CACHE_DIR": "/tmp/coldstart-cache", "TRITON_CACHE_AUTOTUNING": "1"}
    subprocess.run(["rm", "-rf", "/tmp/coldstart-cache"], check=True)
    bytecode = {"PYTHONPYCACHEPREFIX": "/tmp/coldstart-pyc", "PYTHONDONTWRITEBYTECODE": ""}
    runs = (
        ("empty cache", {"KEV_PROFILE": "0"}),
        ("kept cache", {"KEV_PROFILE": "1"}),
        ("kept cache, load split, bytecode written", {"KEV_LOAD_SPLIT": "1", **bytecode}),
        ("kept cache, bytecode kept", bytecode),
    )
    for label, extra in runs:
        child = subprocess.run(
            [sys.executable, __file__, "coldstart-child", str(checkpoint)],
            env={**env, **extra},
            capture_output=True,
            text=True,
        )
        lines = [line for line in child.stdout.splitlines() if "warn" not in line.lower()]
        print(f"coldstart {label}:", flush=True)
        print("\n".join(lines[:130]), flush=True)
        if child.returncode:
            print(child.stderr[-3000:], flush=True)


def load_split(directory: Path) -> None:
    """The load phase's steps, timed one by one (each ends with a device synchronize)."""
    from kev_backend.model import checkpoint as ck
    from kev_backend.model.qwen35 import Qwen35Config
    from kev_backend.model.weights import load_text_weights, read_config

    device = torch.device("cuda")
    steps = {}

    def timed(name, fn):
        started = time.perf_counter()
        value = fn()
        torch.cuda.synchronize()
        steps[name] = round(time.perf_counter() - started, 3)
        return value

    meta = timed("head.pt", lambda: ck.Meta.load(directory / "head.pt"))
    base = ck.resolve_base(directory, meta, None)
    config = timed("config", lambda: Qwen35Config.from_dict(read_config(base)))
    deltas = timed("lora", lambda: ck.lora_deltas(directory, 1.0, device))
    weights = timed("weights", lambda: load_text_weights(base, device))
    timed("build_model", lambda: ck.build_model(config, weights, torch.bfloat16, deltas, device))
    timed("load_checkpoint", lambda: ck.load_checkpoint(directory, device))
    print(f"coldstart load steps (s): {steps}", flush=True)


def coldstart_child(checkpoint: str) -> None:
    """One engine start as coldstart() describes (torch is already imported: diag.py imports it)."""
    from kev_backend.engine.engine import Engine, EngineOptions

    started = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    context = time.perf_counter() - started
    if os.environ.get("KEV_LOAD_SPLIT") == "1":
        load_split(Path(checkpoint))
    options = EngineOptions(device="cuda", backend="fused", graphs=True, long_kernels="ours")
    engine, profiler = profiled(lambda: Engine.from_checkpoint(checkpoint, options))
    stats = engine.scorer.graphs.stats
    phases = {phase: round(seconds, 2) for phase, seconds in engine.startup.items()}
    print(
        f"coldstart context {context:.2f} s, phases {phases}, graphs {stats.count}, warm passes {stats.warm_s:.2f} s, "
        f"captures {stats.capture_s:.2f} s",
        flush=True,
    )
    if profiler is not None:
        ranked = pstats.Stats(profiler).sort_stats("cumulative")
        ranked.print_callers(r"builtins.compile")  # Python source compiled at run time (no bytecode cache?)
        ranked.print_stats(r"kev_backend|safetensors|tokenizers|graphs.py|jit.py|compiler|cublas", 40)
        ranked.sort_stats("tottime").print_stats(12)


def host_profile() -> None:
    from kev_backend.dev.workloads import short6

    engine = kev4b_engine()
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
    from kev_backend.gpu import kernels

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


def batch_invariance() -> None:
    """Where a question's answer depends on the batch it rides in (Kev-4B shapes): states computed in a batch (A)
    or alone (B, then C: the same batches again reading B's banked states), for fla's and our long kernels; compares
    answers and the picked hidden states the head reads, and names the worst requests' state and row lengths."""
    from kev_backend.gpu import scorer
    from kev_backend.dev import tiny
    from kev_backend.engine.engine import Engine, EngineOptions
    from kev_backend.dev.parity import compare, scored
    from kev_backend.dev.workloads import realistic

    directory = Path(tempfile.mkdtemp())
    tiny.write_tokenizer(directory)
    checkpoint = tiny.synthetic_checkpoint(tiny.KEV4B_CONFIG, directory, "cuda", seed=0)
    captured: list = []
    original = fused_scorer.FusedScorer.run_group

    def capturing(self, rows):  # each pass's picked hidden states, by (request, question): (<decide>, options)
        picked, decides = original(self, rows)
        widths = {(row.request, row.question): len(row.tokens.option_ends) for row in rows}
        host = picked.float().cpu()
        captured.append({key: (host[at], host[at + 1 : at + 1 + widths[key]]) for key, at in decides.items()})
        return picked, decides

    fused_scorer.FusedScorer.run_group = capturing
    for long_kernels in ("fla", "ours"):
        engine = Engine(
            checkpoint,
            EngineOptions(device="cuda", backend="fused", bank_bytes=16 << 30, long_kernels=long_kernels, warm=False),
        )
        encoded = [engine.prepare(r)[1] for r in realistic(300, seed=2, max_words=2300)]
        runs, hidden = {}, {}
        for name, size, clear in (("A", 32, True), ("B", 1, True), ("C", 32, False)):
            if clear:
                engine.bank.clear()
            captured.clear()
            runs[name] = scored(engine, encoded, size)
            flat = []
            for call in captured:
                flat.extend(call[key] for key in sorted(call))
            hidden[name] = flat
        for x, y in (("A", "B"), ("A", "C"), ("B", "C")):
            gap = max((a[0] - b[0]).abs().max().item() for a, b in zip(hidden[x], hidden[y]))
            print(long_kernels, x, "vs", y, compare(runs[x], runs[y]), "hidden max", gap, flush=True)
        gaps = [
            max((abs(p - q) for pa, pb in zip(a, b) for p, q in zip(pa, pb)), default=0.0)
            for a, b in zip(runs["A"], runs["B"])
        ]
        for i in sorted(range(len(encoded)), key=lambda i: -gaps[i])[:6]:
            rows = [len(q.tokens) for q in encoded[i].questions]
            print(f"  request {i} state {len(encoded[i].state)} rows {rows} A-B {gaps[i]:.5f}", flush=True)
        del engine
        torch.cuda.empty_cache()


def gpu_gaps() -> None:
    """short6 (or long5: KEV_GAPS_WORKLOAD) at 64 closed-loop clients through the pipeline (KEV_GRAPHS=1: as the
    GPU config runs it): the model thread's time per batch by phase of its launch (collect, on the delivery thread,
    waits for the GPU), its waits for the next batch, Python's garbage collections, how busy the GPU is and its idle
    gaps by length: whether the idle time lies between batches or inside passes, and what the long gaps coincide
    with."""
    import gc
    from collections import defaultdict

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from kev_backend.dev import bench

    from kev_backend.dev import workloads

    # KEV_GAPS_WORKLOAD: short6 (default) or long5, with seconds for warm-up and measurement to match its batches.
    workload = os.environ.get("KEV_GAPS_WORKLOAD", "short6")
    warm_s, measure_s = {"short6": (1.0, 2.0), "long5": (3.0, 6.0)}[workload]
    make = getattr(workloads, workload)

    engine = kev4b_engine()
    scorer = engine.scorer
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)  # (start, end) of each call, by phase

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spans[name].append((started, time.perf_counter()))

        return wrapper

    for name in ("plan", "layout", "pass_input", "forward", "run_group"):
        setattr(scorer, name, timed(name, getattr(scorer, name)))
    scorer.pointer.softmax = timed("head", scorer.pointer.softmax)
    engine.launch = timed("launch", engine.launch)
    engine.collect = timed("collect", engine.collect)
    collections: list[tuple[int, float]] = []  # (generation, seconds) of each collection by Python's GC
    collecting = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collecting[0] = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - collecting[0]))

    bench.throughput(engine, make, 64, warm_s, True)
    # Each measured batch's pipeline job (kev_backend/engine/pipeline.py): its size, when submit was called and returned,
    # and the job (taken, expected and actual done): whether the next batch reached the model thread in time.
    from kev_backend.engine.pipeline import Pipeline

    jobs: list[tuple[int, float, float, object]] = []
    submit = Pipeline.submit

    def recording_submit(self, bodies, *args, **kwargs):
        called = time.perf_counter()
        submit(self, bodies, *args, **kwargs)
        jobs.append((len(bodies), called, time.perf_counter(), self._previous))

    Pipeline.submit = recording_submit
    spans.clear()
    gc.callbacks.append(on_gc)
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        measured = bench.throughput(engine, make, 64, measure_s, True)
    gc.callbacks.remove(on_gc)
    Pipeline.submit = submit
    # Per batch, ms: from submit to the model thread taking it (preparing included); taken after the batch before was
    # done (> 0: the GPU had nothing of this pipeline queued meanwhile); submit's return before this batch was done;
    # the expected done's error (> 0: expected later than it was).
    for (size, called, returned, job), (_, _, _, before) in zip(jobs[1:], jobs, strict=False):
        print(
            f"gaps batch {size:3d}: submit to taken {(job.taken - called) * 1000:7.1f}, "
            f"taken after previous done {(job.taken - before.done) * 1000:7.1f}, "
            f"returned before done {(job.done - returned) * 1000:7.1f}, "
            f"expected done error {(job.expected_done - job.done) * 1000 if job.expected_done else float('nan'):7.1f}",
            flush=True,
        )
    launches = spans["launch"]  # the model thread's batches
    batches = len(launches)
    phases = ", ".join(
        f"{name} {sum(end - start for start, end in calls) * 1000 / max(batches, 1):.2f}"
        for name, calls in spans.items()
    )
    print(f"gaps {workload}: {measured}; model thread per batch ({batches} batches), ms: {phases}", flush=True)
    waits = [(b[0] - a[1]) * 1000 for a, b in zip(launches, launches[1:])]  # one launch's end to the next's start
    print(
        f"gaps: model thread waiting for the next batch, ms: total {sum(waits):.1f}, "
        f"{sum(w >= 2 for w in waits)} of 2 ms or more, {sum(w >= 10 for w in waits)} of 10 ms or more, "
        f"longest {max(waits, default=0.0):.1f}",
        flush=True,
    )
    for generation in range(3):
        pauses = [seconds * 1000 for g, seconds in collections if g == generation]
        print(
            f"gaps: GC generation {generation}: {len(pauses)} collections, {sum(pauses):.1f} ms, "
            f"longest {max(pauses, default=0.0):.1f}",
            flush=True,
        )
    intervals = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA
    )
    if not intervals:
        print("gaps: no CUDA events recorded", flush=True)
        return
    busy, gaps, end = 0.0, [], intervals[0][0]
    start0 = end
    for lo, hi in intervals:
        if lo > end:
            gaps.append((lo - end) / 1000)
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    span = (end - start0) / 1000
    print(f"gaps: GPU span {span:.0f} ms, busy {busy / 1000:.0f} ms ({busy / 10 / span:.1f} %)", flush=True)
    for lo, hi in ((0.0, 0.05), (0.05, 0.5), (0.5, 2), (2, 10), (10, 1e9)):
        inside = [g for g in gaps if lo <= g < hi]
        print(f"gaps {lo}-{hi} ms: {len(inside)}, {sum(inside):.1f} ms idle", flush=True)


# Kev-4B's projections as the fused path stores them, [N, K]: DeltaNet's and attention's input projections, the
# output projections (both K = 4,096), the MLP's gate and up together, and down.
KEV4B_PROJECTIONS = {
    "gdn_in": (12352, 2560),
    "attn_in": (10240, 2560),
    "out": (2560, 4096),
    "gate_up": (18432, 2560),
    "down": (2560, 9216),
}


def gemm_padding() -> None:
    """Each Kev-4B projection's GEMM (cuBLASLt, as the fused path runs it) by row count M, 64 to 3,328 in steps of 32:
    µs a GEMM, weights cold (cycling through 4 copies, more than L2 holds), from a graph. Then, for the row
    counts the buckets give, the fastest M' ≥ M within 256 rows: cuBLASLt's results are the same for every M ≥ 52
    (gemm_rows), so a GEMM may run padded to M' at no change in its rows' values (checked here for each best M')."""
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch.manual_seed(0)
    counts = range(64, 3328 + 1, 32)
    targets = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 2560, 2688, 2816, 3072)
    for name, (n, k) in KEV4B_PROJECTIONS.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(4)]
        x = torch.randn(counts[-1], k, device="cuda", dtype=torch.bfloat16)
        us = {}
        for m in counts:
            gemms = lambda m=m, x=x, weights=weights: [F.linear(x[:m], w) for w in weights]  # noqa: E731
            us[m] = graph_ms(gemms, repeat=2) * 1000 / 4
        print(f"gemmpad {name} " + " ".join(f"{m}:{t:.1f}" for m, t in us.items()), flush=True)
        best = []
        for m in targets:
            pad = min((c for c in counts if m <= c <= m + 256), key=lambda c: us[c])
            same = (F.linear(x[:pad], weights[0])[:m] == F.linear(x[:m], weights[0])).all().item()
            best.append(f"{m}->{pad} {us[m]:.1f}->{us[pad]:.1f}{'' if same else ' DIFFERS'}")
        print(f"gemmpad {name} best: " + ", ".join(best), flush=True)


def gemm_layouts() -> None:
    """Each Kev-4B projection at the row counts short6 and long5 passes take, as the fused path stores its weights
    ([N, K], F.linear: cuBLAS's TN) against the weights transposed once ([K, N], x @ w: NN): µs a GEMM (weights cold,
    as gemm_padding), and whether NN's rows are the same at every M (rows of the M-row GEMM against the same rows of
    a 3,072-row one: what batch invariance needs)."""
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch.manual_seed(0)
    for name, (n, k) in KEV4B_PROJECTIONS.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(4)]
        transposed = [w.t().contiguous() for w in weights]
        x = torch.randn(3072, k, device="cuda", dtype=torch.bfloat16)
        full_nn = x @ transposed[0]
        line = []
        for m in (64, 128, 192, 256, 384, 512, 2688):
            tn = lambda m=m, x=x, ws=weights: [F.linear(x[:m], w) for w in ws]  # noqa: E731
            nn = lambda m=m, x=x, ws=transposed: [x[:m] @ w for w in ws]  # noqa: E731
            tn_us, nn_us = (graph_ms(f, repeat=2) * 1000 / 4 for f in (tn, nn))
            same = torch.equal(x[:m] @ transposed[0], full_nn[:m])
            agree = (x[:m] @ transposed[0] - F.linear(x[:m], weights[0])).abs().max().item()
            line.append(f"{m}: TN {tn_us:.1f} NN {nn_us:.1f}{'' if same else ' NN-varies'} ({agree:.0e})")
        print(f"gemmlayout {name} " + ", ".join(line), flush=True)


def rows_chain_configs() -> None:
    """The chain for one short6's rows (6 of 31 tokens) in r192's 48 row slots, as a captured pass runs it (in turn),
    by (value block, warps, programs an SM): prep and chain µs a layer from a graph; outputs must be identical."""
    from kev_backend.gpu import kernels
    from kev_backend.gpu.kernels import delta_rule as R

    lengths, capacity = [31] * 6, 48
    _, q, k, v, a, b, a_log, dt_bias, pool, slots, _, cu = segments_case(lengths)
    n = len(lengths)
    scratch = torch.full((capacity - n,), n, device="cuda", dtype=slots.dtype)
    padded_slots, padded_cu = torch.cat([slots, scratch]), torch.cat([cu, cu[-1:].repeat(capacity - n)])
    args = (q, k, v, a, b, a_log, dt_bias, pool, padded_slots, padded_cu)
    narrow, per_sm = R.CHUNK_NARROW, R.CHUNK_PER_SM
    reference, line = None, []
    for block_v, warps, programs in ((32, 4, 2), (32, 4, 1), (32, 4, 3), (64, 4, 1), (64, 8, 1), (128, 8, 1)):
        R.CHUNK_NARROW, R.CHUNK_PER_SM = (block_v, warps, None), programs
        run = lambda: kernels.chunked_rows(*args, new_states=False, padded=True)  # noqa: E731
        try:
            out = run().float()
        except Exception as error:  # noqa: BLE001
            line.append(f"{block_v}/{warps}/{programs} failed {type(error).__name__}")
            continue
        reference = out if reference is None else reference
        parts = " ".join(
            f"{name.strip('_').split('_kernel')[0]} {us:.1f}"
            for name, us in graph_kernel_us(run).items()
            if "delta_rule" in name or "prep" in name
        )
        same = "" if torch.equal(out, reference) else f" DIFFERS {(out - reference).abs().max().item():.1e}"
        line.append(f"{block_v}/{warps}/{programs} {graph_ms(run) * 1000:.1f} µs [{parts}]{same}")
    R.CHUNK_NARROW, R.CHUNK_PER_SM = narrow, per_sm
    print("rowschain short6 rows r192: " + ", ".join(line), flush=True)


def flag_ab() -> None:
    """A module flag read when a pass is captured (KEV_AB_FLAG="module:NAME", e.g. kev_backend.gpu.fused:ROWS_BESIDE),
    off and on, in two engines built in turn in one process (KEV_GRAPHS=1), their requests interleaved: paired model
    times (medians of 30 rounds) for short6 and long5, new and same state, with far less of the noise between
    processes and machines than separate runs have. The two engines must answer alike (largest difference shown)."""
    import importlib
    import os
    import statistics

    from kev_backend.dev import bench
    from kev_backend.dev.workloads import long5, short6

    module_name, flag = os.environ["KEV_AB_FLAG"].split(":")
    module = importlib.import_module(module_name)
    # One checkpoint for both: built after the first engine set the process's BLAS preferences, the second's merged
    # weights would round differently (answers ~1e-2 apart on random Kev-4B weights, whatever the flag).
    checkpoint = kev4b_checkpoint()
    engines = []
    for value in (False, True):
        setattr(module, flag, value)
        engines.append(kev4b_engine(checkpoint))
    print(f"flagab {flag}: engines built", flush=True)
    for label, make in (("short6", short6), ("long5", long5)):
        for state in ("new", "same"):
            times: list[list[float]] = [[], []]
            largest = 0.0
            for round_ in range(33):
                body = make(next(bench.NEW_STATE) if state == "new" else None)
                probs = []
                for i in (round_ % 2, 1 - round_ % 2):  # ABBA by round
                    batch = engines[i].score(engines[i].prepare_batch([body]))
                    probs.append([p for request in batch.probabilities for q in request for p in q])
                    if round_ >= 3:
                        times[i].append(batch.report.model_ms)
                largest = max(largest, max(abs(x - y) for x, y in zip(*probs, strict=True)))
            off, on = (statistics.median(t) for t in times)
            print(
                f"flagab {label} {state}: off {off:.3f} ms, on {on:.3f} ms ({on - off:+.3f}), answers within "
                f"{largest:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what == "invariance":
        batch_invariance()
    if what == "long":
        long_segments(only_rows="rows" in sys.argv[2:])
    if what == "latency":
        quick_latency()
    if what == "startup":
        startup()
    if what == "coldstart":
        coldstart()
    if what == "coldstart-child":
        coldstart_child(sys.argv[2])
    if what == "sweep":
        invariance_sweep()
    if what == "recurrent":
        recurrent_configs()
    if what == "speed":
        gemm_speed()
    if what == "chunkvariants":
        chunk_variants()
    if what == "prepregs":
        prep_registers()
    if what == "launch":
        launch_path()
    if what == "hostsplit":
        host_split()
    if what == "hostops":
        host_ops()
    if what == "hostpath":
        host_path()
    if what == "rounds":
        launch_rounds()
    if what == "chainwaves":
        chain_waves()
    if what == "kernels":
        kernel_breakdown()
    if what == "padded":
        padded_groups()
    if what == "rowsattn":
        rows_attention_tiles()
    if what == "longattn":
        long_attention_tiles()
    if what == "convscan":
        conv_scan()
    if what == "ncuprobe":
        ncu_probe()
    if what == "timeline":
        request_timeline()
    if what == "gaps":
        gpu_gaps()
    if what == "gemmpad":
        gemm_padding()
    if what == "flagab":
        flag_ab()
    if what == "gemmlayout":
        gemm_layouts()
    if what == "rowschain":
        rows_chain_configs()
    if what in ("gemm", "all"):
        gemm_invariance()
    if what in ("profile", "all"):
        host_profile()
