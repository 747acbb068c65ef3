"""In-process benchmark on the GPU: `python -m kev_backend.dev.bench` (`make bench`).

Random weights of a Kev size's shapes (`--size`: 0.8b, 4b (default), 9b, 27b; kev_backend.dev.sizes.SIZES), or a
checkpoint with --checkpoint (and --base). Workloads follow Kev's serving benchmark: `short6` (a ~34-token support
ticket, 6 questions) and `long5` (~2,200-token document, 5 questions), each on a new state (prefix "Ticket {i}. ") and
on the same state: median model time of 20; then requests/s at 1, 8, 32 and 64 concurrent in-process clients on new
states, batched the way the Triton dynamic batcher batches them (every request waiting when the engine frees up rides
the next batch). Beside each: the floor (FLOPs at the measured bf16 GEMM rate, weight bytes at the measured copy
bandwidth; new-state latency and scaling points also at the sustained GEMM rate, `ceilings`) and the naive
transformers baseline (one full sequence per question) where the image has transformers.
`--quick` keeps latencies and short6 at 64 clients (no profiler passes, serial loop or baseline); `--scaling` adds
long5's questions on states of 2k to 64k tokens, new and banked, with the GPU memory each needed, their compute
floors, and how many 64k states the bank holds; `--determinism N` answers N questions alone and in batch mixes, bit
for bit (kev_backend/dev/determinism.py).
Writes bench/results/<date>-<gpu>-<commit>[-<size>].json and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import queue
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..engine.engine import Engine, EngineOptions, PreparedBatch, dumps
from ..engine.pipeline import Pipeline
from ..gpu.memory import states_held
from ..gpu.pool import StatePool
from ..model.checkpoint import KevCheckpoint, LoadOptions, load_checkpoint
from ..model.qwen35 import Qwen35Config
from ..settings import use_cuda_allocator
from . import determinism, sizes, synthetic
from .floors import ceilings, floor_rps, floors, pass_flops, request_cost
from .provenance import commit
from .workloads import long5, realistic, short6, sized, state_counter

CLIENTS = (1, 8, 32, 64)
MAX_BATCH = 64  # Triton's max_batch_size (model_repository/kev/config.pbtxt): the largest batch a server forms
# The scaling workload's states, <state> included: 2k to 32k, and one under Kev's 65,536-token limit.
SCALING_TOKENS = (2048, 4096, 8192, 16384, 32768, 65_535)
GIB = 1 << 30


def model_time(engine: Engine, body: dict) -> float:
    engine.answer([body])
    return engine.last_batch.model_ms


# Every "new" request of the run gets a number never used before, so it really misses the bank.
NEW_STATE = itertools.count(1)


def latency(engine: Engine, make, repeat: int = 20) -> dict[str, float]:
    """Median model time of `repeat` requests on new states and on the same state; and the first of each after the
    engine started (its own warm-up done; the target: within 2x the median), then two more warm-up requests. The first
    request on the same state misses the bank like a new one; its first hit is the second."""
    first_new = model_time(engine, make(next(NEW_STATE)))
    model_time(engine, make(None))
    first_same = model_time(engine, make(None))
    for _ in range(2):
        model_time(engine, make(next(NEW_STATE)))
    new = [model_time(engine, make(next(NEW_STATE))) for _ in range(repeat)]
    same = [model_time(engine, make(None)) for _ in range(repeat)]
    new_ms, same_ms = statistics.median(new), statistics.median(same)
    return {
        "new_ms": new_ms,
        "same_ms": same_ms,
        "first_new_ms": first_new,
        "first_same_ms": first_same,
        "first_over_median": max(first_new / new_ms, first_same / same_ms),
    }


def pass_profile(engine: Engine, make, new: bool) -> dict[str, float]:
    """One request (a new state, or the same state again) under torch's profiler: GPU kernels launched, their summed
    GPU time and the wall time; a pass whose kernels keep the GPU busy a small part of its wall time is bound by
    launching them."""
    from torch.profiler import ProfilerActivity, profile

    engine.answer([make(next(NEW_STATE) if new else None)])  # the profiler's own first-call costs stay out
    torch.cuda.synchronize()
    body = make(next(NEW_STATE) if new else None)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        engine.answer([body])
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    return {"kernels": len(kernels), "gpu_busy_ms": busy_us / 1000, "wall_ms": wall * 1000}


def throughput(engine: Engine, make, clients: int, seconds: float, pipelined: bool = True) -> dict[str, float]:
    """Closed loop: `clients` threads each send a new-state request, as its JSON, when their last one is answered; one
    batching thread takes everything queued at once (up to Triton's max_batch_size) and hands it to the engine:
    through the pipeline Triton's model uses (kev_backend/engine/pipeline.py: the next batch is prepared while this one
    is on the GPU), or with `pipelined` False one `answer` call at a time. An answer counts once its response JSON is
    built: the work a server does for any front door."""
    inbox: queue.Queue = queue.Queue()
    stop = time.perf_counter() + seconds
    done: list[float] = []
    batches: list[int] = []
    failures: list[Exception] = []  # engine faults (their clients are let go, the run fails after)
    lock = threading.Lock()
    pipeline = Pipeline(engine) if pipelined else None

    def answered(events: list[threading.Event], results: list) -> None:
        for event, result in zip(events, results, strict=True):
            if isinstance(result, dict):
                dumps(result)
            event.set()

    def model_loop() -> None:
        while time.perf_counter() < stop or not inbox.empty():
            try:
                first = inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(inbox.get_nowait())
                except queue.Empty:
                    break
            bodies, events = [body for body, _ in batch], [event for _, event in batch]
            if pipeline is None:
                batches.append(len(batch))
                answered(events, engine.answer(bodies))
                continue

            def delivered(results: list | Exception, part: PreparedBatch, events: list = events) -> None:
                batches.append(len(part.indices))  # the parts the pipeline made of the batch
                if isinstance(results, Exception):
                    failures.append(results)
                    results = [None] * len(part.indices)
                answered([events[i] for i in part.indices], results)

            pipeline.submit(bodies, delivered)  # in parts, as Triton's model submits its batches

    def client() -> None:
        while time.perf_counter() < stop:
            with lock:
                i = next(NEW_STATE)
            event = threading.Event()
            body = json.dumps(make(i))
            started = time.perf_counter()
            inbox.put((body, event))
            event.wait()
            done.append(time.perf_counter() - started)

    worker = threading.Thread(target=model_loop)
    threads = [threading.Thread(target=client) for _ in range(clients)]
    begin = time.perf_counter()
    worker.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    worker.join()
    elapsed = time.perf_counter() - begin
    if pipeline is not None:
        pipeline.close()
    if failures:
        raise RuntimeError(f"{len(failures)} batches failed in the closed loop") from failures[0]
    latencies = sorted(done)
    return {
        "rps": len(done) / elapsed,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "mean_batch": statistics.fmean(batches) if batches else 0.0,
    }


def request_wall(engine: Engine, make, repeat: int = 100) -> float:
    """Median wall milliseconds of one request alone on a new state, its JSON in and its response JSON out, through
    the pipeline Triton's model uses: what a front door's one client is compared with."""
    pipeline = Pipeline(engine)
    walls = []
    try:
        for _ in range(repeat + 3):
            body, answered = json.dumps(make(next(NEW_STATE))), threading.Event()
            started = time.perf_counter()
            pipeline.submit([body], lambda results, _, answered=answered: (dumps(results[0]), answered.set()))
            answered.wait()
            walls.append(time.perf_counter() - started)
    finally:
        pipeline.close()
    return 1000 * statistics.median(walls[3:])


def state_length(engine: Engine) -> Callable[[dict[str, Any]], int]:
    """Counts a request's state as the engine encodes it (<state> included), past its limits: what `sized` aims at."""
    return state_counter(engine.tokenizer)


def memory_gib() -> dict[str, float | None]:
    """The GPU memory torch's allocator holds: the peak since the last reset, now, and reserved (None without CUDA)."""
    cuda = torch.cuda.is_available()
    return {
        "gpu_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
        "gpu_gib_allocated": torch.cuda.memory_allocated() / GIB if cuda else None,
        "gpu_gib_reserved": torch.cuda.memory_reserved() / GIB if cuda else None,
    }


def scaling_point(engine: Engine, tokens: int, ceil: dict[str, float], repeat: int) -> dict[str, Any]:
    """long5's questions on states of `tokens` tokens: median model time of `repeat` new states and of `repeat`
    requests on one banked state (after one untimed request of each: kernels at this length, the state banked);
    the GPU memory the point needed at its peak (gpu_gib: max_memory_allocated since the point began) and held
    after it; the compute floor of a new state (pass_flops at the measured bf16 rates: floors)."""
    count = state_length(engine)
    same = sized(tokens, count)
    model_time(engine, sized(tokens, count, next(NEW_STATE)))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    new = [model_time(engine, sized(tokens, count, next(NEW_STATE))) for _ in range(repeat)]
    model_time(engine, same)
    banked = [model_time(engine, same) for _ in range(repeat)]
    _, encoded = engine.prepare(same)
    flops = pass_flops(engine.checkpoint.model.config, len(encoded.state), [len(q.tokens) for q in encoded.questions])
    return {
        "state_tokens": len(encoded.state),
        "new_ms": statistics.median(new),
        "same_ms": statistics.median(banked),
        **floors(flops["total"], ceil),
        **memory_gib(),
        "flops": flops,
    }


def pool_capacity(pool: StatePool, tokens: int) -> dict[str, Any]:
    """How many states of `tokens` tokens a fused-path state pool holds at once: each takes a DeltaNet slot and
    ceil(tokens / page_size) K/V pages; the scratch slot and page are never given out."""
    return {
        "state_tokens": tokens,
        "states": states_held(pool.scratch_slot, pool.pages, pool.page_size, tokens),
        "slots": pool.scratch_slot,
        "pages": pool.pages,
        "pages_per_state": math.ceil(tokens / pool.page_size),
        "bank_gib": pool.nbytes / GIB,
    }


def bank_capacity(engine: Engine, tokens: int, check: int = 8) -> dict[str, Any]:
    """pool_capacity of the engine's bank, then the check: that many distinct states (at most `check`) answered one
    after another, then each asked again, every one a bank hit."""
    result = pool_capacity(engine.bank.pool, tokens)
    count = state_length(engine)
    bodies = [sized(tokens, count, next(NEW_STATE)) for _ in range(min(result["states"], check))]
    for body in bodies:
        engine.answer([body])
    hits = engine.bank_stats.hits
    for body in bodies:
        engine.answer([body])
    return result | {"checked": len(bodies), "hits_on_second_ask": engine.bank_stats.hits - hits}


def naive_baseline(engine: Engine, make, n: int) -> dict[str, Any]:
    """transformers' Qwen3.5 with the same weights (bf16), one full sequence per question, no state reuse."""
    try:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    except ImportError as error:
        return {"rps": None, "error": f"transformers: {error}"}
    try:
        ours = engine.checkpoint.model
        c = ours.config
        keys = (*(f for f in SHAPE_FIELDS if f != "layer_types"), "rms_norm_eps", "tie_word_embeddings")
        rope = {"rope_type": "default", "rope_theta": c.rope_theta, "partial_rotary_factor": c.partial_rotary_factor}
        config = Qwen3_5TextConfig(
            **{k: getattr(c, k) for k in keys}, layer_types=list(c.layer_types), rope_parameters=rope
        )
        with torch.device("meta"):
            hf = Qwen3_5ForCausalLM(config)
        hf.model.load_state_dict({k: v.to(torch.bfloat16) for k, v in ours.state_dict().items()}, assign=True)
        text_model = hf.model.eval()
        pad = engine.tokenizer.delimiters.pad

        def run(i: int) -> None:
            _, encoded = engine.prepare(make(i))
            rows = [encoded.state + q.tokens for q in encoded.questions]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for j, r in enumerate(rows):
                ids[j, : len(r)] = torch.tensor(r)
                mask[j, : len(r)] = 1
            with torch.no_grad():
                text_model(input_ids=ids.cuda(), attention_mask=mask.cuda())
            torch.cuda.synchronize()

        run(-1)
        started = time.perf_counter()
        for i in range(n):
            run(i)
        return {"rps": n / (time.perf_counter() - started)}
    except Exception as error:  # the baseline is informative; its failure must not lose the run
        return {"rps": None, "error": repr(error)[:300]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--seconds", type=float, default=6.0, help="per throughput level")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--backend", default="fused", help="fused (default) or reference")
    defaults = EngineOptions()
    parser.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=defaults.graphs, help="CUDA graphs")
    parser.add_argument("--gemm-algos", default=defaults.gemm_algos, help="auto, off or a table (cublaslt.pretuned)")
    parser.add_argument("--bank-gib", type=float, help="the state bank (default: as the server sizes it)")
    parser.add_argument("--size", choices=list(sizes.SIZES), help="random weights of a Kev size's shapes (4b)")
    parser.add_argument("--checkpoint", type=Path, help="a Kev checkpoint (with --size: checked to be its shapes)")
    parser.add_argument("--base", help="a local copy of the checkpoint's base model, when head.pt names a Hub id")
    parser.add_argument("--quick", action="store_true", help="latencies and short6 at 64 clients only (~1 min)")
    parser.add_argument(
        "--clients", type=lambda text: tuple(int(n) for n in text.split(",")), default=(64,),
        help="with --quick: short6's client counts (e.g. 64,128)",
    )  # fmt: skip
    parser.add_argument("--scaling", action="store_true", help="also states of 2k to 64k tokens and the bank's room")
    parser.add_argument("--scaling-repeat", type=int, default=3, help="requests per scaling point and kind")
    parser.add_argument(
        "--determinism", type=int, default=0, metavar="QUESTIONS",
        help="also answers alone against in batch mixes, bit for bit, on this many questions (dev/determinism.py)",
    )  # fmt: skip
    parser.add_argument(
        "--grow", type=int, default=0, metavar="TURNS",
        help="also growing conversations (dev/grow.py): a turn on conversations of 2k-64k tokens, 64 clients, and this "
        "many turns computed from the turn before against from nothing",
    )  # fmt: skip
    parser.add_argument("--commit", help="the commit the result names (default: git's HEAD)")
    return parser.parse_args()


# The fields that fix a model's tensor shapes: a checkpoint is of a size's shapes when all of them agree.
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "layer_types",
)


def load_model(args: argparse.Namespace, device: torch.device) -> tuple[KevCheckpoint, str, str]:
    """The checkpoint benchmarked, the model name the result gives (a size's label, or the checkpoint's directory)
    and a description. Random weights are built on the GPU in bf16, the serving dtype, a tensor at a time (a 27B
    model's fp32 copy would not fit)."""
    size = sizes.SIZES[args.size or "4b"]
    if args.checkpoint:
        checkpoint = load_checkpoint(args.checkpoint, device, LoadOptions(base=args.base))
        if args.size:
            expected = Qwen35Config.from_dict(size.config)
            got = checkpoint.model.config
            wrong = [f for f in SHAPE_FIELDS if getattr(got, f) != getattr(expected, f)]
            if wrong:
                raise SystemExit(f"{args.checkpoint} is not of {size.label}: {', '.join(wrong)} differ")
        model = size.label if args.size else args.checkpoint.name
        return checkpoint, model, str(args.checkpoint)
    checkpoint = synthetic.size_checkpoint(size, device, torch.bfloat16)
    shipped = "LoRA r=16 merged" if size.lora_rank else "full weights"
    return checkpoint, size.label, f"random weights, {size.label} ({shipped}, bf16)"


def measure(
    engine: Engine,
    make,
    ceil: dict[str, float],
    seconds: float,
    clients: tuple[int, ...],
    full: bool,
    baseline: bool,
    label: str,
) -> dict[str, Any]:
    """One workload: latency (new and same state); throughput at each of `clients`; with `full`, the profiler's
    passes and 64 clients without the pipeline; the floors; the naive baseline when asked."""
    entry: dict[str, Any] = dict(latency(engine, make))
    entry["wall_new_ms"] = request_wall(engine, make)
    print(f"{label} latency {entry}", flush=True)
    if full:
        try:
            entry["profile_new"] = pass_profile(engine, make, new=True)
            entry["profile_same"] = pass_profile(engine, make, new=False)
            print(f"{label} profile new {entry['profile_new']} same {entry['profile_same']}", flush=True)
        except Exception as error:  # informative only
            entry["profile_error"] = repr(error)[:300]
    entry["rps"], entry["p50_ms"], entry["mean_batch"] = {}, {}, {}
    for n in clients:
        throughput(engine, make, n, 1.0)  # first pass: new batch shapes, autotune
        measured = throughput(engine, make, n, seconds)
        entry["rps"][str(n)] = measured["rps"]
        entry["p50_ms"][str(n)] = measured["p50_ms"]
        entry["mean_batch"][str(n)] = measured["mean_batch"]
        print(f"{label} clients={n} {measured}", flush=True)
    if full:
        # 64 clients without the pipeline (one answer() call at a time): what overlapping batches buys.
        throughput(engine, make, 64, 1.0, pipelined=False)
        entry["serial_rps_64"] = throughput(engine, make, 64, seconds, pipelined=False)["rps"]
        print(f"{label} clients=64 serial {entry['serial_rps_64']:.1f} req/s", flush=True)
    cost = request_cost(engine, make(0))
    entry["tokens"] = cost["tokens"]
    entry["floor_rps"] = floor_rps(cost, ceil)
    entry["floor_new_ms"] = 1000 / floor_rps(cost, ceil, clients=1)
    entry["floor_new_sustained_ms"] = 1000 / floor_rps(cost, ceil, clients=1, rate="bf16_gemm_tflops_sustained")
    result = naive_baseline(engine, make, 10) if baseline else {"rps": None, "error": "skipped"}
    entry["baseline_rps"] = result["rps"]
    if result.get("error"):
        entry["baseline_error"] = result["error"]
    return entry


def print_table(workloads: dict[str, Any]) -> None:
    print(f"{'workload':8} {'new ms':>8} {'same ms':>8} " + " ".join(f"{c:>7}c" for c in CLIENTS) + " floor   naive")
    for label, w in workloads.items():
        if label == "scaling":
            continue
        rps = " ".join(f"{w['rps'][str(c)]:8.1f}" if str(c) in w["rps"] else "     n/a" for c in CLIENTS)
        naive = f"{w['baseline_rps']:7.1f}" if w["baseline_rps"] else "    n/a"
        print(f"{label:8} {w['new_ms']:8.2f} {w['same_ms']:8.2f} {rps} {w['floor_rps']:7.1f} {naive}")
    for point in workloads.get("scaling", []):
        print(
            f"state {point['state_tokens']:6d} tokens: new {point['new_ms']:9.2f} ms, same {point['same_ms']:7.2f} ms,"
            f" floor {point['floor_ms']:8.2f} ms (sustained {point['floor_sustained_ms']:8.2f}),"
            f" GPU peak {point['gpu_gib'] or 0:6.1f} GiB"
        )


def main() -> None:
    args = parse_args()
    use_cuda_allocator()  # the server's allocator: the same room for the largest pass
    device = torch.device("cuda")
    options = EngineOptions(
        device="cuda",
        backend=args.backend,
        bank_bytes=None if args.bank_gib is None else int(args.bank_gib * GIB),
        graphs=args.graphs,
        gemm_algos=args.gemm_algos,
    )
    started = time.perf_counter()
    checkpoint, model, name = load_model(args, device)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    engine = Engine(checkpoint, options)  # with graphs: every bucket captured here
    engine_s = time.perf_counter() - started
    ceil = ceilings(device)
    workloads: dict[str, Any] = {}
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(args.commit),
        "model": model,
        "checkpoint": name,
        "backend": engine.backend,
        "graphs": args.graphs,
        "quick": args.quick,
        "pipelined": True,  # throughput through kev_backend/engine/pipeline.py; serial_rps_64 without it
        "load_s": load_s,
        "engine_start_s": engine_s,
        "engine_gpu_gib": torch.cuda.memory_allocated(device) / GIB,  # weights, bank, graphs: before any request
        "torch": torch.__version__,
        "ceilings": ceil,
        "complete": False,  # until every workload is in: the file is rewritten after each one
        "workloads": workloads,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = result["gpu"].replace(" ", "-").lower()
    variant = "" if args.graphs else "-eager"
    sized_name = f"-{args.size}" if args.size else ""
    path = args.out / f"{result['date'][:10]}-{gpu}-{result['commit'][:8]}{variant}{sized_name}.json"

    def write() -> None:
        stats, scoring = engine.bank_stats, engine.scorer.stats()
        result["bank"] = {
            "hits": stats.hits,
            "misses": stats.misses,
            "evictions": stats.evictions,
            "bytes": stats.bytes,
            "oom_retries": scoring.oom_retries,
        }
        timed = [w for w in workloads.values() if isinstance(w, dict) and "first_over_median" in w]
        if timed:
            result["first_over_median"] = max(w["first_over_median"] for w in timed)
        result["gemm_algos"] = engine.gemm_algos
        result["scorer_stats"] = dataclasses.asdict(scoring)  # graphs held and their bytes among them
        result["gpu_gib_peak"] = torch.cuda.max_memory_allocated(device) / GIB
        path.write_text(json.dumps(result, indent=2) + "\n")

    full = not args.quick
    for label, make, seconds in (("short6", short6, args.seconds), ("long5", long5, 2 * args.seconds)):
        clients = CLIENTS if full else (args.clients if label == "short6" else ())
        baseline = full and not args.no_baseline
        workloads[label] = measure(engine, make, ceil, seconds, clients, full, baseline, label)
        write()
    if args.scaling and engine.backend == "fused":
        workloads["scaling"] = []
        for tokens in SCALING_TOKENS:
            workloads["scaling"].append(scaling_point(engine, tokens, ceil, args.scaling_repeat))
            print(f"scaling {workloads['scaling'][-1]}", flush=True)
            write()
        result["bank_capacity"] = bank_capacity(engine, SCALING_TOKENS[-1])
        print(f"bank capacity {result['bank_capacity']}", flush=True)
    if args.determinism and engine.backend == "fused":
        encoded = [engine.prepare(body)[1] for body in realistic(args.determinism, seed=5, max_words=2300)]
        result["determinism"] = determinism.check(engine.scorer, encoded)
        print(f"determinism {result['determinism']}", flush=True)
    if args.grow:
        from .grow import grow_record  # it measures with this module's loops

        result["grow"] = grow_record(engine, seconds=args.seconds, turns=args.grow)
        print(f"grow {result['grow']}", flush=True)
    result["complete"] = True
    write()
    print_table(workloads)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
