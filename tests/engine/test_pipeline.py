"""The pipelined engine (prepare, score and deliver on three threads) answers exactly like `Engine.answer`, drops
cancelled requests before any model work, and confines an engine fault to its own batch."""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path

import pytest

from kev_backend.engine.engine import Engine, EngineOptions
from kev_backend.engine.pipeline import PREPARE_APART_BYTES, Pipeline, part_ends
from kev_backend.protocol.request import RequestError
from tests.helpers import request
from tests.scoring.test_growth import conversation, reference_engine

BAD = {"state": "x", "questions": {}}


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:
    return Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(bank_bytes=1 << 24))


def run(pipeline: Pipeline, batches: list[list], cancelled: dict[int, set[int]] | None = None) -> list:
    """Submits every batch from the caller's thread in turn; returns (results, report, delivering thread) per batch."""
    delivered: queue.Queue = queue.Queue()
    for n, bodies in enumerate(batches):
        drop = (cancelled or {}).get(n)
        pipeline.submit(
            bodies,
            lambda results, batch, n=n: delivered.put((n, results, batch.report, threading.current_thread().name)),
            (lambda indices, drop=drop: drop & set(indices)) if drop is not None else None,
        )
    out = dict((n, rest) for n, *rest in (delivered.get(timeout=60) for _ in batches))
    return [out[n] for n in range(len(batches))]


def test_pipelined_answers_equal_engine_answers(engine: Engine) -> None:
    batches = [[request(f"ticket {n} {i}") for i in range(1 + n % 3)] + ([BAD] if n % 2 else []) for n in range(6)]
    batches.append([BAD, BAD])  # nothing to run, still reported (Triton's metrics count its errors)
    expected = [engine.answer(bodies) for bodies in batches]
    pipeline = Pipeline(engine)
    try:
        got = run(pipeline, batches)
    finally:
        pipeline.close()
    for (results, report, thread), want, bodies in zip(got, expected, batches, strict=True):
        assert thread == "kev-delivery"
        assert report.requests == len(bodies) and report.errors == sum(b is BAD for b in bodies)
        for actual, wanted in zip(results, want, strict=True):
            if isinstance(wanted, RequestError):
                assert isinstance(actual, RequestError) and actual.message == wanted.message
            else:
                assert actual["answers"] == wanted["answers"] and actual["usage"] == wanted["usage"]


def test_cancelled_requests_cost_no_model_work(engine: Engine) -> None:
    pipeline = Pipeline(engine, recheck_after_s=0.0)  # ask again whatever the wait
    try:
        before = engine.bank_stats.misses
        (partial, report, _), (none, empty, _) = run(
            pipeline,
            [[request("kept state"), request("dropped state one")], [request("dropped state two")]],
            cancelled={0: {1}, 1: {0}},
        )
    finally:
        pipeline.close()
    assert partial[1] is None and partial[0]["answers"].keys() == request()["questions"].keys()
    assert report.requests == 1
    assert none == [None] and empty.requests == 0 and empty.model_ms == 0.0
    assert engine.bank_stats.misses - before == 1  # only the kept state was computed


def test_an_engine_fault_fails_only_its_batch(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    original = engine.scorer.units
    calls = []

    def failing_once(batch):
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("device fault")
        return original(batch)

    monkeypatch.setattr(engine.scorer, "units", failing_once)
    pipeline = Pipeline(engine)
    try:
        (first, _, _), (second, _, _) = run(pipeline, [[request("fault a")], [request("fault b")]])
    finally:
        pipeline.close()
    assert isinstance(first, RuntimeError) and "device fault" in str(first)
    assert isinstance(second, list) and "answers" in second[0]


@pytest.mark.parametrize(
    ("sizes", "work", "budget", "lengths"),
    [
        ([16] * 20, [16] * 20, 256, [10, 10]),  # as even as two parts allow, not 16 + 4
        ([16] * 64, [16] * 64, 256, [16, 16, 16, 16]),
        ([16] * 63, [16] * 63, 256, [16, 16, 16, 15]),
        ([2] * 64, [2] * 64, 256, [64]),  # within the budget: one part
        ([300, 1, 1], [300, 1, 1], 256, [1, 2]),  # an item over the budget is a part of its own
        ([1, 300, 1], [1, 300, 1], 256, [1, 1, 1]),
        ([44_000] * 64, [650] * 64, 32_768, [32, 32]),  # by work, not bytes: turns continuing their points
        ([13_700] * 64, [2_600] * 64, 32_768, [11, 11, 11, 11, 11, 9]),
        ([10] * 8, [0] * 8, 256, [8]),  # no work (every request refused): one part
        ([], [], 256, []),
    ],
)
def test_part_ends(sizes: list[int], work: list[int], budget: int, lengths: list[int]) -> None:
    pulled: list[int] = []

    def lazily():
        for i, cost in enumerate(work):
            pulled.append(i)
            yield cost

    parts, start = [], 0
    for end in part_ends(sizes, lazily(), budget):
        # Each end is known before the work past it is asked for (a part runs while the next is prepared).
        assert pulled[-1] <= end
        parts.append(range(start, end))
        start = end
    assert [len(part) for part in parts] == lengths
    assert [i for part in parts for i in part] == list(range(len(sizes)))  # every item once, in order
    assert all(sum(work[i] for i in part) <= budget or len(part) == 1 for part in parts)


def test_part_tokens_is_the_pipelines_budget(engine: Engine) -> None:
    """A pipeline's parts hold at most `part_tokens` of work (the engine's pass budget unless given); under one token is
    refused."""
    given = ((Pipeline(engine), engine.options.pass_tokens), (Pipeline(engine, part_tokens=1000), 1000))
    for pipeline, budget in given:
        try:
            assert pipeline.part_tokens == budget
        finally:
            pipeline.close()
    with pytest.raises(ValueError, match="part_tokens"):
        Pipeline(engine, part_tokens=0)


def test_turns_that_continue_their_points_share_a_part(tiny_dir: Path) -> None:
    """Parts are sized by each request's work as estimated when it is prepared (Scorer.work): eight conversations'
    next turns, each continuing its banked point, go in one part under a budget that splits the same turns computed
    whole eight ways; and with each whole state over `long_tokens` but its own tokens under it, they run as normal
    work. Their answers are the turns' computed whole."""
    whole = reference_engine(tiny_dir, bank_bytes=0)
    turns = [[f"Conversation {c}. {text}" for text in conversation(21)[-2:]] for c in range(8)]
    following = [json.dumps(request(state=t[1])) for t in turns]
    expected = whole.answer(following)
    outcomes = {}
    for banked in (True, False):
        engine = reference_engine(tiny_dir)
        if banked:
            engine.answer([request(state=t[0]) for t in turns])
        encoded = [engine.prepare(body)[1] for body in following]
        work = [engine.scorer.work(e) for e in encoded]
        if banked:  # the budget: all eight continued turns; over it, any one state computed whole
            budget, long_tokens = sum(work), max(work)
            assert min(e.input_tokens for e in encoded) > long_tokens
        pipeline = Pipeline(engine, part_tokens=budget, long_tokens=long_tokens)
        try:
            delivered: queue.Queue = queue.Queue()
            pipeline.submit(following, lambda results, batch, to=delivered: to.put((results, batch.indices)))
            got, sizes = {}, []
            while len(got) < len(following):
                results, indices = delivered.get(timeout=60)
                sizes.append(len(indices))
                got.update(zip(indices, results, strict=True))
        finally:
            pipeline.close()
        for i, want in enumerate(expected):
            assert got[i]["answers"] == want["answers"]
        outcomes[banked] = sizes
    assert outcomes == {True: [8], False: [1] * 8}


class Beats:
    """A heartbeat that counts (kev_backend.serve.stub.heartbeat's interface)."""

    def __init__(self) -> None:
        self.counts = {"beat": 0, "started": 0, "finished": 0, "broken": 0}

    def beat(self) -> None:
        self.counts["beat"] += 1

    def started(self) -> None:
        self.counts["started"] += 1

    def finished(self) -> None:
        self.counts["finished"] += 1

    def broken(self) -> None:
        self.counts["broken"] += 1


def long_request(tag: str) -> dict:
    """~3,000 tokens of state: long for a pipeline whose long_tokens is 1,000, in 6 units of a 512-token chunk."""
    return request(" ".join(f"{tag} word {i}" for i in range(1000)))


@pytest.fixture
def chunked(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """The engine with 512-token chunks: a long state is several units of work."""
    monkeypatch.setattr(engine.scorer, "chunk_tokens", 512)
    return engine


def test_a_long_request_is_answered_apart_from_its_batch(chunked: Engine) -> None:
    """Prepared together, delivered apart: the batch's short requests in one part (delivered first), the long one
    alone; every answer equal to the engine's, delivered once, naming the bodies it answers."""
    bodies = [request("short one"), long_request("alone"), request("short two"), BAD]
    expected = chunked.answer(bodies)
    delivered: queue.Queue = queue.Queue()
    pipeline = Pipeline(chunked, long_tokens=1_000)
    try:
        pipeline.submit(bodies, lambda results, batch: delivered.put((list(batch.indices), results)))
        parts = [delivered.get(timeout=120) for _ in range(2)]
    finally:
        pipeline.close()
    assert [indices for indices, _ in parts] == [[0, 2, 3], [1]]
    for indices, results in parts:
        for i, result in zip(indices, results, strict=True):
            if isinstance(expected[i], RequestError):
                assert isinstance(result, RequestError)
            else:
                assert result["answers"] == expected[i]["answers"] and result["usage"] == expected[i]["usage"]


def test_short_batches_run_between_the_units_of_a_long_one(chunked: Engine) -> None:
    """A short batch submitted while a long one runs is answered before it; the long one's answer is the same as
    alone; the heartbeat beats through the long one's units (the reference path: every layer)."""
    long_body = long_request("interleaved")
    expected = chunked.answer([long_body])[0]
    chunked.bank.clear()
    delivered: queue.Queue = queue.Queue()
    beats = Beats()
    pipeline = Pipeline(chunked, long_tokens=1_000, progress=beats)
    try:
        pipeline.submit([long_body], lambda results, batch: delivered.put(("long", results)))
        for n in range(3):
            pipeline.submit([request(f"short {n}")], lambda results, batch, n=n: delivered.put((f"short {n}", results)))
        order = [delivered.get(timeout=120) for _ in range(4)]
    finally:
        pipeline.close()
    names = [name for name, _ in order]
    assert names.index("long") == 3, names
    assert order[3][1][0]["answers"] == expected["answers"]
    layers = len(chunked.checkpoint.model.layers)
    counts = beats.counts
    assert counts["beat"] >= 6 * layers and counts["started"] == counts["finished"] == 4 and not counts["broken"]


def test_a_batch_that_waits_behind_another_is_asked_again_at_its_start(chunked: Engine) -> None:
    """A batch taken between another's units waits behind it in the scheduler: its clients that left meanwhile are
    dropped when it starts (the wait counted to its start, not to when the model thread took it)."""
    chunked.bank.clear()  # the state ahead is computed: its units take longer than the recheck's wait
    left = threading.Event()
    delivered: queue.Queue = queue.Queue()
    pipeline = Pipeline(chunked, recheck_after_s=0.2, long_tokens=1 << 30)  # the long request runs as normal work
    try:
        before = chunked.bank_stats.misses
        pipeline.submit([long_request("ahead")], lambda results, batch: delivered.put(("ahead", results)))
        pipeline.submit(
            [request("left while waiting")],
            lambda results, batch: delivered.put(("left", results)),
            lambda indices: {0} & set(indices) if left.is_set() else set(),
        )
        left.set()
        answers = dict(delivered.get(timeout=120) for _ in range(2))
    finally:
        pipeline.close()
    assert "answers" in answers["ahead"][0] and answers["left"] == [None]
    assert chunked.bank_stats.misses - before == 1  # only the state ahead was computed


def test_a_batch_asks_about_its_own_requests_only(chunked: Engine) -> None:
    """Long requests of one Triton batch run as batches of their own, answered one after another; each asks, before it
    starts, about its own requests only, never about one another batch has answered (Triton frees an answered
    request's response factory: asking about it crashed tritonserver)."""
    chunked.bank.clear()
    delivered: set[int] = set()
    asked: list[tuple[list[int], set[int]]] = []
    lock = threading.Lock()
    answered = threading.Semaphore(0)

    def cancelled(indices) -> set[int]:
        with lock:
            asked.append((list(indices), set(delivered)))
        return set()

    def deliver(results, batch) -> None:
        with lock:
            delivered.update(batch.indices)
        for _ in batch.indices:
            answered.release()

    bodies = [long_request(f"own {n}") for n in range(3)] + [request("short beside them")]
    pipeline = Pipeline(chunked, recheck_after_s=0.0, long_tokens=1_000)  # every batch asks; each long one alone
    try:
        pipeline.submit(bodies, deliver, cancelled, requests=[range(n, n + 1) for n in range(4)])
        for _ in bodies:
            assert answered.acquire(timeout=120)
    finally:
        pipeline.close()
    assert sorted(i for indices, _ in asked for i in indices) == [0, 1, 2, 3]  # each batch asked once, itself
    assert len(asked) == 4 and all(not set(indices) & done for indices, done in asked)
    assert any(done for _, done in asked)  # some batch asked after another had been answered


def test_large_requests_are_prepared_apart(chunked: Engine) -> None:
    """A request over PREPARE_APART_BYTES of JSON is tokenized on the preparation thread, not the caller's: the small
    ones beside it are answered in their own part, and the large one alone, even when it is not long work."""
    large = json.dumps(request("x " * (PREPARE_APART_BYTES // 2 + 1)))
    assert len(large) > PREPARE_APART_BYTES
    bodies = [json.dumps(request("small a")), large, json.dumps(request("small b"))]
    requests = [range(0, 1), range(1, 2), range(2, 3)]
    assert Pipeline.by_size(bodies, requests) == ([range(0, 1), range(2, 3)], [range(1, 2)])
    delivered: queue.Queue = queue.Queue()
    pipeline = Pipeline(chunked, long_tokens=1 << 30)
    try:
        pipeline.submit(bodies, lambda results, batch: delivered.put((list(batch.indices), results)))
        parts = sorted(delivered.get(timeout=120) for _ in range(2))
    finally:
        pipeline.close()
    assert [indices for indices, _ in parts] == [[0, 2], [1]]
    assert all("answers" in result for _, results in parts for result in results)
