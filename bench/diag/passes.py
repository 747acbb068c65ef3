"""Whole passes on a Kev-4B engine: latency and throughput, GPU time by kernel, one request's timeline, the GPU's idle
gaps at 64 clients, and whether answers depend on the batch."""

from __future__ import annotations

import cProfile
import json
import pstats
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from .common import command, kev4b_engine, patched

# The segment kernels and how many layers call them (Kev-4B: 24 DeltaNet layers, 8 attention layers).
LAYER_KERNELS = {
    "_conv_scan_kernel": 24,
    "_chunk_prep_kernel": 24,
    "_chunked_delta_rule_kernel": 24,
    "_rows_attention_kernel": 8,
    "_states_attention_kernel": 7,  # the last layer computes no new state's queries
}


def latency(args) -> None:
    """The bench's latency figures alone (median of 20, model time) for short6 and long5, new and same state, and
    requests/s at 64 clients (3 s each), pipelined and serial: a quick engine-level comparison of the engine options
    (--no-graphs, --graph-max-tokens)."""
    from kev_backend.dev import bench
    from kev_backend.dev.workloads import long5, short6

    engine = kev4b_engine(args)
    options = engine.options
    print("graphs", options.graphs, flush=True)
    for label, make in (("short6", short6), ("long5", long5)):
        print(label, bench.latency(engine, make), flush=True)
        for pipelined in (True, False):
            bench.throughput(engine, make, 64, 1.0, pipelined)
            measured = bench.throughput(engine, make, 64, 3.0, pipelined)
            print(label, "64 clients", "pipelined" if pipelined else "serial", measured, flush=True)


def scaling(args) -> None:
    """The bench's scaling points alone: long5's questions on states of 2k to 64k tokens, median model time of 3 new
    and 3 same-state requests each, beside the new state's compute floor: a quick engine-level comparison of changes
    to long states' passes."""
    from kev_backend.dev import bench, floors

    engine = kev4b_engine(args)
    ceil = floors.ceilings(engine.device)
    for tokens in bench.SCALING_TOKENS:
        point = bench.scaling_point(engine, tokens, ceil, repeat=3)
        print("scaling", {key: round(point[key], 2) for key in ("state_tokens", "new_ms", "same_ms", "floor_ms")})


def kernels(args) -> None:
    """GPU time by kernel for a busy short6 batch (32 new), a long5 batch (8 new), one new short6 and one short6 on a
    banked state, one new long5 (as the graphs replay them; --no-graphs: eager passes), or with --state-tokens N
    long5's questions on one new state of N tokens (the bench's scaling points: where a long state's time goes);
    then one layer's calls of each segment kernel in launch order, µs: which of a pass's groups (long states, short
    states, rows) their time goes to."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from kev_backend.dev.bench import state_length
    from kev_backend.dev.workloads import long5, short6, sized

    engine = kev4b_engine(args)
    counter = iter(range(10**6))
    cases = {
        "short6x32new": lambda: [short6(next(counter)) for _ in range(32)],
        "long5x8new": lambda: [long5(next(counter)) for _ in range(8)],
        "short6new": lambda: [short6(next(counter))],
        "short6same": lambda: [short6(None)],
        "long5new": lambda: [long5(next(counter))],
    }
    if args.state_tokens:
        count = state_length(engine)
        cases = {f"state{args.state_tokens}new": lambda: [sized(args.state_tokens, count, next(counter))]}
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
        calls: dict[str, list[float]] = defaultdict(list)
        for event in sorted(prof.events(), key=lambda e: e.time_range.start):
            if event.device_type == DeviceType.CUDA and event.name in LAYER_KERNELS:
                calls[event.name].append(event.device_time_total)
        for name in LAYER_KERNELS:
            per_layer = len(calls[name]) // max(1, LAYER_KERNELS[name])
            first = " ".join(f"{us:.1f}" for us in calls[name][:per_layer])
            print(f"  first layer {name}: {first} µs", flush=True)


def timeline(args) -> None:
    """Where one request's model time goes besides its kernels (as the GPU config runs it; --no-graphs: eagerly), new
    state and same state, for each workload of --shapes: model time (launch to probabilities on the host) against the
    GPU's busy time, the wait from launch to its first kernel, the idle gaps between kernels, and from the last
    kernel to the answer; then the host functions of 20 requests on new states of the first workload by own time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    from kev_backend.dev import bench, workloads

    engine = kev4b_engine(args)
    shapes = args.shapes.split(",")
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
        spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
        call = next(e.time_range for e in events if e.name == "kev_answer" and e.device_type == DeviceType.CPU)
        busy, gaps, end = 0.0, [], spans[0][0]
        for lo, hi in spans:
            if lo > end:
                gaps.append(lo - end)
            busy += max(0.0, hi - max(lo, end))
            end = max(end, hi)
        span = (spans[-1][1] - spans[0][0]) / 1000
        print(
            f"timeline {label}: model {model_ms:.2f} ms, kernels {len(spans)} over {span:.2f} ms, busy "
            f"{busy / 1000:.2f} ms, {len(gaps)} gaps {sum(gaps) / 1000:.2f} ms (over 5 us: "
            f"{sum(g for g in gaps if g > 5) / 1000:.2f} ms); answer call {(call.end - call.start) / 1000:.2f} ms, "
            f"its first kernel after {(spans[0][0] - call.start) / 1000:.2f} ms, its end "
            f"{(call.end - spans[-1][1]) / 1000:.2f} ms after the last",
            flush=True,
        )
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        engine.answer([getattr(workloads, shapes[0])(next(bench.NEW_STATE))])
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(22)


def gaps(args) -> None:
    """--workload at 64 closed-loop clients through the pipeline (as the GPU config runs it; --no-graphs: eagerly): per
    batch, when the model thread took it against when the batch before was done; the model thread's time per batch
    by phase of its launch (collect, on the delivery thread, waits for the GPU), its waits for the next batch,
    Python's garbage collections, how busy the GPU is and its idle gaps by length."""
    import gc

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from kev_backend.dev import bench, workloads
    from kev_backend.dev.grow import GrowingClients
    from kev_backend.engine.pipeline import Pipeline
    from kev_backend.gpu import scorer as scorer_module

    warm_s, measure_s = {"short6": (1.0, 2.0), "long5": (3.0, 6.0), "grow": (2.0, 6.0)}[args.workload]
    engine = kev4b_engine(args, **({"bank_bytes": 48 << 30} if args.workload == "grow" else {}))
    if args.workload == "grow":
        make = GrowingClients(engine, 64)
        make.warm(engine, warm_s)
    else:
        make = getattr(workloads, args.workload)
        bench.throughput(engine, make, 64, warm_s, True)
    scorer = engine.scorer
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)  # (start, end) of each call, by phase

    def timed(name, fn):
        def wrapper(*a, **kw):
            started = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spans[name].append((started, time.perf_counter()))

        return wrapper

    # This engine's own objects (the fused scorer's phases) and, for this process only, the pass layout the scorer
    # module calls: the wrappers go with them.
    scorer.next_pass = timed("plan", scorer.next_pass)
    scorer.run_group = timed("run_group", scorer.run_group)
    scorer.forward = timed("forward", scorer.forward)
    scorer_module.lay_out = timed("layout", scorer_module.lay_out)
    scorer_module.exact_input = timed("pass_input", scorer_module.exact_input)
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

    # Each measured batch's pipeline job: its size, when submit was called and returned, and the job.
    jobs: list[tuple[int, float, float, object]] = []
    submit = Pipeline.submit

    def recording_submit(self, bodies, *a, **kw):
        called = time.perf_counter()
        submit(self, bodies, *a, **kw)
        jobs.append((len(bodies), called, time.perf_counter(), self._previous))

    spans.clear()
    gc.callbacks.append(on_gc)
    try:
        with patched(Pipeline, submit=recording_submit), profile(activities=[ProfilerActivity.CUDA]) as prof:
            measured = bench.throughput(engine, make, 64, measure_s, True)
    finally:
        gc.callbacks.remove(on_gc)
    # Per batch, ms: from submit to the model thread taking it; taken after the batch before was done (> 0: the GPU
    # had nothing of this pipeline queued meanwhile); submit's return before this batch was done; the expected
    # done's error (> 0: expected later than it was).
    for (size, called, returned, job), (_, _, _, before) in zip(jobs[1:], jobs):
        expected = (job.expected_done - job.done) * 1000 if job.expected_done else float("nan")
        print(
            f"gaps batch {size:3d}: submit to taken {(job.taken - called) * 1000:7.1f}, "
            f"taken after previous done {(job.taken - before.done) * 1000:7.1f}, "
            f"returned before done {(job.done - returned) * 1000:7.1f}, expected done error {expected:7.1f}",
            flush=True,
        )
    launches = spans["launch"]  # the model thread's batches
    batches = len(launches)
    phases = ", ".join(
        f"{name} {sum(end - start for start, end in calls) * 1000 / max(batches, 1):.2f}"
        for name, calls in spans.items()
    )
    print(f"gaps {args.workload}: {measured}; model thread per batch ({batches} batches), ms: {phases}", flush=True)
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
    busy, idle, end = 0.0, [], intervals[0][0]
    start0 = end
    for lo, hi in intervals:
        if lo > end:
            idle.append((lo - end) / 1000)
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    span = (end - start0) / 1000
    print(f"gaps: GPU span {span:.0f} ms, busy {busy / 1000:.0f} ms ({busy / 10 / span:.1f} %)", flush=True)
    for lo, hi in ((0.0, 0.05), (0.05, 0.5), (0.5, 2), (2, 10), (10, 1e9)):
        inside = [g for g in idle if lo <= g < hi]
        print(f"gaps {lo}-{hi} ms: {len(inside)}, {sum(inside):.1f} ms idle", flush=True)


def invariance(args) -> None:
    """Where a question's answer depends on the batch it rides in (Kev-4B shapes): states computed in a batch (A) or
    alone (B, then C: the same batches again reading B's banked states), eager passes; compares answers and the
    picked hidden states the head reads, and names the worst requests' state and row lengths."""
    from kev_backend.dev import sizes, synthetic
    from kev_backend.dev.parity import compare, scored
    from kev_backend.dev.workloads import realistic
    from kev_backend.engine.engine import Engine, EngineOptions
    from kev_backend.gpu.scorer import FusedScorer

    directory = Path(tempfile.mkdtemp())
    synthetic.write_tokenizer(directory)
    checkpoint = synthetic.synthetic_checkpoint(sizes.KEV4B_CONFIG, directory, "cuda", seed=0)
    captured: list = []
    original = FusedScorer.run_group

    # Each pass's picked hidden states, by (request, question): (<decide>, options).
    def capturing(self, rows, found=None):
        picked, decides = original(self, rows, found)
        widths = {(row.request, row.question): len(row.tokens.option_ends) for row in rows}
        host = picked.float().cpu()
        captured.append({key: (host[at], host[at + 1 : at + 1 + widths[key]]) for key, at in decides.items()})
        return picked, decides

    with patched(FusedScorer, run_group=capturing):
        options = EngineOptions(device="cuda", backend="fused", bank_bytes=16 << 30, graphs=False, warm=False)
        engine = Engine(checkpoint, options)
        encoded = [engine.prepare(r)[1] for r in realistic(300, seed=2, max_words=2300)]
        runs, hidden = {}, {}
        for name, size, clear in (("A", 32, True), ("B", 1, True), ("C", 32, False)):
            if clear:
                engine.bank.clear()
            captured.clear()
            runs[name] = scored(engine, encoded, size)
            hidden[name] = [call[key] for call in captured for key in sorted(call)]
        for x, y in (("A", "B"), ("A", "C"), ("B", "C")):
            gap = max((a[0] - b[0]).abs().max().item() for a, b in zip(hidden[x], hidden[y]))
            print(x, "vs", y, compare(runs[x], runs[y]), "hidden max", gap, flush=True)
        gaps_ = [
            max((abs(p - q) for pa, pb in zip(a, b) for p, q in zip(pa, pb)), default=0.0)
            for a, b in zip(runs["A"], runs["B"])
        ]
        for i in sorted(range(len(encoded)), key=lambda i: -gaps_[i])[:6]:
            rows = [len(q.tokens) for q in encoded[i].questions]
            print(f"  request {i} state {len(encoded[i].state)} rows {rows} A-B {gaps_[i]:.5f}", flush=True)


def batchtrace(args) -> None:
    """Where a question's numbers first depend on its batch (kev_backend/dev/invariance.py), Kev-4B shapes, eager
    passes: the realistic set, each request alone and in --mixes shuffles cut into batches of --batch, bit for bit;
    the ops where differing questions first differed. Writes batchtrace.json into --out."""
    from kev_backend.dev.invariance import trace
    from kev_backend.dev.workloads import realistic

    engine = kev4b_engine(graphs=False)
    encoded = [engine.prepare(r)[1] for r in realistic(args.requests, seed=2, max_words=2300)]
    report = trace(engine.scorer, encoded, mixes=args.mixes, batch=args.batch)
    print("batchtrace", json.dumps(report), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "batchtrace.json").write_text(json.dumps(report, indent=1) + "\n")


def register(sub) -> None:
    command(sub, "latency", latency, "latency and 64-client throughput of short6 and long5", engine=True)
    command(sub, "scaling", scaling, "new and same-state latency on states of 2k to 64k tokens", engine=True)
    summary = "GPU time by kernel for busy and single short6 and long5 passes"
    parser = command(sub, "kernels", kernels, summary, engine=True)
    parser.add_argument("--state-tokens", type=int, default=0, help="one new state of this many tokens instead")
    summary = "one request's model time against its kernels' busy time and gaps"
    parser = command(sub, "timeline", timeline, summary, engine=True)
    parser.add_argument("--shapes", default="short6", help="comma-separated workloads (default short6)")
    parser = command(sub, "gaps", gaps, "the GPU's idle gaps and the model thread's phases at 64 clients", engine=True)
    about = "grow: 64 clients, each growing its own conversation near 8k tokens, on a 48 GiB bank (the bench's rps_64)"
    parser.add_argument("--workload", choices=("short6", "long5", "grow"), default="short6", help=about)
    command(sub, "invariance", invariance, "where answers depend on the batch")
    parser = command(sub, "batchtrace", batchtrace, "the op where a question's numbers first depend on its batch")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--mixes", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("out"))
