"""The fused GPU path against the fp32 reference (on the device; CPU CI skips these).

Parity on >= 1,000 questions of realistic requests (noul/choice/score mix, states of 30 to 2,500 tokens, 1 to 8
questions) with the tiny checkpoint and with random weights of Kev-4B shapes: bf16 fused vs fp32 reference
max |Δp| <= 0.03 and argmax flips <= 1 in 300 (outside near-ties); alone vs batched <= 0.01; bank hit vs miss
<= 0.01.
The tests check the bars and print each report; `python -m kev_backend.dev.parity` writes them as JSON.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from kev_backend.dev import sizes, synthetic
from kev_backend.dev.parity import parity_report
from kev_backend.dev.provenance import commit
from kev_backend.dev.workloads import realistic
from kev_backend.engine.engine import Engine, EngineOptions
from kev_backend.model.checkpoint import LoadOptions, load_checkpoint
from kev_backend.protocol.request import Limits

pytestmark = pytest.mark.gpu


def check(report: dict, name: str, questions: int, max_abs: float | None = 0.03) -> None:
    report.update(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), commit=commit())
    print(name, json.dumps(report))
    assert report["vs_reference"]["questions"] >= questions
    if max_abs is not None:
        assert report["vs_reference"]["max_abs"] <= max_abs
    # Flips where the fp32 answer is a near-tie (top two within 0.02) are reported, not counted: there rounding the
    # weights to bf16 alone swaps argmaxes, and random weights produce far more near-ties than a trained Kev.
    assert report["vs_reference"]["decided_flips"] <= report["vs_reference"]["questions"] / 300
    assert report["alone_vs_batch"]["max_abs"] <= 0.01
    assert report["bank_hit_vs_miss"]["max_abs"] <= 0.01
    # Parity on saturated or flat answers would prove nothing.
    assert 0.2 < report["spread_reference"]["normalised_entropy_mean"] < 0.95


def engines(checkpoint, bank_bytes: int) -> tuple[Engine, Engine]:
    """The reference engine and a fused one in the shipped configuration (EngineOptions' defaults: CUDA graphs)."""
    reference = Engine(checkpoint, EngineOptions(backend="reference", bank_bytes=0))
    fused = Engine(checkpoint, EngineOptions(backend="fused", bank_bytes=bank_bytes))
    return reference, fused


def test_tiny_checkpoint_parity(tiny_dir: Path, parity_questions: int) -> None:
    """The CPU tests' 64-wide toy (heads of 16 and 32): every bar but the largest |Δp|, which is reported. At this
    width one bf16 rounding per element does not average out: with bf16 weights and bf16 GEMM inputs alone (all
    else fp32; CPU emulation, 3 request seeds) the largest |Δp| is 0.020–0.025 and the full bf16 pass 0.018–0.037,
    while the mean stays ~0.0017. The width-256 checkpoint below holds the 0.03 bar with margin."""
    checkpoint = load_checkpoint(tiny_dir / "kev", "cuda", LoadOptions(dtype="fp32"))
    reference, fused = engines(checkpoint, 2 << 30)
    check(
        parity_report(reference, fused, realistic(parity_questions, seed=1, max_words=2300)),
        "tiny",
        parity_questions,
        max_abs=None,
    )


def test_small_checkpoint_parity(tiny_dir: Path, parity_questions: int) -> None:
    """A small checkpoint with Qwen3.5's head sizes scaled down (width 256, heads of 64), random weights."""
    tokenizer = tiny_dir / "small-tokenizer"
    tokenizer.mkdir(exist_ok=True)
    config = {**sizes.SMALL_CONFIG, "vocab_size": synthetic.write_tokenizer(tokenizer)}
    checkpoint = synthetic.synthetic_checkpoint(config, tokenizer, "cuda", seed=0)
    reference, fused = engines(checkpoint, 4 << 30)
    check(
        parity_report(reference, fused, realistic(parity_questions, seed=1, max_words=2300)), "small", parity_questions
    )


def test_kev4b_shapes_parity(tiny_dir: Path, parity_questions: int) -> None:
    config = {**sizes.KEV4B_CONFIG}
    checkpoint = synthetic.synthetic_checkpoint(config, tiny_dir / "base", "cuda", seed=0)
    reference, fused = engines(checkpoint, 48 << 30)
    check(
        parity_report(reference, fused, realistic(parity_questions, seed=2, max_words=2300)), "kev4b", parity_questions
    )
    del reference, fused, checkpoint
    torch.cuda.empty_cache()


def test_graph_replay_matches_eager(tiny_dir: Path, parity_questions: int) -> None:
    """Passes replayed from CUDA graphs answer like eager passes (≤ 0.01; the buckets keep ≥ 64 GEMM rows
    and every kernel's per-segment work is the same, so equality is expected), batched, alone and from the bank.
    Passes with long new states are graphed too."""
    from kev_backend.dev.parity import compare, scored
    from kev_backend.gpu.graphs import PassGraphs

    checkpoint = synthetic.synthetic_checkpoint({**sizes.KEV4B_CONFIG}, tiny_dir / "base", "cuda", seed=0)
    options = dict(backend="fused", bank_bytes=16 << 30)
    eager = Engine(checkpoint, EngineOptions(**options, graphs=False))  # the eager reference: graphs off
    graphed = Engine(checkpoint, EngineOptions(**options, graphs=True))
    graphs = graphed.scorer.graphs
    assert isinstance(graphs, PassGraphs) and graphs.stats.captures == len(graphs.graphs) > 0
    assert graphs.stats.bytes > 0  # the graphs' pool, grown from an emptied cache
    encoded = [eager.prepare(r)[1] for r in realistic(parity_questions, seed=2, max_words=2300)]
    reference = scored(eager, encoded, 32)
    report = {
        "batched": compare(reference, scored(graphed, encoded, 32)),
        "alone": compare(reference[:200], scored(graphed, encoded[:200], 1)),
        "bank": compare(reference, scored(graphed, encoded, 32)),
        "graphs": vars(graphs.stats),
        "buckets_seen": sorted(b.name for b in graphs.seen),
        "gpu": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
    }
    print("graphs", json.dumps(report))
    assert graphs.stats.replays > 0
    assert graphs.stats.long_runs > 0  # passes with long new states replayed
    for name in ("batched", "alone", "bank"):
        assert report[name]["max_abs"] <= 0.01, (name, report[name])
    del eager, graphed, checkpoint
    torch.cuda.empty_cache()


@pytest.mark.parametrize("tokens", [8_000, 40_000])
def test_rows_over_a_long_state_answer_alike_in_every_launch(tiny_dir: Path, tokens: int) -> None:
    """Same-state requests on a state of more than FOLD_KEYS tokens replay a long-prefix graph (their attention's
    parts in parallel), and beside a new state the pass's own bucket (its parts folded in turn), where the banked
    state's tokens leave the new state room in a pass; over a pass's budget they go alone again and the new state
    follows in a pass of its own. Every way they answer, bit for bit, as eagerly and as on the pass that banked the
    state."""
    from kev_backend.dev.determinism import eagerly
    from kev_backend.dev.workloads import short6, sized, state_counter
    from kev_backend.gpu.kernels.attention import FOLD_KEYS

    engine = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(backend="fused", bank_bytes=4 << 30))
    _, encoded = engine.prepare(sized(tokens, state_counter(engine.tokenizer)))
    _, new = engine.prepare(short6(tokens))
    assert len(encoded.state) > FOLD_KEYS
    scorer, graphs = engine.scorer, engine.scorer.graphs
    banked = scorer.probabilities([encoded])  # a pass of its own, eagerly: too long for any bucket
    replays = graphs.stats.replays
    again = scorer.probabilities([encoded])
    assert graphs.stats.replays == replays + 1 and any(b.long_prefix for b in graphs.seen)
    beside = scorer.probabilities([encoded, new])
    # A banked state costs a pass its tokens (FusedScorer.next_pass): over the budget no new state joins its rows.
    shared = len(encoded.state) + len(new.state) <= engine.options.pass_tokens
    assert graphs.stats.replays == replays + (2 if shared else 3)
    with eagerly(scorer):
        eager = scorer.probabilities([encoded])
    assert again == eager == banked == beside[:1]
    del engine
    torch.cuda.empty_cache()


def test_the_bank_takes_what_the_largest_pass_leaves(tiny_dir: Path) -> None:
    """Kev-4B's shapes with the bank left to the engine (gpu/memory.py): the plan measured its largest pass, the bank
    is what the GPU's memory allows, and the largest request the limits allow (a 65,536-token state and questions up
    to the work limit, its rows over several passes) runs without running out of memory, its peak within the plan's
    accounting; its answers are the same bits as from one pass of it all, and as alone."""
    from kev_backend.dev.workloads import sized, state_counter
    from kev_backend.gpu.memory import MARGIN_BYTES
    from kev_backend.gpu.passes import Row

    checkpoint = synthetic.synthetic_checkpoint({**sizes.KEV4B_CONFIG}, tiny_dir / "base", "cuda", seed=0)
    engine = Engine(checkpoint, EngineOptions(backend="fused", warm=False))
    plan = engine.scorer.memory
    assert plan is not None and plan.working > 0 and plan.graphs > 0
    assert engine.scorer.bank_bytes == min(plan.total // 5, plan.left)
    print("memory plan", json.dumps({k: getattr(plan, k) for k in plan.__dataclass_fields__}), engine.summary())
    count = state_counter(engine.tokenizer)
    question = {"type": "choice", "instructions": "which team?", "criteria": {f"team {i}": None for i in range(255)}}
    limits = engine.options.limits
    body = sized(limits.max_state_tokens, count, 0, questions={"q0": question})
    encoded = engine.prepare(body)[1]
    per_question = len(encoded.questions[0].tokens)
    n = (limits.max_request_tokens - len(encoded.state)) // per_question
    body["questions"] = {f"q{i}": question for i in range(n)}
    encoded = engine.prepare(body)[1]
    passes = engine.scorer.plan([Row(0, q, tokens, encoded.state) for q, tokens in enumerate(encoded.questions)])
    assert len(passes) > 1
    assert max(sum(len(row.tokens.tokens) for row in group) for group in passes[1:]) <= engine.scorer.pass_tokens
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    answers = engine.scorer.probabilities([encoded])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    print(f"largest request: {len(passes)} passes, peak {peak / 2**30:.2f} GiB")
    assert engine.scorer.oom_retries == 0
    assert peak <= plan.weights + engine.scorer.bank.pool.nbytes + plan.working + plan.graphs + MARGIN_BYTES
    # The one-pass engine's pass is several times the plan's: on an 80 GB GPU it has room once this engine's bank is
    # gone.
    del engine
    torch.cuda.empty_cache()
    whole = Engine(
        checkpoint,
        EngineOptions(backend="fused", warm=False, graphs=False, pass_tokens=1 << 20, bank_bytes=plan.minimum),
    )
    assert whole.scorer.probabilities([encoded]) == answers
    del whole, checkpoint
    torch.cuda.empty_cache()


def test_after_a_failed_capture_passes_run_eagerly(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that fails (here: a sync inside one bucket's capture) stops further captures, and the engine keeps
    answering: the graphs already captured replay, every other pass runs eagerly, with the answers of an engine
    without graphs."""
    from kev_backend.dev.parity import compare, scored
    from kev_backend.gpu.graphs import Bucket

    checkpoint = synthetic.synthetic_checkpoint({**sizes.KEV4B_CONFIG}, tiny_dir / "base", "cuda", seed=0)
    options = dict(backend="fused", bank_bytes=4 << 30)
    engine = Engine(checkpoint, EngineOptions(**options, graphs=True, warm=False))
    graphs = engine.scorer.graphs
    doomed = Bucket(0, 128)
    forward = graphs.model.forward

    def failing_in_capture(inputs):
        out = forward(inputs)
        if torch.cuda.is_current_stream_capturing() and len(inputs.ids) == doomed.tokens:
            torch.cuda.synchronize()  # refused while capturing: invalidates the capture
        return out

    monkeypatch.setattr(graphs.model, "forward", failing_in_capture)
    graphs.warm([Bucket(0, 64), doomed, Bucket(0, 256)])
    assert set(graphs.failed) == {doomed} and set(graphs.graphs) == {Bucket(0, 64)}
    assert graphs.stats.capture_failures == 1
    eager = Engine(checkpoint, EngineOptions(**options, graphs=False))  # an engine without graphs
    encoded = [eager.prepare(r)[1] for r in realistic(40, seed=6, max_words=300)]
    assert compare(scored(eager, encoded, 8), scored(engine, encoded, 8))["max_abs"] <= 0.01
    assert graphs.stats.captures == 1 and graphs.stats.runs > graphs.stats.replays


def test_a_pass_with_more_row_segments_than_one_launch_holds(tiny_dir: Path) -> None:
    """2,100 questions on one state, Kev-4B shapes: 2,100 row segments × 32 value heads pass CUDA's 65,535 limit on
    a grid's second dimension (a launch over it is refused: "invalid argument"); the kernels launch per span of
    segments (kernels.grid) or put items on the first dimension, and every answer equals the same question's in a
    request of 700."""
    checkpoint = synthetic.synthetic_checkpoint({**sizes.KEV4B_CONFIG}, tiny_dir / "base", "cuda", seed=0)
    limits = Limits(max_questions=2100)  # past the default cap on purpose: one pass with 2,100 rows
    # Graphs off: passes this large fit no bucket, and capturing the buckets at start would only add time.
    engine = Engine(checkpoint, EngineOptions(backend="fused", bank_bytes=4 << 30, graphs=False, limits=limits))
    state = "the invoice total was wrong and the refund is late"
    questions = {f"q{i}": {"type": "noul", "instructions": f"is item {i} urgent ?"} for i in range(2100)}
    whole = engine.answer([{"state": state, "questions": questions}])[0]
    assert isinstance(whole, dict), whole
    names = list(questions)
    for start in range(0, len(names), 700):
        part = engine.answer([{"state": state, "questions": {n: questions[n] for n in names[start : start + 700]}}])
        for name, answer in part[0]["answers"].items():
            assert abs(answer["noul"] - whole["answers"][name]["noul"]) <= 0.01, name


def test_batches_enqueued_back_to_back_answer_as_one_at_a_time(tiny_dir: Path, parity_questions: int) -> None:
    """The pipeline's model thread enqueues a batch without waiting for the ones before it (Engine.launch: uploads
    from pinned memory, the head's result copied back asynchronously, the graphs' two host buffers in turn). With
    graphs, long new states, and a bank of six slots, so that states are evicted and their slots reused while work
    reading them is still queued, every batch answers as it does through Engine.score, one batch at a time."""
    import threading

    from kev_backend.dev.parity import compare
    from kev_backend.engine.pipeline import Pipeline

    checkpoint = synthetic.synthetic_checkpoint({**sizes.KEV4B_CONFIG}, tiny_dir / "base", "cuda", seed=0)
    probe = Engine(checkpoint, EngineOptions(backend="fused", bank_bytes=1 << 30, graphs=False, warm=False))
    options = dict(backend="fused", bank_bytes=2 * 6 * probe.scorer.bank.pool.slot_bytes, graphs=True)
    del probe
    serial = Engine(checkpoint, EngineOptions(**options))
    piped = Engine(checkpoint, EngineOptions(**options))
    requests = realistic(parity_questions, seed=5, max_words=2300)[:48]
    batches = [requests[i : i + 1 + i % 5] for i in range(0, 40, 4)] + [requests[:3], requests[20:26], requests[::7]]
    expected = [serial.score(serial.prepare_batch(b)).probabilities for b in batches]

    lock, in_flight, most = threading.Lock(), [0], [0]
    start, collect = piped.start, piped.collect

    def counted_start(batch):
        launch = start(batch)
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        return launch

    def counted_collect(batch):
        with lock:
            in_flight[0] -= 1
        return collect(batch)

    piped.start, piped.collect = counted_start, counted_collect
    got: dict[int, dict[int, list]] = {n: {} for n in range(len(batches))}  # each batch's answers by request
    failed: list[Exception] = []
    done = threading.Event()
    pipeline = Pipeline(piped)
    # No service history: submit returns once the model thread takes a batch, which runs ahead of the GPU.
    pipeline.service_s.median = lambda: None
    try:
        for n, bodies in enumerate(batches):

            def deliver(results, batch, n=n):  # once per part of the batch (all its requests are valid)
                if isinstance(results, Exception):
                    failed.append(results)
                else:
                    got[n].update(zip(batch.indices, batch.probabilities, strict=True))
                if failed or sum(map(len, got.values())) == sum(map(len, batches)):
                    done.set()

            pipeline.submit(bodies, deliver)
        assert done.wait(timeout=300)
    finally:
        pipeline.close()
    assert not failed, failed
    assert most[0] >= 2, most  # batches were enqueued while earlier ones were still on the GPU
    for n, want in enumerate(expected):
        report = compare(want, [got[n][i] for i in range(len(batches[n]))])
        assert report["max_abs"] <= 1e-4, (n, report)
    del serial, piped, checkpoint
    torch.cuda.empty_cache()


def test_long_work_between_short_batches_answers_as_alone(tiny_dir: Path) -> None:
    """Long requests (their own batches, a unit each: a pass) and short batches through the pipeline at once, long
    units enqueued only once the one before has finished on the GPU and short ones between them: every answer has
    the bits it has alone, and every long request and short batch is answered."""
    import threading

    from kev_backend.dev.workloads import short6
    from kev_backend.engine.pipeline import Pipeline

    engine = Engine(load_checkpoint(tiny_dir / "kev", "cuda", LoadOptions(dtype="bf16")), EngineOptions())
    longs = [{"state": " ".join(f"long {n} word {i}" for i in range(6000)), "questions": short6()["questions"]}
             for n in range(3)]  # fmt: skip
    shorts = [[short6(100 * n + i) for i in range(1 + n % 4)] for n in range(12)]
    alone = {json.dumps(body): engine.answer([body])[0]["answers"] for body in longs + sum(shorts, [])}
    engine.bank.clear()
    got: list[tuple[dict, dict]] = []
    lock, done = threading.Lock(), threading.Event()
    pipeline = Pipeline(engine, long_tokens=4096)

    def deliver(bodies):
        def receive(results, batch):
            with lock:
                got.extend((bodies[i], r) for i, r in zip(batch.indices, results, strict=True))
                if len(got) == len(alone):
                    done.set()

        return receive

    try:
        for n, bodies in enumerate(shorts):
            if n % 4 == 0:
                pipeline.submit([longs[n // 4]], deliver([longs[n // 4]]))
            pipeline.submit(bodies, deliver(bodies))
        assert done.wait(timeout=300), f"{len(got)} of {len(alone)} answered"
    finally:
        pipeline.close()
    for body, result in got:
        assert result["answers"] == alone[json.dumps(body)], body["state"][:40]


def test_no_kernel_compiles_after_warm_up(tiny_dir: Path) -> None:
    """Once the engine has warmed up (graphs captured, a short and a long batch run), no request compiles
    a Triton kernel: no new specialisation of ours, no autotuning run of fla's. Realistic requests of every size,
    alone and in batches, with graphs on (the GPU configuration)."""
    import triton

    from kev_backend.dev.parity import scored

    checkpoint = synthetic.synthetic_checkpoint({**sizes.KEV4B_CONFIG}, tiny_dir / "base", "cuda", seed=0)
    engine = Engine(checkpoint, EngineOptions(backend="fused", bank_bytes=16 << 30, graphs=True))
    encoded = [engine.prepare(r)[1] for r in realistic(300, seed=5, max_words=2300)]
    compiled: list[str] = []

    def record(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # Triton calls it by these names
        compiled.append(repr.split("(")[0])

    triton.knobs.runtime.jit_post_compile_hook = record
    try:
        for size in (1, 7, 32):
            scored(engine, encoded, size)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
    assert not compiled, sorted(set(compiled))
    del engine, checkpoint
    torch.cuda.empty_cache()


def test_cuda_eager_reference_matches_cpu(tiny_dir: Path) -> None:
    """The reference path on CUDA (fp32, eager) gives the CPU's probabilities."""
    requests = realistic(60, seed=3, max_words=400)
    cpu = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(device="cpu"))
    cuda = Engine.from_checkpoint(
        tiny_dir / "kev", EngineOptions(device="cuda", backend="reference", load=LoadOptions(dtype="fp32"))
    )
    assert cuda.backend == "reference" and cuda.device.type == "cuda"
    a, b = cpu.answer(requests), cuda.answer(requests)
    for x, y in zip(a, b, strict=True):
        assert list(x["answers"]) == list(y["answers"])
        for qid, answer in x["answers"].items():
            for key, value in answer.items():
                if isinstance(value, float):
                    assert abs(value - y["answers"][qid][key]) <= 2e-4
                elif key == "probabilities":
                    other = y["answers"][qid][key]
                    assert list(other) == list(value) and all(abs(v - other[k]) <= 2e-4 for k, v in value.items())


def test_fused_engine_serves_through_the_engine_api(tiny_dir: Path) -> None:
    engine = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(device="cuda"))
    assert engine.backend == "fused"
    results = engine.answer([{"state": "x", "questions": {}}, realistic(5, seed=4)[0]])
    assert results[0].__class__.__name__ == "RequestError" and isinstance(results[1], dict)


def test_gemms_give_a_row_the_same_bits_in_any_gemm(tmp_path: Path) -> None:
    """gpu.cublaslt: a table's shapes run on cuBLASLt algorithms other than torch's (here each shape's fastest
    non-split candidate, kept whatever its speed), other shapes on the heuristic's first without split-K; every
    one gives the bits of the others and of F.linear at these shapes, eagerly and replayed from a graph, and a row's
    output is the same in GEMMs of 64 to 8,192 rows. Inputs it cannot take go to F.linear."""
    from kev_backend.dev import gemm_tuner
    from kev_backend.gpu import cublaslt

    device = torch.device("cuda")
    shapes = [(192, 18432, 2560), (2688, 18432, 2560), (192, 2560, 9216)]
    entries = gemm_tuner.tune(shapes, device, gain=-1.0)
    assert [(e["m"], e["n"], e["k"]) for e in entries] == shapes  # every shape has a non-split candidate
    table = cublaslt.identity(device) | {"shapes": entries}
    path = tmp_path / "gemm-algos-test.json"
    path.write_text(json.dumps(table))
    algos = cublaslt.GemmAlgos.load(path, device)
    assert isinstance(algos, cublaslt.GemmAlgos) and len(algos.algos) == 3
    torch.manual_seed(1)
    for m, n, k in [*shapes, (100, 18432, 2560)]:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        expected = torch.nn.functional.linear(x, w)
        assert torch.equal(algos.linear(x, w), expected), (m, n, k)
        graph = torch.cuda.CUDAGraph()
        algos.linear(x, w)
        with torch.cuda.graph(graph):
            out = algos.linear(x, w)
        graph.replay()
        assert torch.equal(out, expected), (m, n, k)
    untabled = cublaslt.GemmAlgos({}, device)
    for n, k in [(18432, 2560), (2560, 9216), (2048, 2560)]:
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        x = torch.randn(8192, k, device=device, dtype=torch.bfloat16)
        whole = untabled.linear(x, w)
        for m in (64, 100, 192, 1000, 2688, 4096):
            assert torch.equal(untabled.linear(x[:m].contiguous(), w), whole[:m]), (m, n, k)
            assert torch.equal(algos.linear(x[:m].contiguous(), w), whole[:m]), (m, n, k)
    x = torch.randn(192, 2560 * 2, device=device, dtype=torch.bfloat16)[:, ::2]  # not contiguous: F.linear
    w = torch.randn(18432, 2560, device=device, dtype=torch.bfloat16)
    assert torch.equal(algos.linear(x, w), torch.nn.functional.linear(x, w))
    mismatched = path.with_name("gemm-algos-other.json")
    mismatched.write_text(json.dumps(table | {"cublaslt_version": -1}))
    said = cublaslt.GemmAlgos.load(mismatched, device)
    assert isinstance(said, str) and said.startswith("gemm-algos-other.json: ")
