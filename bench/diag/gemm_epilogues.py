"""Work beside the MLP's GEMMs moved into their epilogues, in Triton GEMMs of our own, against the fused path's
cuBLASLt GEMMs and the memory-bound kernels after them: the activation silu(x·Gᵀ)·(x·Uᵀ) computed from the [gate | up]
accumulator (the [rows, 2I] projection never written), and the down projection added into the fp32 residual stream
(the norm after it then reads the stream alone). Either pays only where the Triton GEMM keeps cuBLASLt's rate; this
measures both at a Kev size's MLP shapes, alone and at the GPU's power limit (docs/kernels.md, Projections)."""

from __future__ import annotations

import statistics
import time

import torch
import triton
import triton.language as tl

from kev_backend.dev.sizes import SIZES
from kev_backend.gpu.kernels.norms import rms_norm, silu_mul

from .common import captured_graph, command, graph_ms, replayed
from .gemm import clocks_text, gpu_clocks


@triton.jit
def _tile_origin(tile, num_m, num_n, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """The first row and column of output tile `tile`: tiles go GROUP_M row tiles down a column of tiles before the
    next column, so a weight tile is read from L2 by the row tiles after the first."""
    in_group = GROUP_M * num_n
    first_m = (tile // in_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return (first_m + (tile % in_group) % size_m) * BM, ((tile % in_group) // size_m) * BN


@triton.jit
def _tile_product(x_desc, w_desc, om, on, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """x[om:om+BM]·W[on:on+BN]ᵀ in fp32, the inner dimension walked in BK steps in order (so a row's sums never
    depend on the rows beside it)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(tl.cdiv(K, BK)):
        acc = tl.dot(x_desc.load([om, kk * BK]), w_desc.load([on, kk * BK]).T, acc)
    return acc


@triton.jit
def _gemm_kernel(
    x_desc, w_desc, y_desc, M, N, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """y[M, N] = x·Wᵀ, the same walk with one accumulator: Triton's plain GEMM rate beside cuBLASLt's."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=True, num_stages=STAGES):
        om, on = _tile_origin(tile, num_m, num_n, BM, BN, GROUP_M)
        acc = _tile_product(x_desc, w_desc, om, on, K, BM, BN, BK)
        y_desc.store([om, on], acc.to(y_desc.dtype))


@triton.jit
def _swiglu_interleaved_kernel(
    x_desc, w_desc, y_desc, M, WIDTH, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """y[M, WIDTH] = silu(g)·u with W's rows interleaved (g0, u0, g1, u1, ...): one accumulator of 2·BN columns,
    whose gate and up columns sit side by side in each thread's registers, split in the epilogue."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(WIDTH, BN)
    for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=True, num_stages=STAGES):
        om, on = _tile_origin(tile, num_m, num_n, BM, BN, GROUP_M)
        acc = _tile_product(x_desc, w_desc, om, 2 * on, K, BM, 2 * BN, BK)
        g, u = acc.reshape(BM, BN, 2).split()
        y_desc.store([om, on], (g * tl.sigmoid(g) * u).to(y_desc.dtype))


@triton.jit
def _gemm_residual_kernel(
    x_desc, w_desc, residual, M, N, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """residual[M, N] += x·Wᵀ with the residual fp32 (the stream): the output projection adding into it in its
    epilogue, read and written from registers (an fp32 tile through shared memory leaves too little for the
    stages)."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=True, num_stages=STAGES):
        om, on = _tile_origin(tile, num_m, num_n, BM, BN, GROUP_M)
        acc = _tile_product(x_desc, w_desc, om, on, K, BM, BN, BK)
        rows = (om + tl.arange(0, BM)).to(tl.int64)
        cols = on + tl.arange(0, BN)
        where = residual + rows[:, None] * N + cols[None, :]
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        tl.store(where, tl.load(where, mask=mask) + acc, mask=mask)


def _launch(kernel, descs: list, m: int, n: int, k: int, tile_n: int, config: tuple[int, ...]) -> None:
    bm, bn, bk, stages, warps, group, programs = config
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, tile_n)
    programs = min(programs or tiles, tiles)
    kernel[(programs,)](
        *descs, m, n, k,
        BM=bm, BN=bn, BK=bk, GROUP_M=group, PROGRAMS=programs, STAGES=stages, num_warps=warps,
    )  # fmt: skip


def swiglu_interleaved(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, config: tuple[int, ...]) -> None:
    """y = silu(g)·u for w [2I, K] with its rows interleaved (gate, up, gate, up, ...)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk = config[:3]
    m, k = x.shape
    descs = [TensorDescriptor.from_tensor(t, block) for t, block in ((x, [bm, bk]), (w, [2 * bn, bk]), (y, [bm, bn]))]
    _launch(_swiglu_interleaved_kernel, descs, m, w.shape[0] // 2, k, bn, config)


def gemm_residual(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, config: tuple[int, ...]) -> None:
    """residual += x·Wᵀ (residual fp32 [M, N])."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk = config[:3]
    m, k = x.shape
    descs = [TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]), residual]
    _launch(_gemm_residual_kernel, descs, m, w.shape[0], k, bn, config)


def interleaved(gate_up: torch.Tensor) -> torch.Tensor:
    """[G | U] as rows g0, u0, g1, u1, ..."""
    width = gate_up.shape[0] // 2
    return torch.stack([gate_up[:width], gate_up[width:]], 1).reshape(gate_up.shape)


def gemm(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, config: tuple[int, ...]) -> None:
    """y = x·Wᵀ."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk = config[:3]
    m, k = x.shape
    descs = [TensorDescriptor.from_tensor(t, b) for t, b in ((x, [bm, bk]), (w, [bn, bk]), (y, [bm, bn]))]
    _launch(_gemm_kernel, descs, m, w.shape[0], k, bn, config)


# (BM, BN, BK, stages, warps, group, programs; 0 programs: one a tile, else a persistent grid). For the interleaved
# activation BN is the output's tile width: the weights' tile is 2·BN rows.
PLAIN_CONFIGS = [(128, 256, 64, 3, 8, 8, 132), (128, 256, 64, 3, 8, 8, 0)]
SWIGLU_CONFIGS = [(128, 128, 64, 3, 8, 8, 132), (128, 128, 64, 3, 8, 8, 0), (128, 128, 64, 3, 8, 64, 132)]
RESIDUAL_CONFIGS = [(128, 128, 64, 3, 8, 8, 132), (128, 128, 64, 4, 8, 8, 132), (128, 256, 64, 2, 8, 8, 132)]


def gemmepilogues(args) -> None:
    """A Kev size's MLP at each of --rows, each layer with weights of its own: (1) the input projection and
    activation, cuBLASLt's [gate | up] GEMM (the heuristic's algorithm without split-K, an eager pass's) then
    silu_mul, against Triton's GEMM on the weights' rows interleaved with the activation as its epilogue (and
    Triton's plain [gate | up] GEMM beside cuBLASLt's); (2) the down projection and the next residual add + RMSNorm,
    cuBLASLt's GEMM (bf16 out) then the norm adding it into the fp32 stream, against Triton's GEMM adding into the
    stream in its epilogue then the norm of the stream (its output fp32 here: 2 bytes a value more than an engine's
    would write, charged to the Triton side). ms of one layer, alone (a graph of a few calls) and sustained
    (every layer back to back for half a second after a second idle, each way twice in turn). Errors against fp32."""
    from kev_backend.dev import sizes
    from kev_backend.gpu import cublaslt
    from kev_backend.model.qwen35 import Qwen35Config

    device = torch.device("cuda")
    gemms = cublaslt.pretuned(device, "off")
    config = Qwen35Config.from_dict(sizes.SIZES[args.size].config)
    hidden, width = config.hidden_size, config.intermediate_size
    torch.manual_seed(0)
    layers = range(config.num_hidden_layers)
    gate_up = [torch.randn(2 * width, hidden, device=device, dtype=torch.bfloat16) * 0.02 for _ in layers]
    down = [torch.randn(hidden, width, device=device, dtype=torch.bfloat16) * 0.02 for _ in layers]
    mixed = [interleaved(w) for w in gate_up] if args.only != "residual" else []
    for m in (int(rows) for rows in args.rows.split(",")):
        _mlp(f"gemmepilogues {args.size} M={m}", m, gemms, gate_up, mixed, down, args.only)


def _mlp(
    label: str,
    m: int,
    gemms,
    gate_up: list[torch.Tensor],
    mixed: list[torch.Tensor],
    down: list[torch.Tensor],
    only: str | None,
) -> None:
    """gemmepilogues at m rows; `mixed`: gate_up's layers interleaved."""
    width, hidden = down[0].shape[1], down[0].shape[0]
    device = down[0].device
    norm_weight = torch.ones(hidden, device=device)
    x = torch.randn(m, hidden, device=device, dtype=torch.bfloat16)
    h = torch.randn(m, width, device=device, dtype=torch.bfloat16)
    projected = torch.empty(m, 2 * width, device=device, dtype=torch.bfloat16)
    y = torch.empty(m, width, device=device, dtype=torch.bfloat16)
    out = torch.empty(m, hidden, device=device, dtype=torch.bfloat16)
    stream = torch.randn(m, hidden, device=device)
    up_plan, down_plan = gemms.plan(m, 2 * width, hidden), gemms.plan(m, hidden, width)
    tflop = 2 * m * 2 * width * hidden / 1e12

    def activation(i: int) -> torch.Tensor:
        up_plan.run(up_plan.default, x, gate_up[i], projected, gemms.workspace)
        return silu_mul(projected)

    def added(i: int) -> None:
        down_plan.run(down_plan.default, h, down[i], out, gemms.workspace)
        rms_norm(out, norm_weight, 1e-6, stream, store_residual=True)

    if only != "residual":
        exact = x[:256].float() @ gate_up[0].float().T
        exact = torch.nn.functional.silu(exact[:, :width]) * exact[:, width:]
        error = (activation(0)[:256].float() - exact).abs().max()
        print(f"{label}: activation error, cuBLASLt+silu_mul {error:.2e}", flush=True)
        ways = {"cuBLASLt+silu_mul": activation}
        for plain in PLAIN_CONFIGS:
            ms = graph_ms(lambda plain=plain: gemm(x, gate_up[0], projected, plain), repeat=4)
            print(f"{label} plain triton [gate|up] {plain}: {ms:.3f} ms ({tflop / ms * 1e3:.0f} TFLOP/s)", flush=True)
        for fused in SWIGLU_CONFIGS:
            swiglu_interleaved(x, mixed[0], y, fused)
            error = (y[:256].float() - exact).abs().max()
            ways[f"interleaved {fused}"] = lambda i, fused=fused: swiglu_interleaved(x, mixed[i], y, fused)
            print(f"{label} interleaved {fused}: error {error:.2e}", flush=True)
        _compare(label, ways, len(gate_up), tflop)
    if only != "activation":
        ways = {"cuBLASLt+norm": added}
        for fused in RESIDUAL_CONFIGS:
            ways[f"residual {fused}"] = lambda i, fused=fused: (
                gemm_residual(h, down[i], stream, fused),
                rms_norm(stream, norm_weight, 1e-6),
            )
        _compare(label, ways, len(gate_up), tflop / 2)


def _compare(label: str, ways: dict, layers: int, tflop: float) -> None:
    """Each way alone (layer 0, from a graph), then the two fastest sustained, in turn, twice."""
    alone = {name: graph_ms(lambda step=step: step(0), repeat=4) for name, step in ways.items()}
    for name, ms in alone.items():
        print(f"{label} alone {name}: {ms:.3f} ms ({tflop / ms * 1e3:.0f} TFLOP/s of GEMM)", flush=True)
    base = next(iter(ways))
    best = min((name for name in ways if name != base), key=alone.__getitem__)
    for name in (base, best, base, best):
        ms, samples = _sustained(ways[name], layers)
        print(f"{label} sustained {name}: {ms:.3f} ms a layer; {clocks_text(samples)}", flush=True)


def _sustained(step, layers: int) -> tuple[float, list[tuple[float, float]]]:
    """ms a layer of step(i) over every layer back to back for ~0.5 s, after a second idle."""
    graph = captured_graph(lambda: [step(i) for i in range(layers)])
    count = max(2, round(500 / replayed(graph, 1)[0]))
    time.sleep(1.0)
    samples: list[tuple[float, float]] = []
    with gpu_clocks(samples):
        times = replayed(graph, count)
    del graph
    return statistics.median(times[1:]) / layers, samples


def register(sub) -> None:
    summary = "the MLP's activation and residual add in a Triton GEMM's epilogue, against cuBLASLt"
    parser = command(sub, "gemmepilogues", gemmepilogues, summary)
    parser.add_argument("--size", choices=SIZES, default="4b", help="a Kev size's MLP shapes (default 4b)")
    parser.add_argument("--rows", default="2630,8320", help="row counts, comma-separated (default 2630,8320)")
    parser.add_argument("--only", choices=("activation", "residual"), help="one of the two comparisons")
