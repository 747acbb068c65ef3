"""Growing states on the reference path (kev_backend/scoring/growth.py): a state that continues a banked one is
computed from that state's point, and every answer, alone and in batches, and every tensor of its cache is the same
bit for bit as computing it from nothing. Points are found by tokens for text and JSON states, confirmed token by
token, kept with their state and evicted with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kev_backend.engine.engine import Engine, EngineOptions
from kev_backend.model.qwen35 import SequenceCache
from kev_backend.protocol.encoding import Encoded, StateTokens
from kev_backend.scoring import growth
from kev_backend.scoring.growth import TAIL_TOKENS, point_length
from tests.helpers import QUESTIONS, request

CHUNK_TOKENS = 64  # 64-token chunks: the tiny model's states of a few hundred tokens keep points
MESSAGES = [
    "my card was charged twice for the same order",
    "I already asked for a refund yesterday and nobody answered",
    "the second payment is still pending on my statement",
    "can you tell me when the money will be back",
    "also the invoice shows the wrong address",
]


def reference_engine(tiny_dir: Path, bank_bytes: int | None = None) -> Engine:
    engine = Engine.from_checkpoint(
        tiny_dir / "kev", EngineOptions(device="cpu", backend="reference", bank_bytes=bank_bytes)
    )
    engine.scorer.chunk_tokens = CHUNK_TOKENS
    return engine


@pytest.fixture
def growing(tiny_dir: Path) -> Engine:
    return reference_engine(tiny_dir)


@pytest.fixture(scope="module")
def whole(tiny_dir: Path) -> Engine:
    """Keeps nothing: every state computed from nothing."""
    return reference_engine(tiny_dir, bank_bytes=0)


def whole_cache(engine: Engine, state: tuple[int, ...]) -> SequenceCache:
    ids = torch.tensor([state])
    return engine.scorer.model.forward_in_chunks(ids, chunk_tokens=CHUNK_TOKENS, keep_hidden=False)[1]


def assert_same_bits(got: SequenceCache, expected: SequenceCache) -> None:
    assert got.length == expected.length
    for name in ("keys", "values", "conv", "recurrent"):
        for a, b in zip(getattr(got, name), getattr(expected, name), strict=True):
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.shape == b.shape and torch.equal(a, b), name
    # an owned cache: no view of the banked state it continued keeps that state's tensors alive
    assert sum(t.untyped_storage().nbytes() for t in got.tensors()) == got.nbytes


def conversation(turns: int) -> list[str]:
    text, states = "", []
    for turn in range(turns):
        text += (" " if text else "") + MESSAGES[turn % len(MESSAGES)] + f" ({turn})"
        states.append(text)
    return states


def encoded(engine: Engine, state: object) -> Encoded:
    return engine.prepare(request(state=state, questions=QUESTIONS))[1]


def test_a_growing_text_conversation_answers_as_computed_whole(growing: Engine, whole: Engine) -> None:
    states = [encoded(growing, text) for text in conversation(40)]
    assert len(states[-1].state) > 6 * CHUNK_TOKENS
    computed = reused = 0
    for turn, request_ in enumerate(states):
        before = growing.bank.stats.prefix_hits
        assert growing.scorer.probabilities([request_]) == whole.scorer.probabilities([request_])
        state = request_.state
        assert_same_bits(growing.bank.get(state).cache, whole_cache(whole, state))
        previous = states[turn - 1].state if turn else ()
        if point_length(len(previous), CHUNK_TOKENS):  # the last turn kept a point: this one continues it
            assert growing.bank.stats.prefix_hits == before + 1
            reused += point_length(len(previous), CHUNK_TOKENS)
        computed += len(state)
    stats = growing.bank.stats
    assert stats.tokens_reused == reused and stats.tokens_computed == computed - reused
    assert stats.prefix_hits >= 30 and stats.tokens_computed < computed / 3


def test_grown_states_in_batches_answer_as_the_same_batches_computed_whole(growing: Engine, whole: Engine) -> None:
    """The reference path answers a batch as computing each of its states whole does, bit for bit (its rows of one
    state share passes, so a batch's numbers are compared with the same batch's)."""
    texts = conversation(24)
    other = "the app crashes after the last update and my data is lost"
    for turn in range(0, len(texts) - 2, 3):
        # the next three turns (the first continuing a banked turn, the others computed beside it), another state
        # and a turn already banked
        states = [texts[turn + i] for i in range(3)] + [other, texts[max(turn - 1, 0)]]
        expected = whole.scorer.probabilities([encoded(whole, state) for state in states])
        assert growing.scorer.probabilities([encoded(growing, state) for state in states]) == expected
    assert growing.bank.stats.prefix_hits >= 5


def test_a_json_state_growing_at_its_end_continues_its_point(growing: Engine, whole: Engine) -> None:
    for shape in ("list", "object"):
        grown = []
        for turn in range(30):
            said = [{"from": "customer", "text": MESSAGES[i % len(MESSAGES)]} for i in range(turn + 1)]
            grown.append(said if shape == "list" else {"ticket": 7, "messages": said})
        hits = growing.bank.stats.prefix_hits
        for state in grown:
            request_ = encoded(growing, state)
            assert growing.scorer.probabilities([request_]) == whole.scorer.probabilities([request_])
        assert growing.bank.stats.prefix_hits - hits >= 20, shape


def test_a_states_boundary_keys_are_computed_once_and_the_same() -> None:
    """A state's (StateTokens) boundary keys, computed once a width and kept on it, are those of its plain tokens for
    any bound, before and after they are kept."""
    tokens = tuple(range(1000, 1300))
    state = StateTokens(tokens)
    for upto in (300, 0, -5, 64, 65, 299, 1000, 128):
        assert growth.boundary_keys(state, 64, upto) == growth.boundary_keys(tokens, 64, min(upto, len(tokens)))
    assert list(state.chains) == [64]


def test_a_turns_work_is_what_it_computes(growing: Engine) -> None:
    """Scorer.work, read before a request runs (on any thread): a new state's tokens and its rows'; a banked state's
    the same (a pass counts it whole); a turn continuing a point, the tokens it then computes after the point (the
    bank's tokens_computed) and its rows'."""
    texts = conversation(20)
    first, turn = encoded(growing, texts[-2]), encoded(growing, texts[-1])
    assert growing.scorer.work(first) == first.input_tokens
    growing.scorer.probabilities([first])
    assert growing.scorer.work(first) == first.input_tokens
    work, before = growing.scorer.work(turn), growing.bank.stats.tokens_computed
    growing.scorer.probabilities([turn])
    computed = growing.bank.stats.tokens_computed - before
    assert 0 < computed < len(turn.state) - CHUNK_TOKENS
    assert work == computed + turn.input_tokens - len(turn.state)


def test_a_point_is_where_the_state_keeps_it(growing: Engine) -> None:
    """The last chunk boundary at least TAIL_TOKENS before the end; none on a state shorter than a chunk and a tail."""
    assert point_length(CHUNK_TOKENS + TAIL_TOKENS - 1, CHUNK_TOKENS) == 0
    assert point_length(CHUNK_TOKENS + TAIL_TOKENS, CHUNK_TOKENS) == CHUNK_TOKENS
    assert point_length(3 * CHUNK_TOKENS + TAIL_TOKENS - 1, CHUNK_TOKENS) == 2 * CHUNK_TOKENS
    long = encoded(growing, conversation(20)[-1])
    growing.scorer.probabilities([long])
    point = growing.bank.get(long.state).point
    assert point is not None and point.length == point_length(len(long.state), CHUNK_TOKENS)
    conv, recurrent = [t for t in point.conv if t is not None], [t for t in point.recurrent if t is not None]
    assert conv and recurrent and point.nbytes == sum(t.nbytes for t in conv + recurrent)
    assert growing.bank.stats.bytes == growing.bank.get(long.state).cache.nbytes + point.nbytes


def test_a_state_that_changes_before_the_point_is_computed_whole(growing: Engine, whole: Engine) -> None:
    texts = conversation(16)
    growing.scorer.probabilities([encoded(growing, texts[-1])])
    changed = encoded(growing, "A different opening. " + texts[-1] + " one more line")
    hits = growing.bank.stats.prefix_hits
    assert growing.scorer.probabilities([changed]) == whole.scorer.probabilities([changed])
    assert growing.bank.stats.prefix_hits == hits


def test_a_hash_alone_never_decides(growing: Engine, whole: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every boundary's key the same, a state sharing no tokens with the banked one still computes whole."""
    monkeypatch.setattr(growth, "boundary_keys", lambda tokens, width, upto: [0] * (upto // width))
    first = encoded(growing, conversation(16)[-1])
    growing.scorer.probabilities([first])
    unrelated = encoded(growing, " ".join(["the invoice total was wrong and the refund is late"] * 12))
    assert point_length(len(unrelated.state), CHUNK_TOKENS)
    assert growing.scorer.probabilities([unrelated]) == whole.scorer.probabilities([unrelated])
    assert growing.bank.stats.prefix_hits == 0


def entry_bytes(tiny_dir: Path, states: list[object]) -> list[int]:
    """Each state's bank entry in bytes, banked alone."""
    sizes = []
    for state in states:
        probe = reference_engine(tiny_dir)
        probe.scorer.probabilities([encoded(probe, state)])
        sizes.append(probe.bank.stats.bytes)
    return sizes


def test_using_a_point_keeps_its_state_banked(tiny_dir: Path, whole: Engine) -> None:
    texts = conversation(16)
    first, other, grown = texts[-3], " ".join(["an unrelated ticket about a late parcel"] * 12), texts[-2]
    sizes = entry_bytes(tiny_dir, [first, other, grown])
    engine = reference_engine(tiny_dir, bank_bytes=sum(sizes) - 1)  # one of the three must go
    for state in (first, other):
        engine.scorer.probabilities([encoded(engine, state)])
    request_ = encoded(engine, grown)  # continues `first`, the least recently used until its point is found
    assert engine.scorer.probabilities([request_]) == whole.scorer.probabilities([request_])
    assert engine.bank.stats.prefix_hits == 1
    assert encoded(engine, first).state in engine.bank and encoded(engine, other).state not in engine.bank


def test_a_point_goes_with_its_state(tiny_dir: Path, whole: Engine) -> None:
    texts = conversation(16)
    first, other = texts[-3], " ".join(["an unrelated ticket about a late parcel"] * 12)
    sizes = entry_bytes(tiny_dir, [first, other])
    engine = reference_engine(tiny_dir, bank_bytes=max(sizes) + min(sizes) // 2)  # one state at a time
    for state in (first, other):
        engine.scorer.probabilities([encoded(engine, state)])
    assert encoded(engine, first).state not in engine.bank
    request_ = encoded(engine, texts[-2])
    assert engine.scorer.probabilities([request_]) == whole.scorer.probabilities([request_])
    assert engine.bank.stats.prefix_hits == 0
