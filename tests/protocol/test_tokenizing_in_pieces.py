"""Long texts tokenized in pieces (protocol/encoding.py, Pieces): the tokens are the whole text's, a growing
conversation's turn tokenizes only its new text and the last piece or two before it, output texts are counted in
pieces as whole, and a tokenizer that may join text across a space is never cut. Against a byte-level BPE tokenizer
with Qwen's pre-tokenizer (trained here with HF `tokenizers`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from kev_backend.protocol import encoding
from kev_backend.protocol.encoding import PIECE_CHARS, KevTokenizer, pieces_are_exact, safe_cuts
from kev_backend.protocol.request import Limits, parse_request
from kev_backend.protocol.text import escape_user_text
from tests.helpers import CORPUS, kev_tokenizer, random_text

QUESTIONS = {"urgent": {"type": "noul", "instructions": "is this urgent ?"}}


def state_tokens(tokenizer: KevTokenizer, state: str) -> list[int]:
    record = parse_request({"state": state, "questions": QUESTIONS})
    return list(encoding.encode(record, tokenizer, Limits(max_request_bytes=8 << 20)).state[1:])


def test_a_long_text_in_pieces_has_the_whole_texts_tokens(qwen_bpe: Tokenizer, tmp_path: Path) -> None:
    """Random texts (words, runs of spaces and newlines, tabs, digits, punctuation, accents, CJK, 40-letter words,
    delimiters to escape) of up to ~15 pieces: the tokens through the pieces are the whole text's, piece for piece
    cut at a lone space."""
    tokenizer = kev_tokenizer(qwen_bpe, tmp_path)
    assert tokenizer.in_pieces
    rng = random.Random(11)
    for n in (1_000, 3_000, 9_000):
        for _ in range(6):
            text = random_text(rng, n).replace("42", "<|fim_prefix|>", 1)
            spans = list(safe_cuts(text, PIECE_CHARS))
            assert len(spans) > 1 and all(safe for *_, safe in spans)
            assert all(text[b] == " " and not text[b - 1].isspace() for _, b, _ in spans[:-1])
            whole = qwen_bpe.encode(escape_user_text(text), add_special_tokens=False).ids
            assert list(tokenizer.encode_user_text(text)) == whole


def test_a_text_with_a_run_no_cut_is_safe_in_is_tokenized_whole(qwen_bpe: Tokenizer, tmp_path: Path) -> None:
    """A run of 3 pieces' length without a lone space cannot be cut safely: the text's tokens are its own, whole."""
    tokenizer = kev_tokenizer(qwen_bpe, tmp_path)
    text = " ".join(CORPUS) + " " + "y" * (3 * PIECE_CHARS) + " " + " ".join(CORPUS) * 40
    assert not all(safe for *_, safe in safe_cuts(text, PIECE_CHARS))
    assert list(tokenizer.encode_user_text(text)) == qwen_bpe.encode(text, add_special_tokens=False).ids


def test_a_growing_state_tokenizes_its_new_text(qwen_bpe: Tokenizer, tmp_path: Path) -> None:
    """A conversation growing by ~1,400 characters a turn past LAZY_CHARS (where a state is counted against its limit
    as it is tokenized): each turn's state tokens are the whole text's, and the tokenizer reads the new text and at
    most two pieces before it (a conversation's first turn: all of it). A text read again reads nothing."""
    tokenizer = kev_tokenizer(qwen_bpe, tmp_path)
    rng = random.Random(5)
    state = random_text(rng, 2_000)  # ~9,000 characters
    for turn in range(70):
        added = random_text(rng, 300)
        state += added
        before = tokenizer.tokenized_chars
        assert state_tokens(tokenizer, state) == qwen_bpe.encode(escape_user_text(state), add_special_tokens=False).ids
        read = tokenizer.tokenized_chars - before
        assert read <= (len(added) + 2 * PIECE_CHARS + 100 if turn else len(state) + 100), (len(state), read)
    assert len(state) > 1.5 * encoding.LAZY_CHARS
    before = tokenizer.tokenized_chars
    state_tokens(tokenizer, state)
    assert tokenizer.tokenized_chars == before


def test_a_refused_request_caches_none_of_its_pieces(qwen_bpe: Tokenizer, tmp_path: Path) -> None:
    tokenizer = kev_tokenizer(qwen_bpe, tmp_path)
    state = " ".join(CORPUS) * 300
    record = parse_request({"state": state, "questions": {**QUESTIONS, "bad": {"type": "noul", "instructions": "x"}}})
    try:
        encoding.encode(record, tokenizer, Limits(max_request_bytes=8 << 20, max_questions=256, max_row_tokens=10))
    except Exception:  # noqa: BLE001 - refused as the limit says; what matters is the cache after
        pass
    assert len(tokenizer.cache) == 0
    state_tokens(tokenizer, state)
    assert len(tokenizer.cache) > 10  # its pieces, once its request passed


def test_a_tokenizer_that_strips_beside_an_added_token_is_never_cut(tmp_path: Path) -> None:
    """An added token that takes the spaces after it (rstrip) joins text across a lone space: cut there, the piece
    after it would keep a space the whole text's tokens do not have. Such a tokenizer's texts are tokenized whole."""
    words = sorted({w for line in CORPUS for w in line.split()} | {"[UNK]"})
    bpe = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_next")
    bpe.add_tokens([AddedToken("<note>", rstrip=True)])
    text = " ".join(f"{w} <note> {w}" for w in words) * 60
    assert len(text) > 4 * PIECE_CHARS
    assert not pieces_are_exact(bpe)
    tokenizer = kev_tokenizer(bpe, tmp_path)
    assert not tokenizer.in_pieces
    whole = bpe.encode(text, add_special_tokens=False).ids
    assert list(tokenizer.encode_user_text(text)) == whole
    tokenizer.in_pieces = True  # what cutting it would give
    assert list(tokenizer.encode_user_text(text)) != whole


def test_output_counts_in_pieces_are_the_whole_texts(qwen_bpe: Tokenizer, tmp_path: Path, monkeypatch) -> None:
    """usage.output_tokens counted in pieces cut before every lone space, each piece's count kept: every count is the
    whole text's, in one batch or alone; a count of pieces all kept asks the tokenizer nothing; pieces over
    COUNTED_PIECE_CHARS are not kept, and past COUNTED_PIECES the kept ones are dropped, the counts still exact."""
    tokenizer = kev_tokenizer(qwen_bpe, tmp_path)
    assert tokenizer.in_pieces
    rng = random.Random(5)
    answers = [
        json.dumps({f"q{i}": {"choice": rng.choice(CORPUS[0].split()), "confidence": round(rng.random(), 4)}})
        for i in range(40)
    ]
    texts = answers + [random_text(rng, 200) for _ in range(20)] + ["x" * 300 + " y", "", " ", "a  b"]
    whole = [len(qwen_bpe.encode(text, add_special_tokens=False).ids) for text in texts]
    assert tokenizer.count_tokens_batch(texts) == whole
    assert [tokenizer.count_tokens(text) for text in texts] == whole
    assert all(len(piece) <= encoding.COUNTED_PIECE_CHARS for piece in tokenizer.counts)
    asked: list[list[str]] = []
    counted = tokenizer._counted
    monkeypatch.setattr(tokenizer, "_counted", lambda pieces: asked.append(pieces) or counted(pieces))
    assert tokenizer.count_tokens(answers[3]) == whole[3] and asked == []
    monkeypatch.setattr(encoding, "COUNTED_PIECES", 50)
    assert tokenizer.count_tokens_batch(texts) == whole
    assert len(tokenizer.counts) <= 50


def test_a_tokenizer_not_in_pieces_counts_whole(tmp_path: Path) -> None:
    """A tokenizer that may join text across a lone space counts each output text whole."""
    words = sorted({w for line in CORPUS for w in line.split()} | {"[UNK]"})
    bpe = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_next")
    bpe.add_tokens([AddedToken("<note>", rstrip=True)])
    tokenizer = kev_tokenizer(bpe, tmp_path)
    assert not tokenizer.in_pieces
    text = " ".join(f"{w} <note> {w}" for w in words)
    assert tokenizer.count_tokens(text) == len(bpe.encode(text, add_special_tokens=False).ids)
    assert not tokenizer.counts
