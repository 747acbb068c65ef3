"""The host's work around a pass: its phases against the GPU's spans, primitive costs on this machine, the work before
a pass on the CPU alone, whether a graph's launch delays its first kernel, and a host profile of short6.

The timers wrap methods of the engine each subcommand builds (instance attributes), so nothing outlives it."""

from __future__ import annotations

import cProfile
import pstats
import statistics
import tempfile
import time
from dataclasses import fields
from pathlib import Path

import torch

from .common import command, kev4b_engine


def _timed(into: dict[str, float], name: str, fn, scale: float = 1000.0, accumulate: bool = True):
    """fn, adding its host time (seconds × scale) to into[name] (or setting it) at each call."""

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        out = fn(*args, **kwargs)
        spent = (time.perf_counter() - started) * scale
        into[name] = into.get(name, 0.0) + spent if accumulate else spent
        return out

    return wrapper


def hostsplit(args) -> None:
    """Where one request's model time (launch to probabilities on the host) goes, from graphs, for short6 and long5
    on new and banked states: the host's phases before the replay (layout, bucket, fill), the replay() call and the
    head's launches, each timed on the host, against the GPU's spans from the launch to the graph's start, the graph,
    and the head after it; the rest ("after gpu") is the copy to the host, the wait and the lists. Medians of 30."""
    from kev_backend.dev import bench
    from kev_backend.dev.workloads import long5, short6

    engine = kev4b_engine(graphs=True)
    scorer = engine.scorer
    graphs = scorer.graphs
    host: dict[str, float] = {}
    marks: dict[str, torch.cuda.Event] = {}

    def marked(name: str, fn):
        timed = _timed(host, name, fn)

        def wrapper(*a, **kw):
            marks[f"{name} start"] = torch.cuda.Event(enable_timing=True)
            marks[f"{name} start"].record()
            out = timed(*a, **kw)
            marks[f"{name} end"] = torch.cuda.Event(enable_timing=True)
            marks[f"{name} end"].record()
            return out

        return wrapper

    scorer.layout = _timed(host, "layout", scorer.layout)
    graphs.bucket_for = _timed(host, "bucket", graphs.bucket_for)
    graphs.inputs.fill = _timed(host, "fill", graphs.inputs.fill)
    graphs.run = marked("graph", graphs.run)  # the fill, then the replay (run's host time less fill's)
    scorer.pointer.project = _timed(host, "project", scorer.pointer.project)
    scorer.pointer.softmax = marked("head", scorer.pointer.softmax)
    scorer._launch = marked("launch", scorer._launch)
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

            before_graph = host["layout"] + host["bucket"] + host["graph"] + host["head"] + host["project"]
            rows.append(
                {
                    "model": engine.last_batch.model_ms,
                    "host launch": host["launch"],
                    "layout": host["layout"],
                    "bucket": host["bucket"],
                    "fill": host["fill"],
                    "replay": host["graph"] - host["fill"],
                    "head launch": host["head"] + host["project"],
                    "other host": host["launch"] - before_graph,
                    "gpu to graph": gpu("launch start", "graph start"),
                    "gpu graph": gpu("graph start", "graph end"),
                    "gpu head": gpu("graph end", "head end"),
                    "after gpu": engine.last_batch.model_ms - gpu("launch start", "head end"),
                }
            )
        medians = {name: statistics.median(row[name] for row in rows) for name in rows[0]}
        print(f"hostsplit {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()), flush=True)


def hostops(args) -> None:
    """What the host's primitive steps cost on this machine, µs a call (median of 5 runs of 200): a Python loop, a
    small kernel launch, CUDA events, a pinned copy, numpy writing a list into pinned memory; then short6's layout,
    bucket and fill alone (a banked state's rows, from graphs): whether hostsplit's phases are this CPU or something
    in them."""
    from kev_backend.dev.workloads import short6
    from kev_backend.gpu.passes import Row, lay_out

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
    engine = kev4b_engine(graphs=True)
    scorer, graphs = engine.scorer, engine.scorer.graphs
    engine.answer([short6(None)])
    batch = engine.prepare_batch([short6(None)])
    rows = [
        Row(r, q, tokens, encoded.state)
        for r, (_, _, encoded) in enumerate(batch.accepted)
        for q, tokens in enumerate(encoded.questions)
    ]
    slots = {rows[0].state: scorer.bank.get(rows[0].state)}
    page = scorer.bank.pool.page_size
    layout = lay_out(rows, [], slots, page)
    bucket = graphs.bucket_for(layout)
    print(f"hostops short6 same layout: {us(lambda: lay_out(rows, [], slots, page)):.2f} us", flush=True)
    print(f"hostops short6 same bucket: {us(lambda: graphs.bucket_for(layout)):.2f} us", flush=True)
    fill = lambda: graphs.inputs.fill(bucket, layout, scorer.bank.pool, scorer.pad_id)  # noqa: E731
    print(f"hostops short6 same fill: {us(fill):.2f} us", flush=True)


def hostpath(args) -> None:
    """The host's work before a pass can start, on this machine's CPU (no GPU needed): the scorer's plan, the bank,
    the layout and the fill of a graph bucket's buffers for long5 and short6 on new states and short6 on its banked
    state (the pass itself stubbed), µs, medians of 40 after 5, on the tiny model with the fused path's bookkeeping
    at full size (graphs up to 4,096 tokens, 1 GiB bank)."""
    from kev_backend.dev import bench, synthetic
    from kev_backend.dev.workloads import long5, short6
    from kev_backend.engine.engine import Engine, EngineOptions
    from kev_backend.gpu import scorer as scorer_module
    from kev_backend.gpu.pass_kernels import PassKernels
    from kev_backend.gpu.passes import Row
    from kev_backend.gpu.scorer import FusedScorer

    directory = Path(tempfile.mkdtemp())
    synthetic.build(directory)
    reference = Engine.from_checkpoint(directory / "kev", EngineOptions(bank_bytes=0))
    ck = reference.checkpoint
    no_kernels = PassKernels(*[None] * len(fields(PassKernels)))  # the pass is stubbed: no kernel runs
    scorer = FusedScorer(
        ck.model,
        ck.head,
        ck.temperature,
        reference.tokenizer.delimiters.pad,
        EngineOptions(bank_bytes=1 << 30, graphs=True).fused(),
        dtype=torch.float32,
        kernels=no_kernels,
    )
    graphs = scorer.graphs
    phases: dict[str, float] = {}
    scorer_module.lay_out = _timed(phases, "layout", scorer_module.lay_out, scale=1e6, accumulate=False)
    graphs.inputs.fill = _timed(phases, "fill", graphs.inputs.fill, scale=1e6, accumulate=False)
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


def launch(args) -> None:
    """Whether a graph's launch delays its first kernel: a short6 on its banked state and a new long5 are answered,
    then their buckets' graphs replayed with those inputs, plainly and behind a ~2 ms sleep kernel (the launch done
    while the GPU sleeps): the host time of replay(), the GPU time from before the replay to after it, and from the
    sleep's end. The plain figure less the one behind the sleep is what the launch adds."""
    from kev_backend.dev import bench
    from kev_backend.dev.workloads import long5, short6

    engine = kev4b_engine(graphs=True)
    graphs = engine.scorer.graphs

    def timer() -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

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


def hostprofile(args) -> None:
    """short6 on its banked state (from graphs; --no-graphs: eagerly): ms a request, the host functions of 10 requests
    by own time (cProfile), and the host time of one Triton launch (rms_norm) against one torch op."""
    from kev_backend.dev.workloads import short6
    from kev_backend.gpu import kernels

    engine = kev4b_engine(args)
    for _ in range(3):
        engine.answer([short6(None)])
    t = time.perf_counter()
    for _ in range(10):
        engine.answer([short6(None)])
    print(f"hostprofile short6 same: {(time.perf_counter() - t) * 100:.2f} ms per request", flush=True)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(10):
        engine.answer([short6(None)])
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
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
        print(f"hostprofile {label}: {host:.1f} us per launch (host)", flush=True)


def outputcounts(args) -> None:
    """usage.output_tokens of short6 responses on this machine's CPU (no GPU needed): each answers' JSON counted whole
    through the tokenizer against in pieces with kept counts (KevTokenizer.count_tokens), µs, medians of --repeat
    after --warm responses, the probabilities of each drawn at random (4 decimals, as answers give them); both counts
    checked equal. The benches' word-level tokenizer, or --tokenizer DIR's tokenizer.json (a Kev base's)."""
    import json
    import random

    from kev_backend.dev import synthetic
    from kev_backend.dev.workloads import short6
    from kev_backend.engine.engine import Engine, EngineOptions
    from kev_backend.protocol.answers import answers_json
    from kev_backend.protocol.encoding import KevTokenizer

    directory = Path(tempfile.mkdtemp())
    synthetic.build(directory)
    engine = Engine.from_checkpoint(directory / "kev", EngineOptions(bank_bytes=0))
    answers = engine.answer([json.dumps(short6(0))])[0]["answers"]
    tokenizer = KevTokenizer(Path(args.tokenizer)) if args.tokenizer else engine.tokenizer
    rng = random.Random(0)

    def drawn() -> str:  # the answers' shape with other probabilities, as responses differ
        out = json.loads(json.dumps(answers))
        for answer in out.values():
            for key, value in answer.items():
                if isinstance(value, float):
                    answer[key] = round(rng.random(), 4)
                elif isinstance(value, dict):
                    answer[key] = {option: round(rng.random(), 4) for option in value}
        return answers_json(out)

    for _ in range(args.warm):
        tokenizer.count_tokens(drawn())
    whole, pieces = [], []
    for _ in range(args.repeat):
        text = drawn()
        started = time.perf_counter()
        counted = len(tokenizer.tokenizer.encode(text, add_special_tokens=False).ids)
        whole.append(time.perf_counter() - started)
        started = time.perf_counter()
        assert tokenizer.count_tokens(text) == counted
        pieces.append(time.perf_counter() - started)
    print(
        f"outputcounts: {len(text)} characters, {'in pieces' if tokenizer.in_pieces else 'whole (not in pieces)'}; "
        f"whole {1e6 * statistics.median(whole):.0f} µs, with kept counts {1e6 * statistics.median(pieces):.0f} µs "
        f"({len(tokenizer.counts)} pieces kept after {args.warm} responses)",
        flush=True,
    )


def register(sub) -> None:
    command(sub, "hostsplit", hostsplit, "one request's model time by host phase and GPU span, from graphs")
    command(sub, "hostops", hostops, "the host's primitive steps (launch, events, pinned copy), short6's layout, fill")
    command(sub, "hostpath", hostpath, "the host's work before a pass, on the CPU alone (no GPU needed)")
    command(sub, "launch", launch, "whether a graph's launch delays its first kernel")
    command(sub, "hostprofile", hostprofile, "short6 same: host functions by own time, launch costs", engine=True)
    counts = command(sub, "outputcounts", outputcounts, "a response's output tokens, counted whole and in pieces (CPU)")
    counts.add_argument("--tokenizer", help="a directory holding tokenizer.json (default: the benches' tokenizer)")
    counts.add_argument("--warm", type=int, default=15_000, help="responses counted before the timed ones")
    counts.add_argument("--repeat", type=int, default=300, help="responses timed")
