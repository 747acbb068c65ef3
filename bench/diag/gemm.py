"""The projections' GEMMs at Kev's shapes (Kev-4B's, or a size's for gemmpad): the row counts from which a row's
output stops depending on the pass's size (batch invariance) and each library's speed, and the cost of each row count
a pass may give."""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from kev_backend.dev.sizes import SIZES

from .common import KEV4B_PROJECTIONS, captured_graph, command, cuda_ms, graph_ms, replayed


def gemm(args) -> None:
    """For cuBLASLt (the fused path's) and cuBLAS: the pass sizes M at which a row's GEMM output differs from the
    same row in a pass of 8,192 tokens (split-K chosen by M), over M = 1..4,096, and ms at M from one short request
    to a busy long batch (TFLOP/s)."""
    print("default blas library", torch.backends.cuda.preferred_blas_library(), flush=True)
    sizes = sorted(set(range(1, 129)) | set(range(129, 4097, 13)) | {256, 512, 1024, 2048, 4096})
    previous = torch.backends.cuda.preferred_blas_library()
    try:
        for library in ("cublaslt", "cublas"):
            torch.backends.cuda.preferred_blas_library(library)
            for name, (n, k) in KEV4B_PROJECTIONS.items():
                torch.manual_seed(0)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                x = torch.randn(8192, k, device="cuda", dtype=torch.bfloat16)
                full = F.linear(x, w)
                differ = [m for m in sizes if not torch.equal(F.linear(x[:m], w), full[:m])]
                ranges = f"{differ[0]}..{differ[-1]} ({len(differ)} sizes)" if differ else "none"
                times = []
                for m in (40, 64, 218, 1000, 6540):
                    xm = x[:m].contiguous()
                    ms = cuda_ms(lambda xm=xm, w=w: F.linear(xm, w), repeat=20)
                    times.append(f"{m}:{ms:.3f}/{2 * m * n * k / ms / 1e9:.0f}TF")
                print(f"gemm {library} {name}: differ at M={ranges}; ms {' '.join(times)}", flush=True)
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def gemmpad(args) -> None:
    """Each projection's GEMM of a Kev size's shapes (--size, default 4b) as the fused path runs it (cublaslt.GemmAlgos
    with the packaged table: no split-K) by row count M (--rows FIRST:LAST:STEP, default 64:3328:32): µs a GEMM,
    weights cold (cycling through 4 copies, more than L2 holds), from a graph. Then, for the row counts in range that
    graph buckets and the bench's passes give, the fastest M' ≥ M within 256 rows and whether its rows equal the
    M-row GEMM's: what padding a pass's GEMMs would gain on this GPU."""
    from kev_backend.dev import sizes
    from kev_backend.gpu import cublaslt
    from kev_backend.model.qwen35 import Qwen35Config

    gemms = cublaslt.pretuned(torch.device("cuda"))
    first, last, step = (int(part) for part in args.rows.split(":"))
    counts = range(first, last + 1, step)
    targets = [m for m in (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 2560, 2630, 2688, 2816, 3072) if m in counts]
    config = Qwen35Config.from_dict(sizes.SIZES[args.size].config)
    shapes = dict.fromkeys(shape for kind in sizes.fused_projections(config).values() for shape in kind)
    torch.manual_seed(0)
    for n, k in shapes:
        name = f"{args.size} {n}x{k}"
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(4)]
        x = torch.randn(counts[-1], k, device="cuda", dtype=torch.bfloat16)
        us = {}
        for m in counts:
            run = lambda m=m, x=x, weights=weights: [gemms.linear(x[:m], w) for w in weights]  # noqa: E731
            us[m] = graph_ms(run, repeat=2) * 1000 / 4
        print(f"gemmpad {name} " + " ".join(f"{m}:{t:.1f}" for m, t in us.items()), flush=True)
        best = []
        for m in targets:
            pad = min((c for c in counts if m <= c <= m + 256), key=lambda c: us[c])
            same = torch.equal(gemms.linear(x[:pad], weights[0])[:m], gemms.linear(x[:m], weights[0]))
            best.append(f"{m}->{pad} {us[m]:.1f}->{us[pad]:.1f}{'' if same else ' DIFFERS'}")
        print(f"gemmpad {name} best: " + ", ".join(best), flush=True)


def gemmrows(args) -> None:
    """The GEMMs of an eager pass: a Kev size's projections (--size) at row counts no table holds (--rows, comma-
    separated), each on the heuristic's first algorithm without split-K (what runs today), on the table's algorithm
    of the nearest tabled row count at or above it (else below), and on the fastest candidate at that count (what
    tuning the count itself would give), µs a GEMM from a graph, weights cold; then ms for a whole pass's projections
    (each shape times its layers) and whether every variant gave the heuristic's bits."""
    from collections import Counter

    from kev_backend.dev import sizes
    from kev_backend.gpu import cublaslt
    from kev_backend.model.qwen35 import Qwen35Config

    device = torch.device("cuda")
    gemms = cublaslt.pretuned(device)
    config = Qwen35Config.from_dict(sizes.SIZES[args.size].config)
    by_kind = sizes.fused_projections(config)
    layers = Counter(shape for kind in config.layer_types for shape in by_kind[kind])
    torch.manual_seed(0)
    for m in (int(part) for part in args.rows.split(",")):
        totals = {"heuristic": 0.0, "neighbour": 0.0, "best": 0.0}
        same = True
        for (n, k), count in sorted(layers.items()):
            weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(2)]
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            y = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            plan = gemms.plan(m, n, k)
            tabled = sorted(r for (r, tn, tk) in gemms.algos if (tn, tk) == (n, k))
            near = next((r for r in tabled if r >= m), tabled[-1] if tabled else None)
            variants = {"heuristic": plan.default, "neighbour": gemms.algos[near, n, k] if near else plan.default}
            expected = None
            us = {}
            for name, algo in [*variants.items(), *((f"c{i}", a) for i, a in enumerate(plan.candidates()))]:
                try:
                    plan.run(algo, x, weights[0], y, gemms.workspace)
                except RuntimeError as error:  # an algorithm this row count cannot take
                    print(f"gemmrows {args.size} M={m} {n}x{k} {name}: {error}", flush=True)
                    continue
                run = lambda a=algo, p=plan, x=x, y=y, ws=weights: [p.run(a, x, w, y, gemms.workspace) for w in ws]  # noqa: E731
                if expected is None:
                    expected = y.clone()
                same = same and torch.equal(y, expected)
                us[name] = graph_ms(run, repeat=3) * 1000 / len(weights)
            best = min(value for name, value in us.items() if name.startswith("c"))
            us["best"] = best
            for name in totals:
                totals[name] += us.get(name, us["heuristic"]) * count / 1000
            print(
                f"gemmrows {args.size} M={m} {n}x{k} x{count} (nearest tabled {near}): heuristic "
                f"{us['heuristic']:.1f} neighbour {us.get('neighbour', float('nan')):.1f} best {best:.1f} us",
                flush=True,
            )
        print(
            f"gemmrows {args.size} M={m} pass: "
            + " ".join(f"{name} {ms:.2f} ms" for name, ms in totals.items())
            + f"; {'same bits' if same else 'BITS DIFFER'}",
            flush=True,
        )


@contextlib.contextmanager
def gpu_clocks(samples: list[tuple[float, float]]) -> Iterator[None]:
    """Appends (SM MHz, watts) of GPU 0 every 20 ms while the block runs, read from nvidia-smi (nothing without it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        yield
        return
    query = [smi, "-i", "0", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "20"]
    child = subprocess.Popen(query, stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)  # nvidia-smi's own start-up
    try:
        yield
    finally:
        time.sleep(0.05)
        child.terminate()
        out, _ = child.communicate()
        for line in out.splitlines()[1:]:  # the first sample predates the block
            parts = [part.strip() for part in line.split(",")]
            with contextlib.suppress(ValueError, IndexError):
                samples.append((float(parts[0]), float(parts[1])))


def clocks_text(samples: list[tuple[float, float]]) -> str:
    if not samples:
        return "no clock samples"
    mhz, watts = zip(*samples)
    return f"SM {statistics.median(mhz):.0f} MHz (min {min(mhz):.0f}), {statistics.median(watts):.0f} W"


def gemmsustained(args) -> None:
    """A GEMM rate in bursts against sustained: a Kev size's projections of one pass (--size) at --rows rows, each
    layer with weights of its own, on the heuristic's algorithm without split-K (an eager pass's). First each shape
    timed alone in a short graph, as gemmrows does, summed over the pass; then the pass's GEMMs back to back in one
    graph, as the pass runs them, replayed --replays times after a second idle. With --candidates, each shape's
    algorithms without split-K sustained (that shape's GEMMs back to back for a quarter of a second, after as long
    again), and the pass with each shape on its fastest sustained algorithm against the heuristic's, in turn. Then
    the 8,192³ GEMM of the bench's floor: alone with the GPU idle between calls (the bench's ceiling) and back to back
    for as long as the pass. With nvidia-smi, the SM clock and the power drawn in each sustained run."""
    from kev_backend.dev import sizes
    from kev_backend.dev.floors import ceilings
    from kev_backend.gpu import cublaslt
    from kev_backend.model.qwen35 import Qwen35Config

    device = torch.device("cuda")
    gemms = cublaslt.pretuned(device, "off")
    config = Qwen35Config.from_dict(sizes.SIZES[args.size].config)
    by_kind = sizes.fused_projections(config)
    sequence = [shape for kind in config.layer_types for shape in by_kind[kind]]
    m = args.rows
    torch.manual_seed(0)
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for n, k in sequence]
    inputs = {k: torch.randn(m, k, device=device, dtype=torch.bfloat16) for k in {k for _, k in sequence}}
    outputs = {n: torch.empty(m, n, device=device, dtype=torch.bfloat16) for n in {n for n, _ in sequence}}
    plans = {(n, k): gemms.plan(m, n, k) for n, k in set(sequence)}
    heuristic = {shape: plan.default for shape, plan in plans.items()}
    tflop = sum(2 * m * n * k for n, k in sequence) / 1e12

    def run(layers: list[int], algos: dict) -> None:
        for i in layers:
            n, k = sequence[i]
            plans[n, k].run(algos[n, k], inputs[k], weights[i], outputs[n], gemms.workspace)

    def captured(layers: list[int], algos: dict) -> torch.cuda.CUDAGraph:
        return captured_graph(lambda: run(layers, algos))

    everything = list(range(len(sequence)))
    alone = 0.0
    for shape in set(sequence):
        layers = [i for i, s in enumerate(sequence) if s == shape]
        alone += graph_ms(lambda layers=layers: run(layers[:2], heuristic), repeat=3) / 2 * len(layers)
    print(f"gemmsustained {args.size} M={m}: {tflop:.1f} TFLOP a pass; each shape alone, summed: "
          f"{alone:.1f} ms ({tflop / alone * 1000:.0f} TFLOP/s)", flush=True)  # fmt: skip

    whole = captured(everything, heuristic)
    time.sleep(1.0)
    samples: list[tuple[float, float]] = []
    with gpu_clocks(samples):
        times = replayed(whole, args.replays)
    sustained = statistics.median(times[1:])
    rate = tflop / sustained * 1000
    print(f"gemmsustained {args.size} M={m}: the pass's GEMMs back to back: first {times[0]:.1f} ms, then median "
          f"{sustained:.1f} ms ({rate:.0f} TFLOP/s); {clocks_text(samples)}", flush=True)  # fmt: skip

    if args.candidates:
        fastest = dict(heuristic)
        for shape in sorted(set(sequence)):
            layers = [i for i, s in enumerate(sequence) if s == shape]
            n, k = shape
            us: dict[int, float] = {}
            expected = None
            candidates = plans[shape].candidates()
            for index, algo in enumerate(candidates):
                algos = {shape: algo}
                try:
                    run(layers[:1], algos)
                except RuntimeError:  # an algorithm this row count cannot take
                    continue
                expected = outputs[n].clone() if expected is None else expected
                if not torch.equal(outputs[n], expected):
                    print(f"gemmsustained {n}x{k} c{index}: BITS DIFFER", flush=True)
                graph = captured(layers, algos)
                count = max(2, round(250 / replayed(graph, 1)[0]))
                replayed(graph, count)  # the power limit reached, as inside a long pass
                us[index] = sum(replayed(graph, count)) / count / len(layers) * 1000
                del graph
            best = min(us, key=us.__getitem__)
            fastest[shape] = candidates[best]
            print(f"gemmsustained {args.size} M={m} {n}x{k} x{len(layers)} sustained us a GEMM: "
                  + " ".join(f"c{i} {t:.1f}" for i, t in us.items()) + f"; fastest c{best}", flush=True)  # fmt: skip
        tuned = captured(everything, fastest)
        pairs = [[statistics.median(replayed(g, args.replays)[1:]) for g in (whole, tuned)] for _ in range(3)]
        print(f"gemmsustained {args.size} M={m}: the pass's GEMMs back to back, heuristic against fastest sustained, "
              "in turn: " + ", ".join(f"{a:.1f}/{b:.1f}" for a, b in pairs) + " ms", flush=True)  # fmt: skip
        del tuned
    del whole
    weights.clear()  # the pass's memory back before the 8,192³ GEMM
    inputs.clear()
    outputs.clear()

    burst = ceilings(device)["bf16_gemm_tflops"]  # the bench's: the GPU idle before each call
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    square = 2 * 8192**3 / 1e12
    count = max(1, round(sustained / (square / burst * 1000)))
    time.sleep(1.0)
    samples = []
    with gpu_clocks(samples):
        back = graph_ms(lambda: a @ b, repeat=count)
    print(f"gemmsustained 8192^3: alone {burst:.0f} TFLOP/s; {count} back to "
          f"back {square / back * 1000:.0f} TFLOP/s; {clocks_text(samples)}", flush=True)  # fmt: skip


def register(sub) -> None:
    command(sub, "gemm", gemm, "each projection's GEMM: batch invariance by row count and speed, by BLAS library")
    parser = command(sub, "gemmpad", gemmpad, "each projection's GEMM by row count, and the fastest padding")
    parser.add_argument("--size", choices=SIZES, default="4b", help="a Kev size's projections (default 4b)")
    parser.add_argument("--rows", default="64:3328:32", help="row counts FIRST:LAST:STEP (default 64:3328:32)")
    parser = command(sub, "gemmrows", gemmrows, "an eager pass's GEMMs: heuristic, nearest tabled and tuned algorithm")
    parser.add_argument("--size", choices=SIZES, default="4b", help="a Kev size's projections (default 4b)")
    parser.add_argument("--rows", default="2630", help="row counts, comma-separated (default 2630)")
    parser = command(sub, "gemmsustained", gemmsustained, "a pass's GEMMs and the floor's GEMM in bursts and sustained")
    parser.add_argument("--size", choices=SIZES, default="4b", help="a Kev size's projections (default 4b)")
    parser.add_argument("--rows", type=int, default=2630, help="the pass's rows (default 2630)")
    parser.add_argument("--replays", type=int, default=5, help="replays of the pass's GEMMs (default 5)")
    parser.add_argument("--candidates", action="store_true", help="each shape's algorithms, sustained")
