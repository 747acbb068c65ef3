"""Limits before work: request bytes, JSON depth, Unicode, question count, lazy tokenizing and the bounded tokenizer
cache. Against a byte-level BPE tokenizer with Qwen's pre-tokenizer (trained here with HF `tokenizers`) and the
engine on the tiny checkpoint."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from kev_backend.engine.engine import Engine, EngineOptions, RequestFault
from kev_backend.protocol import encoding
from kev_backend.protocol.encoding import TextCache, safe_cuts
from kev_backend.protocol.request import Limits, RequestError, parse_request
from tests.helpers import CORPUS, kev_tokenizer, random_text


def test_safe_cuts_keep_the_token_count(qwen_bpe: Tokenizer) -> None:
    """Pieces cut by safe_cuts tokenize to exactly as many tokens as the whole text, whatever the text."""
    rng = random.Random(7)
    checked = 0
    for size in (50, 200, 1000):
        for _ in range(20):
            text = random_text(rng, 600)
            spans = list(safe_cuts(text, size))
            assert "".join(text[a:b] for a, b, _ in spans) == text
            if all(safe for *_, safe in spans):
                checked += len(spans) > 2
                pieces = sum(len(qwen_bpe.encode(text[a:b]).ids) for a, b, _ in spans)
                assert pieces == len(qwen_bpe.encode(text).ids)
    assert checked >= 40


def test_safe_cuts_cut_a_huge_word_anyway() -> None:
    spans = list(safe_cuts("y" * 2500, 1000))
    assert [(a, b) for a, b, _ in spans] == [(0, 1000), (1000, 2000), (2000, 2500)]
    assert [safe for *_, safe in spans] == [False, False, True]


def test_a_long_state_is_refused_having_tokenized_little(qwen_bpe: Tokenizer, tmp_path: Path) -> None:
    tokenizer = kev_tokenizer(qwen_bpe, tmp_path)
    state = " ".join(CORPUS) * 20_000  # ~4 MB, ~1.4 M tokens
    record = parse_request({"state": state, "questions": {"q": {"type": "noul"}}}, Limits(max_request_bytes=8 << 20))
    with pytest.raises(RequestError, match=r"state is at least [\d,]+ tokens \(counted in its first"):
        encoding.encode(record, tokenizer)
    assert tokenizer.tokenized_chars < len(state) / 10
    assert len(tokenizer.cache) == 0  # a refused request leaves nothing in the cache
    # Under the limit, the answer is the whole text's tokens and they are cached (short texts only).
    record = parse_request({"state": " ".join(CORPUS) * 500, "questions": {"q": {"type": "noul", "instructions": "x"}}})
    encoded = encoding.encode(record, tokenizer)
    assert list(encoded.state[1:]) == qwen_bpe.encode(record.state_text).ids
    assert tokenizer.cache.get("x") is not None and tokenizer.cache.get(record.state_text) is None  # too long


def test_lazy_count_agrees_with_the_exact_limit(qwen_bpe: Tokenizer, tmp_path: Path) -> None:
    """Around the limit the lazy count and the whole text's count agree: a state of exactly the limit passes, one
    token more is refused."""
    tokenizer = kev_tokenizer(qwen_bpe, tmp_path)
    text = random_text(random.Random(3), 40_000)
    n = len(qwen_bpe.encode(text).ids)
    assert len(text) > encoding.LAZY_CHARS
    questions = {"q": {"type": "noul"}}
    encoding.encode(
        parse_request({"state": text, "questions": questions}),
        tokenizer,
        Limits(max_state_tokens=n + 1, max_row_tokens=n + 99),
    )
    with pytest.raises(RequestError, match="over the"):
        encoding.encode(
            parse_request({"state": text, "questions": questions}),
            tokenizer,
            Limits(max_state_tokens=n, max_row_tokens=n + 99),
        )


def test_text_cache_is_bounded_in_bytes() -> None:
    cache = TextCache(max_bytes=100_000)
    for i in range(1000):
        cache.put(f"text {i} " * 10, tuple(range(i, i + 30)))
        assert cache.bytes <= 100_000
    assert 0 < len(cache) < 1000
    assert cache.get("text 999 " * 10) is not None and cache.get("text 0 " * 10) is None
    cache.put("z" * 200_000, (1,))  # larger than the whole budget: not kept
    assert cache.get("z" * 200_000) is None


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_json_depth"):
        Limits(max_json_depth=1000)
    with pytest.raises(ValueError, match="max_questions"):
        Limits(max_questions=0)


def test_configured_limits_apply(tiny_dir: Path) -> None:
    limits = Limits(max_request_bytes=2_000, max_json_depth=4, max_questions=2)
    engine = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(limits=limits))
    noul = {"type": "noul", "instructions": "urgent ?"}
    results = engine.answer(
        [
            json.dumps({"state": "x" * 3_000, "questions": {"q": noul}}),
            json.dumps({"state": [[[["deep"]]]], "questions": {"q": noul}}),
            json.dumps({"state": [["ok"]], "questions": {"q": noul}}),
            json.dumps({"state": "x", "questions": {"a": noul, "b": noul, "c": noul}}),
            json.dumps({"state": "x", "questions": {"a": noul, "b": noul}}),
        ]
    )
    assert isinstance(results[0], RequestError) and results[0].status == 413
    assert isinstance(results[1], RequestError) and "nested more than 4 levels" in results[1].message
    assert isinstance(results[2], dict)
    assert isinstance(results[3], RequestError) and "3 questions, over the limit of 2" in results[3].message
    assert isinstance(results[4], dict) and set(results[4]["answers"]) == {"a", "b"}


def test_a_fault_in_one_request_fails_it_alone(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected exception while preparing one request (here the tokenizer raising on one text) becomes that
    request's RequestFault; the others of the batch are answered."""
    engine = Engine.from_checkpoint(tiny_dir / "kev")
    original = engine.tokenizer.encode_user_text

    def flaky(text: str, budget: int | None = None, learned: encoding.Learned | None = None) -> tuple[int, ...]:
        if text == "poison":
            raise RuntimeError("tokenizer broke")
        return original(text, budget, learned)

    monkeypatch.setattr(engine.tokenizer, "encode_user_text", flaky)
    noul = {"type": "noul", "instructions": "urgent ?"}
    results = engine.answer([{"state": s, "questions": {"q": noul}} for s in ("fine", "poison", "also fine")])
    assert isinstance(results[1], RequestFault) and "preparing the request failed: RuntimeError" in str(results[1])
    assert isinstance(results[0], dict) and isinstance(results[2], dict)


def test_a_request_over_its_work_limit_is_refused_before_the_rest_is_tokenized(tiny_dir: Path) -> None:
    """max_request_tokens bounds a request's model work: its state once and every question's branch. The default
    takes 64 orders of a 255-option question (a full /permute), refuses 256 such questions, and stops tokenizing at
    the question that passes it; a request of exactly the limit passes."""
    engine = Engine.from_checkpoint(tiny_dir / "kev")
    options = {f"option {i}": None for i in range(255)}
    choice = {"type": "choice", "instructions": "which ?", "criteria": options}
    permute = {"state": "a ticket", "questions": {str(i): choice for i in range(64)}}
    wide = {"state": "a ticket", "questions": {str(i): choice for i in range(256)}}
    _, encoded = engine.prepare(permute)
    work = encoded.input_tokens
    assert 64 * 255 * 3 < work <= Limits().max_request_tokens
    (refused,) = engine.prepare_batch([wide]).results
    assert isinstance(refused, RequestError) and refused.status == 422
    assert refused.message.startswith("request is at least ") and "over the 131,072-token limit" in refused.message
    tight = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(limits=Limits(max_request_tokens=5_000)))
    tight.tokenizer.cache.max_bytes = 0  # count every text tokenized, none from the cache
    before = tight.tokenizer.tokenized_chars
    (small,) = tight.prepare_batch([wide]).results
    assert isinstance(small, RequestError) and "over the 5,000-token limit" in small.message
    # Stopped at the question that passed the limit (the 5th): a few questions' option texts, not 256 questions'.
    assert tight.tokenizer.tokenized_chars - before < 10 * sum(len(option) for option in options)
    at_limit = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(limits=Limits(max_request_tokens=work)))
    assert at_limit.prepare_batch([permute]).accepted
    over = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(limits=Limits(max_request_tokens=work - 1)))
    (last,) = over.prepare_batch([permute]).results
    assert isinstance(last, RequestError) and last.message.startswith(f"request is {work:,} tokens")
