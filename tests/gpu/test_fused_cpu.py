"""The fused pass's plumbing on a CPU: fp32, torch stand-ins for its kernels (tests/gpu/fused_cpu_ops.py), against the
reference engine. Catches wrong indices, slots, picks, pool writes and pass splits before any GPU time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kev_backend.dev.parity import compare
from kev_backend.dev.workloads import filler, realistic, short6, sized, state_counter
from kev_backend.gpu import pool as pool_module
from kev_backend.gpu.graphs import Bucket
from kev_backend.gpu.kernels import attention
from kev_backend.gpu.pass_kernels import PassKernels
from kev_backend.gpu.passes import Row
from kev_backend.gpu.scorer import state_cost
from kev_backend.scoring import growth
from tests.gpu.fused_cpu_ops import CALLS, engines


@pytest.mark.parametrize("graphs", [False, True])
def test_fused_pass_answers_like_the_reference(tiny_dir: Path, graphs: bool) -> None:
    """With `graphs`, passes that fit a bucket run padded to it from the graphs' fixed buffers (eagerly: no CUDA
    here), passes with long new states among them; the others as usual."""
    reference, fused = engines(tiny_dir, pass_tokens=600, graphs=graphs)
    requests = realistic(60, seed=7, min_words=5, max_words=150) + [short6(1), short6(), short6()]
    # A question over 64 tokens takes the chunked delta rule, reading its state in place.
    long_question = {"type": "noul", "instructions": " ".join(["order"] * 70)}
    requests.append({"state": "x y", "questions": {"q": long_question, "r": requests[0]["questions"]["q0"]}})
    encoded = [reference.prepare(r)[1] for r in requests]
    expected = reference.scorer.probabilities(encoded)
    CALLS.clear()
    first = fused.probabilities(encoded)  # several passes (600-token budget): new states and bank hits mixed
    assert fused.bank.stats.misses > 0
    hits = fused.bank.stats.hits
    again = fused.probabilities(encoded)  # every state from the bank
    assert fused.bank.stats.hits > hits
    alone = [fused.probabilities([e])[0] for e in encoded]
    for result in (first, again, alone):
        report = compare(expected, result)
        assert report["max_abs"] < 2e-5 and report["flips"] == 0, report
    assert CALLS["chunked_rows"] > 0, CALLS  # every short segment and every row
    if graphs:
        stats = fused.graphs.stats
        assert stats.captures == 0 and stats.replays == 0  # nothing to capture without CUDA
        assert stats.runs > 0 and len(fused.graphs.seen) >= 2, (stats, fused.graphs.seen)
        # Padded passes with a long new state: the long states share the state region with the short ones.
        assert stats.long_runs > 0
        # A padded group counts its capacity, not its work: the chunked kernel is told so there.
        assert CALLS["chunked_rows padded=True"] > 0, CALLS
        # Its long new states' first segment on a launch of its own (kernels.delta_rule.chunked_rows' lead_apart),
        # after the short states' slots of their one group.
        assert CALLS["chunked_rows lead_apart=True"] > 0, CALLS
        assert CALLS["chunked_rows lead=True"] > 0, CALLS
    assert CALLS["chunked_rows padded=False"] > 0, CALLS  # eager passes (the long rows at least)


def test_the_kernels_references_answer_like_the_reference_engine(tiny_dir: Path) -> None:
    """The kernel table of the kernels' own references (PassKernels.references, the delta rule token by token) runs a
    pass, padded into graph buckets and eagerly, answering as the reference engine does: what the CPU tests' stand-ins
    are built from."""
    reference, fused = engines(tiny_dir, kernels=PassKernels.references(), pass_tokens=600)
    requests = realistic(8, seed=11, min_words=5, max_words=120) + [short6(2)]
    encoded = [reference.prepare(r)[1] for r in requests]
    expected = reference.scorer.probabilities(encoded)
    for got in (fused.probabilities(encoded), [fused.probabilities([e])[0] for e in encoded]):  # batched, then alone
        report = compare(expected, got)
        assert report["max_abs"] < 2e-5 and report["flips"] == 0, report
    assert fused.graphs.stats.runs > 0  # padded passes among them (short6 alone)


def test_both_scorers_keep_the_scorer_contract(tiny_dir: Path) -> None:
    """The reference and the fused scorer both answer the contract the engine, the metrics and the bench use
    (scoring/contract.py): their statistics as one typed object, the graphs' counts the fused scorer's own, none for
    the reference path; the warm-up's hooks; the start-up line built from them."""
    from kev_backend.scoring.contract import ScorerStats

    reference, fused = engines(tiny_dir)
    for scorer in (reference.scorer, fused):
        for name in ("probabilities", "launch", "units", "warm_graphs", "wide_states", "warm_head", "bank_summary"):
            assert callable(getattr(scorer, name)), name
    assert reference.scorer.stats() == ScorerStats() and reference.scorer.wide_states() == 0
    assert "no CUDA graphs" in reference.summary()
    fused.probabilities([reference.prepare(short6(n))[1] for n in range(3)])
    stats, graphs = fused.stats(), fused.graphs.stats
    assert isinstance(stats, ScorerStats)
    assert (stats.graphs, stats.graph_captures, stats.graph_replays) == (graphs.count, graphs.captures, graphs.replays)
    assert stats.oom_retries == fused.oom_retries == 0
    assert stats.gemm_shapes is None  # a CPU's projections run on no pre-tuned cuBLASLt table
    assert fused.wide_states() >= 1


def test_a_batch_with_more_states_than_the_bank_holds_runs_in_passes_it_can_hold(tiny_dir: Path) -> None:
    """A pass takes at most as many states as the bank has slots to give (its scratch slot is not one): four states
    on a bank of three run in two passes, answering as the reference does."""
    reference, probe = engines(tiny_dir)
    _, fused = engines(tiny_dir, bank_bytes=2 * 3 * probe.bank.pool.slot_bytes)
    assert fused.bank.pool.scratch_slot == 3  # slots 0-2 to give, 3 the scratch
    encoded = [reference.prepare(short6(i))[1] for i in range(4)]
    report = compare(reference.scorer.probabilities(encoded), fused.probabilities(encoded))
    assert report["max_abs"] < 2e-5, report


def test_a_state_with_more_rows_than_a_pass_spreads_them_over_passes(tiny_dir: Path) -> None:
    """A state whose rows pass the row limit beside it goes with its first rows; the rest follow in passes of rows
    only (reading it from the bank), none over the budget: the same answers as the reference, alone and beside other
    requests, and as one pass of it all. (Here the budget and the row limit are both 300 tokens.)"""
    budget = 300
    reference, fused = engines(tiny_dir, pass_tokens=budget, max_row_tokens=budget, graphs=False)
    _, whole = engines(tiny_dir, pass_tokens=1 << 20, graphs=False)
    question = {"type": "choice", "instructions": "which team?", "criteria": {f"team {i}": None for i in range(12)}}
    many = {"state": " ".join(["ticket"] * 200), "questions": {f"q{i}": question for i in range(12)}}
    encoded = [reference.prepare(r)[1] for r in (short6(1), many, short6(2))]
    state, rows = len(encoded[1].state), [len(q.tokens) for q in encoded[1].questions]
    assert state + sum(rows) > budget and state + rows[0] <= budget  # the test's premise: it cannot fit one pass
    passes = fused.plan([Row(r, q, t, e.state) for r, e in enumerate(encoded) for q, t in enumerate(e.questions)])
    own = [group for group in passes if any(row.request == 1 for row in group)]
    assert len(own) > 2 and all(row.request == 1 for group in own for row in group)
    assert sum(len(group) for group in own) == len(rows)
    for group in own[1:]:
        assert sum(len(row.tokens.tokens) for row in group) <= budget  # rows only: the state is banked by then
    expected = reference.scorer.probabilities(encoded)
    for result in (fused.probabilities(encoded), fused.probabilities([encoded[1]]), whole.probabilities(encoded)):
        report = compare(expected if len(result) == 3 else expected[1:2], result)
        assert report["max_abs"] < 2e-5 and report["flips"] == 0, report


def test_a_failed_capture_leaves_its_bucket_eager(tiny_dir: Path) -> None:
    """A bucket whose CUDA-graph capture raises (an operation that refuses capture) is recorded, never retried, no
    other capture is tried after it, and passes run padded and eagerly with the same answers: the engine keeps
    starting and serving."""
    reference, fused = engines(tiny_dir, graphs=True)
    attempts = []

    def refuse(bucket, warm):
        attempts.append(bucket)
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = fused.graphs
    graphs.capture, graphs._capture = True, refuse  # as on a GPU, with a capture that always fails
    encoded = [reference.prepare(short6(i))[1] for i in range(3)]
    for _ in range(3):  # new states (too large for a graph here), then twice from the bank (a bucket)
        report = compare(reference.scorer.probabilities(encoded), fused.probabilities(encoded))
        assert report["max_abs"] < 2e-5, report
    assert graphs.stats.capture_failures == len(attempts) == len(graphs.failed) == 1
    assert graphs.stats.runs >= 2 and graphs.stats.replays == 0


@pytest.mark.parametrize("state_words", [700, 940])
def test_a_trimmed_bucket_answers_like_the_reference(tiny_dir: Path, state_words: int) -> None:
    """A long new state whose padding and its rows' hold a whole 128-token tile runs padded to a trimmed bucket (the
    rows right after the state, at the pass's end; torch stand-ins on the CPU), answering as the reference does; with
    940 words the state's own last tokens lie inside the rows' region (s1024r128t1024's starts at 896)."""
    from kev_backend.gpu.graphs import Bucket

    reference, fused = engines(tiny_dir, graphs=True)
    question = {"type": "noul", "instructions": " ".join(["order"] * 30)}
    request = {"state": " ".join(["order"] * state_words), "questions": {"a": question, "b": question}}
    encoded = [reference.prepare(request)[1]]
    assert 512 < len(encoded[0].state) and 64 < sum(len(q.tokens) for q in encoded[0].questions) <= 128
    report = compare(reference.scorer.probabilities(encoded), fused.probabilities(encoded))
    assert report["max_abs"] < 2e-5, report
    assert fused.graphs.seen == {Bucket(1024, 128, 128)}, fused.graphs.seen


def test_buckets_over_eager_above_flops_are_left_to_eager_passes(tiny_dir: Path, monkeypatch) -> None:
    """Buckets whose projections come to more than EAGER_ABOVE_FLOPS are not kept: a pass that would take one runs
    eagerly (not through the graphs' buffers) and answers as from a bucket."""
    from kev_backend.gpu import graphs as graph_module

    reference, graphed = engines(tiny_dir, pass_tokens=2000)
    per_token = graphed.model.w.projection_flops
    monkeypatch.setattr(graph_module, "EAGER_ABOVE_FLOPS", 256 * per_token)
    _, limited = engines(tiny_dir, pass_tokens=2000)
    kept = limited.graphs.buckets
    assert max(b.tokens for b in kept if not b.long_prefix) == 256 < max(b.tokens for b in graphed.graphs.buckets)
    assert [b for b in graphed.graphs.buckets if b.tokens <= 256 or b.long_prefix] == kept
    count = state_counter(reference.tokenizer)
    small, large = (reference.prepare(sized(n, count, n))[1] for n in (40, 400))  # ~165 row tokens each
    expected = reference.scorer.probabilities([small, large])
    for fused in (graphed, limited):
        assert compare(expected, fused.probabilities([small]) + fused.probabilities([large]))["max_abs"] < 2e-5
    assert graphed.graphs.stats.runs == 2 and limited.graphs.stats.runs == 1  # the 400-token state's pass: eager


def test_a_growing_conversation_continues_its_points_and_answers_as_computed_whole(tiny_dir: Path, monkeypatch) -> None:
    """Each turn's state is the turn before's and a message: it shares the turn before's pages up to that state's
    point, starts from a copy of the point and computes only its tokens after it, keeping a point of its own (the
    points here from 128 tokens: POINT_MIN_TOKENS lowered). Its answers are the reference engine's, and the same as the
    state computed whole on an empty bank and inside a batch; two turns in one pass do not read a point the pass has
    yet to compute; evicting the turn before frees only the pages no later turn holds."""
    monkeypatch.setattr(pool_module, "POINT_MIN_TOKENS", 128)
    reference, fused = engines(tiny_dir, pass_tokens=4096)
    _, whole = engines(tiny_dir, pass_tokens=4096)
    # Four turns of 90 words, then one of 3: its tokens after the point are a short segment (passes.is_short).
    words = [260 + 90 * t for t in range(5)] + [260 + 90 * 4 + 3]
    turns = [{"state": filler(n, 5), "questions": short6()["questions"]} for n in words]
    encoded = [reference.prepare(turn)[1] for turn in turns]
    assert all(b.state[: len(a.state) - 8] == a.state[: len(a.state) - 8] for a, b in zip(encoded, encoded[1:]))
    CALLS.clear()
    grown = [fused.probabilities([e])[0] for e in encoded]
    stats = fused.bank.stats
    assert stats.prefix_hits == len(turns) - 1, stats
    reused = sum(growth.point_length(len(e.state), 64) for e in encoded[:-1])
    assert stats.tokens_reused == reused and stats.tokens_computed == sum(len(e.state) for e in encoded) - reused
    assert CALLS["chunked_rows extend=True"] > 0 and CALLS["chunked_rows save=True"] > 0, CALLS
    # Turns of a few hundred tokens after the point take an extensions' bucket; the 3-word one runs eagerly.
    # The first turn from its bucket, the next four from extensions' buckets (their padded passes, eagerly on a CPU);
    # the 3-word turn, whose tokens after the point are short, eagerly.
    extended = {b for b in fused.graphs.seen if b.ext_tokens}
    assert extended == {Bucket(0, 192, ext_tokens=128), Bucket(0, 192, ext_tokens=256)}, fused.graphs.seen
    assert fused.graphs.stats.runs == len(turns) - 1
    report = compare(reference.scorer.probabilities(encoded), grown)
    assert report["max_abs"] < 2e-5 and report["flips"] == 0, report
    for e, answer in zip(encoded, grown, strict=True):
        whole.bank.clear()
        assert compare([whole.probabilities([e])[0]], [answer])["max_abs"] < 1e-6
    # Two turns of one conversation in one pass: the later one is computed whole (its point is not computed yet).
    whole.bank.clear()
    hits = whole.bank.stats.prefix_hits
    assert compare(whole.probabilities(encoded[:2]), grown[:2])["max_abs"] < 1e-6
    assert whole.bank.stats.prefix_hits == hits
    # Pages are shared by reference: the pool's bytes count each page once, and evicting every earlier turn leaves
    # the last one answering the same.
    pool = fused.bank.pool
    assert fused.bank.stats.bytes == pool.used_bytes
    for e in encoded[:-1]:
        fused.bank.forget(e.state)
    assert compare([fused.probabilities([encoded[-1]])[0]], grown[-1:])["max_abs"] == 0.0
    held = {page for slot in fused.bank._entries.values() for page in slot.pages}
    assert set(np.flatnonzero(pool.page_refs)) == held and len(pool.free_pages) == pool.pages - len(held)


def test_our_kernels_grow_a_state_bit_for_bit(tiny_dir: Path, monkeypatch, kernel_run, one_tile_size) -> None:
    """The pass on this project's Triton kernels (interpreted here; tests/gpu/test_determinism.py compiles them on a
    GPU at Kev-4B's shapes): turns continuing the turn before's point answer, bit for bit, as the same states computed
    whole. Holds because an extension's chunks of the delta rule and key blocks of attention start where the whole
    state's do (points sit on 64-token boundaries), and the point carries the chain's fp32 state. Attention's keys in
    parts of 128 here: the states whole fold theirs in turn, the turns read theirs in parallel."""
    if not kernel_run.interpreted:
        pytest.skip("compiled on a GPU: tests/gpu/test_determinism.py")
    monkeypatch.setattr(pool_module, "POINT_MIN_TOKENS", 64)
    monkeypatch.setattr(attention, "FOLD_KEYS", 128)
    kernels = PassKernels.gpu()
    _, fused = engines(tiny_dir, kernels=kernels, graphs=False)
    reference, whole = engines(tiny_dir, kernels=kernels, graphs=False)
    words = [150, 240, 243]  # the last turn's tokens after the point: a short segment
    turns = [{"state": filler(n, 6), "questions": dict(list(short6()["questions"].items())[:1])} for n in words]
    encoded = [reference.prepare(turn)[1] for turn in turns]
    grown = [fused.probabilities([e])[0] for e in encoded]
    assert fused.bank.stats.prefix_hits == len(turns) - 1
    for e, answer in zip(encoded, grown, strict=True):
        whole.bank.clear()
        assert whole.probabilities([e])[0] == answer


def conversation_turns(reference, conversations: int, words: tuple[int, ...]) -> list[list]:
    """Each conversation's turns of `words` words (a growing state: each turn's the one before's and a message)."""
    return [
        [reference.prepare({"state": filler(n, 40 + c), "questions": short6()["questions"]})[1] for n in words]
        for c in range(conversations)
    ]


def rows_of(encoded: list) -> list[Row]:
    return [Row(r, q, t, e.state) for r, e in enumerate(encoded) for q, t in enumerate(e.questions)]


def test_continued_turns_are_planned_by_the_tokens_they_compute(tiny_dir: Path, monkeypatch) -> None:
    """Six conversations banked near 700 tokens, then each one's next turn in one batch: a pass's budget counts what a
    continued turn computes (its tokens after the point and its rows, weighted by its prefix:
    PREFIX_TOKENS_PER_COST), not its whole state, so the six turns go in one pass where computed whole they take
    three. The answers are the reference's and the same as the turns computed whole."""
    monkeypatch.setattr(pool_module, "POINT_MIN_TOKENS", 128)
    budget = 2_400  # a turn: ~980 tokens whole, ~350 continued
    reference, fused = engines(tiny_dir, pass_tokens=budget, graphs=False)
    turns = conversation_turns(reference, 6, (700, 790))
    banked, following = [t[0] for t in turns], [t[1] for t in turns]
    fused.probabilities(banked)
    assert all(e.state in fused.bank for e in banked)
    whole = sum(len(e.state) + sum(len(q.tokens) for q in e.questions) for e in following)
    assert len(fused.plan(rows_of(following))) == 1 and whole > 2 * budget  # whole: three passes at least
    # Each turn's work as the pipeline estimates it before the pass (Scorer.work) is what the pass is planned at.
    for e in following:
        point = fused.bank.continued(e.state)[2]
        assert fused.work(e) == state_cost(len(e.state), sum(len(q.tokens) for q in e.questions), point.length)
    assert sum(fused.work(e) for e in following) <= budget
    passes = []
    forward = fused.forward
    monkeypatch.setattr(fused, "forward", lambda layout: passes.append(layout) or forward(layout))
    hits = fused.bank.stats.prefix_hits
    grown = fused.probabilities(following)
    assert len(passes) == 1 and fused.bank.stats.prefix_hits - hits == 6
    assert compare(reference.scorer.probabilities(following), grown)["max_abs"] < 2e-5
    fused.bank.clear()
    assert compare(fused.probabilities(following), grown)["max_abs"] < 1e-6


def test_a_turn_whose_point_left_the_bank_is_planned_again(tiny_dir: Path, monkeypatch) -> None:
    """A pass planned with a turn continuing a point, whose state was evicted before the turn's slot was allocated
    (to make room for a state before it in the pass): the turn is left out of that pass, then planned again and
    computed whole in the next, and every answer is the reference's."""
    monkeypatch.setattr(pool_module, "POINT_MIN_TOKENS", 128)
    reference, fused = engines(tiny_dir, pass_tokens=4_000, graphs=False)
    turns = conversation_turns(reference, 2, (700, 790))
    fused.probabilities([t[0] for t in turns])
    following = [t[1] for t in turns]
    next_pass = fused.next_pass
    planned = []

    def evicting(rows, planned_states=()):  # next_pass, then the second turn's point evicted
        group, found = next_pass(rows, planned_states)
        planned.append(len({row.state for row in group}))
        if len(planned) == 1:
            fused.bank.forget(turns[1][0].state)
        return group, found

    monkeypatch.setattr(fused, "next_pass", evicting)
    hits = fused.bank.stats.prefix_hits
    grown = fused.probabilities(following)
    assert planned == [2, 1] and fused.bank.stats.prefix_hits - hits == 1
    assert compare(reference.scorer.probabilities(following), grown)["max_abs"] < 2e-5
