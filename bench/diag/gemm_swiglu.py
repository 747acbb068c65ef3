"""The MLP's activation inside its GEMM: silu(x·Wgᵀ)·(x·Wuᵀ) from one Triton kernel with two accumulators, against
the fused path's cuBLASLt [gate | up] GEMM followed by `silu_mul`. The fused form never writes the [rows, 2I]
projection: on a long pass that is most of the MLP's memory traffic outside its GEMMs. It pays only if the Triton GEMM
keeps cuBLASLt's rate, which this measures at a Kev size's MLP shapes."""

from __future__ import annotations

import statistics
import time

import torch
import triton
import triton.language as tl

from kev_backend.dev.tiny import SIZES

from .common import captured_graph, command, graph_ms
from .gemm import clocks_text, gpu_clocks


@triton.jit
def _gate_up_silu_kernel(
    x_desc, g_desc, u_desc, y_desc, M, WIDTH, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """y[M, WIDTH] = silu(x·Gᵀ)·(x·Uᵀ) in fp32, one rounding. Tiles in groups of GROUP_M row tiles per column tile (L2
    reuse of the weights' tiles); a persistent grid of PROGRAMS programs walks them. The K loop's order is fixed, so
    a row's output depends on nothing but its row."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(WIDTH, BN)
    k_tiles = tl.cdiv(K, BK)
    tiles = num_m * num_n
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True, num_stages=STAGES):
        in_group = GROUP_M * num_n
        first_m = (tile // in_group) * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % in_group) % size_m
        pid_n = (tile % in_group) // size_m
        om = pid_m * BM
        on = pid_n * BN
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(k_tiles):
            ok = kk * BK
            a = x_desc.load([om, ok])
            acc_g = tl.dot(a, g_desc.load([on, ok]).T, acc_g)
            acc_u = tl.dot(a, u_desc.load([on, ok]).T, acc_u)
        y = acc_g * tl.sigmoid(acc_g) * acc_u
        y_desc.store([om, on], y.to(y_desc.dtype))


@triton.jit
def _gemm_kernel(
    x_desc, w_desc, y_desc, M, N, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """y[M, N] = x·Wᵀ, the same walk with one accumulator: Triton's plain GEMM rate beside cuBLASLt's."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    tiles = num_m * num_n
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True, num_stages=STAGES):
        in_group = GROUP_M * num_n
        first_m = (tile // in_group) * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % in_group) % size_m
        pid_n = (tile % in_group) // size_m
        om = pid_m * BM
        on = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(k_tiles):
            ok = kk * BK
            acc = tl.dot(x_desc.load([om, ok]), w_desc.load([on, ok]).T, acc)
        y_desc.store([om, on], acc.to(y_desc.dtype))


def gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor, y: torch.Tensor, config: tuple[int, ...]) -> None:
    """y = silu(x·Gᵀ)·(x·Uᵀ) for gate_up = [G | U] stored [2I, K], on `config` = (BM, BN, BK, stages, warps, group,
    programs; 0 programs: a program a tile)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, stages, warps, group, programs = config
    m, k = x.shape
    width = gate_up.shape[0] // 2
    tiles = triton.cdiv(m, bm) * triton.cdiv(width, bn)
    programs = programs or tiles
    _gate_up_silu_kernel[(min(programs, tiles),)](
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(gate_up[:width], [bn, bk]),
        TensorDescriptor.from_tensor(gate_up[width:], [bn, bk]),
        TensorDescriptor.from_tensor(y, [bm, bn]),
        m, width, k,
        BM=bm, BN=bn, BK=bk, GROUP_M=group, PROGRAMS=min(programs, tiles), STAGES=stages, num_warps=warps,
    )  # fmt: skip


def gemm(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, config: tuple[int, ...]) -> None:
    """y = x·Wᵀ on `config` as gate_up_silu takes it."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, stages, warps, group, programs = config
    m, k = x.shape
    n = w.shape[0]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = min(programs or tiles, tiles)
    _gemm_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(w, [bn, bk]),
        TensorDescriptor.from_tensor(y, [bm, bn]),
        m, n, k,
        BM=bm, BN=bn, BK=bk, GROUP_M=group, PROGRAMS=programs, STAGES=stages, num_warps=warps,
    )  # fmt: skip


# (BM, BN, BK, stages, warps, group, programs): BN is each accumulator's width; 132 programs is one an SM.
FUSED_CONFIGS = [
    (128, 128, 64, 3, 8, 8, 0),
    (128, 128, 64, 4, 8, 8, 0),
    (128, 128, 64, 3, 8, 8, 132),
    (128, 128, 64, 4, 8, 8, 132),
    (128, 128, 64, 3, 8, 64, 132),
    (128, 64, 64, 4, 4, 8, 0),
    (128, 64, 64, 4, 8, 8, 132),
    (64, 128, 64, 4, 4, 8, 0),
    (256, 64, 64, 3, 8, 8, 132),
    (64, 128, 64, 4, 4, 8, 132),
    (64, 64, 64, 4, 4, 8, 0),
]
PLAIN_CONFIGS = [
    (128, 256, 64, 3, 8, 8, 0),
    (128, 256, 64, 3, 8, 8, 132),
    (128, 256, 64, 4, 8, 8, 132),
    (128, 128, 64, 4, 8, 8, 132),
]


def gemmswiglu(args) -> None:
    """A Kev size's MLP input projection and activation (--size) at each of --rows: cuBLASLt's [gate | up] GEMM (the
    heuristic's algorithm without split-K, an eager pass's) then silu_mul, against the Triton GEMM with the activation
    as its epilogue on each configuration, and Triton's plain [gate | up] GEMM beside cuBLASLt's. Times are ms of one
    layer, alone (from a graph of a few calls) and sustained (a pass's layers, each with weights of its own, back to
    back for half a second, after a second idle). Errors are against the fp32 product on 256 rows."""
    from kev_backend.dev import tiny
    from kev_backend.gpu import cublaslt
    from kev_backend.gpu.kernels.norms import silu_mul
    from kev_backend.model.qwen35 import Qwen35Config

    device = torch.device("cuda")
    gemms = cublaslt.pretuned(device, "off")
    config = Qwen35Config.from_dict(tiny.SIZES[args.size].config)
    torch.manual_seed(0)
    weights = [
        torch.randn(2 * config.intermediate_size, config.hidden_size, device=device, dtype=torch.bfloat16) * 0.02
        for _ in range(config.num_hidden_layers)
    ]
    for m in (int(rows) for rows in args.rows.split(",")):
        _measure(args.size, m, weights, gemms, silu_mul)


def _measure(size: str, m: int, weights: list[torch.Tensor], gemms, silu_mul) -> None:
    """gemmswiglu at m rows."""
    width, hidden = weights[0].shape[0] // 2, weights[0].shape[1]
    device = weights[0].device
    x = torch.randn(m, hidden, device=device, dtype=torch.bfloat16)
    projected = torch.empty(m, 2 * width, device=device, dtype=torch.bfloat16)
    y = torch.empty(m, width, device=device, dtype=torch.bfloat16)
    plan = gemms.plan(m, 2 * width, hidden)
    tflop = 2 * m * 2 * width * hidden / 1e12

    def projection(w: torch.Tensor) -> None:
        plan.run(plan.default, x, w, projected, gemms.workspace)

    def cublas(w: torch.Tensor) -> torch.Tensor:
        projection(w)
        return silu_mul(projected)

    exact = x[:256].float() @ weights[0].float().T
    exact = torch.nn.functional.silu(exact[:, :width]) * exact[:, width:]

    def error(out: torch.Tensor) -> float:
        return (out[:256].float() - exact).abs().max().item()

    def sustained(step) -> tuple[float, list[tuple[float, float]]]:
        """ms a layer of step(w) over every layer's weights back to back for ~0.5 s, after a second idle."""
        graph = captured_graph(lambda: [step(w) for w in weights])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        count = max(2, round(500 / start.elapsed_time(end)))
        time.sleep(1.0)
        samples: list[tuple[float, float]] = []
        events = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
        with gpu_clocks(samples):
            events[0].record()
            for event in events[1:]:
                graph.replay()
                event.record()
            torch.cuda.synchronize()
        del graph
        times = [a.elapsed_time(b) / len(weights) for a, b in zip(events, events[1:])]
        return statistics.median(times[1:]), samples

    base_alone = graph_ms(lambda: cublas(weights[0]), repeat=4)
    gemm_alone = graph_ms(lambda: projection(weights[0]), repeat=4)
    print(f"gemmswiglu {size} M={m}: cuBLASLt [gate|up] {gemm_alone:.3f} ms ({tflop / gemm_alone * 1e3:.0f} "
          f"TFLOP/s) + silu_mul {base_alone - gemm_alone:.3f} = {base_alone:.3f} ms; error "
          f"{error(cublas(weights[0])):.2e}", flush=True)  # fmt: skip
    for plain in PLAIN_CONFIGS:
        try:
            ms = graph_ms(lambda plain=plain: gemm(x, weights[0], projected, plain), repeat=4)
        except Exception as failure:  # a configuration this Triton or GPU cannot build
            print(f"gemmswiglu plain {plain}: failed {type(failure).__name__}: {str(failure)[:160]}", flush=True)
            continue
        print(f"gemmswiglu {size} M={m} plain triton {plain}: {ms:.3f} ms ({tflop / ms * 1e3:.0f} TFLOP/s)",
              flush=True)  # fmt: skip
    timed: dict[tuple[int, ...], float] = {}
    first: torch.Tensor | None = None  # the first configuration's output: do the others give its bits?
    for fused in FUSED_CONFIGS:
        try:
            gate_up_silu(x, weights[0], y, fused)
            ms = graph_ms(lambda fused=fused: gate_up_silu(x, weights[0], y, fused), repeat=4)
        except Exception as failure:
            print(f"gemmswiglu fused {fused}: failed {type(failure).__name__}: {str(failure)[:160]}", flush=True)
            continue
        timed[fused] = ms
        first = y.clone() if first is None else first
        print(f"gemmswiglu {size} M={m} fused {fused}: {ms:.3f} ms ({tflop / ms * 1e3:.0f} TFLOP/s), "
              f"{ms / base_alone:.3f}x; error {error(y):.2e}; bits as the first: {torch.equal(y, first)}",
              flush=True)  # fmt: skip
    if not timed:
        return
    best = min(timed, key=timed.__getitem__)
    ways = (("cuBLASLt+silu_mul", cublas), (f"fused {best}", lambda w: gate_up_silu(x, w, y, best)))
    for name, step in ways + ways:  # in turn, twice: the power state drifts over a run
        ms, samples = sustained(step)
        print(f"gemmswiglu {size} M={m} sustained, {len(weights)} layers back to back: {name} {ms:.3f} ms a layer; "
              f"{clocks_text(samples)}", flush=True)  # fmt: skip


def register(sub) -> None:
    parser = command(sub, "gemmswiglu", gemmswiglu, "the MLP activation in the GEMM's epilogue against cuBLASLt + silu")
    parser.add_argument("--size", choices=SIZES, default="4b", help="a Kev size's MLP shapes (default 4b)")
    parser.add_argument("--rows", default="2630,8320", help="row counts, comma-separated (default 2630,8320)")
