"""Tokenization and Kev's token layout (kev-model.md §2.2, §4.3–4.5).

State S = [<state>] + tokens(state text). Question branch = [<q>] + tokens(instructions), then per option
[<opt>] + tokens(option text) + [</opt>], then [<decide>]. Every caller text is escaped first so it cannot produce
a delimiter, and each segment is tokenized on its own. The head reads each option's </opt> and the <decide> token.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .systemone import (
    MAX_ROW_TOKENS,
    MAX_STATE_TOKENS,
    Record,
    RequestError,
    escape_user_text,
    row_too_long_message,
    state_too_long_message,
)

# Kev reuses rarely used Qwen special tokens as its delimiters; ids are looked up by string.
DELIMITER_TOKENS = {
    "state": "<|fim_prefix|>",
    "question": "<|fim_middle|>",
    "option": "<|box_start|>",
    "option_end": "<|box_end|>",
    "decide": "<|fim_suffix|>",
}


@dataclass(frozen=True)
class Delimiters:
    state: int
    question: int
    option: int
    option_end: int
    decide: int
    pad: int


class StateTokens(tuple):
    """A state's token ids: a tuple (equal to the plain one, and hashing as it does) that computes its hash and an
    int64 copy of itself once, when its request is encoded, outside the model's time. The bank and the scorer key
    dicts by the state, and a 2,465-token tuple takes ~17 µs to hash (CPU host), ~20 times in a long5 request's
    launch before its pass can start; its ids go into the pass's pinned buffer in ~3 µs from the copy against ~100
    from the tuple."""

    _hash: int
    ids: np.ndarray

    def __new__(cls, tokens: Iterable[int]) -> StateTokens:
        self = super().__new__(cls, tokens)
        self._hash = tuple.__hash__(self)
        self.ids = np.array(self, dtype=np.int64)
        self.ids.flags.writeable = False
        return self

    def __hash__(self) -> int:
        return self._hash


def token_ids(tokens: tuple[int, ...]) -> np.ndarray:
    """Tokens as int64 (a StateTokens' own copy, no conversion)."""
    return tokens.ids if isinstance(tokens, StateTokens) else np.asarray(tokens, dtype=np.int64)


@dataclass(frozen=True)
class EncodedQuestion:
    tokens: tuple[int, ...]  # the branch, [<q>] … [<decide>]
    option_ends: tuple[int, ...]  # branch-local index of each option's </opt>

    @property
    def decide(self) -> int:
        return len(self.tokens) - 1


@dataclass(frozen=True)
class Encoded:
    state: tuple[int, ...]  # [<state>] + state tokens (a StateTokens from encode)
    questions: tuple[EncodedQuestion, ...]

    @property
    def input_tokens(self) -> int:
        """len(packed ids): the state once plus every branch (usage.input_tokens)."""
        return len(self.state) + sum(len(q.tokens) for q in self.questions)


class KevTokenizer:
    """The base model's tokenizer.json through HF `tokenizers`, with Kev's delimiters and escaping."""

    def __init__(self, directory: Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        ids = {}
        for role, token in DELIMITER_TOKENS.items():
            token_id = self.tokenizer.token_to_id(token)
            if token_id is None:
                raise ValueError(f"{directory}/tokenizer.json has no {token} (Kev's {role} delimiter)")
            ids[role] = token_id
        self.delimiters = Delimiters(**ids, pad=self._pad_id(directory))
        self._encode_escaped = functools.lru_cache(maxsize=65_536)(self._encode_uncached)

    def _pad_id(self, directory: Path) -> int:
        config_path = directory / "tokenizer_config.json"
        pad = json.loads(config_path.read_text()).get("pad_token") if config_path.exists() else None
        if isinstance(pad, dict):
            pad = pad.get("content")
        pad_id = self.tokenizer.token_to_id(pad) if pad else None
        return 0 if pad_id is None else pad_id

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        if not text:
            return ()
        return tuple(self.tokenizer.encode(escape_user_text(text), add_special_tokens=False).ids)

    def encode_user_text(self, text: str) -> tuple[int, ...]:
        """Caller text, escaped and tokenized without special tokens (Qwen adds no BOS)."""
        return self._encode_escaped(text)

    def count_tokens(self, text: str) -> int:
        """Plain token count (no escaping), as Kev counts usage.output_tokens."""
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def count_tokens_batch(self, texts: list[str]) -> list[int]:
        """count_tokens of each text, encoded in one call (the tokenizer spreads a batch over its threads: 32 short6
        answers took 4.7 ms on 2 cores, 7.3 one by one)."""
        return [len(e.ids) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]


@dataclass(frozen=True)
class Limits:
    max_state_tokens: int = MAX_STATE_TOKENS  # Ls, <state> included
    max_row_tokens: int = MAX_ROW_TOKENS  # Ls + branch


def encode(record: Record, tokenizer: KevTokenizer, limits: Limits = Limits()) -> Encoded:
    """Kev's layout for one request; a state or row over the limits is refused, never truncated."""
    d = tokenizer.delimiters
    state = StateTokens((d.state, *tokenizer.encode_user_text(record.state_text)))
    if len(state) > limits.max_state_tokens:
        raise RequestError(state_too_long_message(len(state), limits.max_state_tokens))
    questions = []
    for question in record.questions:
        branch = [d.question, *tokenizer.encode_user_text(question.instruction)]
        option_ends = []
        for option in question.options:
            branch += [d.option, *tokenizer.encode_user_text(option), d.option_end]
            option_ends.append(len(branch) - 1)
        branch.append(d.decide)
        if len(state) + len(branch) > limits.max_row_tokens:
            raise RequestError(row_too_long_message(len(branch), len(state), limits.max_row_tokens))
        questions.append(EncodedQuestion(tokens=tuple(branch), option_ends=tuple(option_ends)))
    return Encoded(state=state, questions=tuple(questions))
