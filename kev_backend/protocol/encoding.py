"""Tokenization and Kev's token layout.

State S = [<state>] + tokens(state text). Question branch = [<q>] + tokens(instructions), then per option
[<opt>] + tokens(option text) + [</opt>], then [<decide>]. Every caller text is escaped first so it cannot produce
a delimiter, and each segment is tokenized on its own. The head reads each option's </opt> and the <decide> token.

Limits before work: a text longer than `LAZY_CHARS` is counted piece by piece as it is tokenized (below; or first,
for a tokenizer not cut in pieces), cut where the count cannot change (see `safe_cuts`), and refused as soon as the
count passes its budget, so an oversized state costs about as
much as tokenizing the limit's worth of it, never the whole text. Tokenized texts are kept in a cache bounded in
bytes, and only once their request's limits have passed.

Pieces: a text longer than PIECE_CHARS is tokenized in pieces of about that many characters, cut where every
pre-tokenizer Kev's bases use starts a new pre-token (`safe_cuts`), so the pieces' tokens, in order, are the whole
text's (where a piece could not be cut so, the text is tokenized again whole); each piece's tokens are cached on
their own, and a text over its budget is refused as its pieces are counted. A conversation's state, growing turn by
turn, tokenizes its new text and the last piece or two before it, not the whole conversation again; a long new
text's pieces go through the tokenizer's threads at once. A tokenizer for which a cut might not be a pre-token
boundary (`pieces_are_exact`) has its texts tokenized whole.

Truncating (`Limits.truncate_states`): a state over the limit keeps <state> and its first max_state_tokens - 1
tokens, and the rest is only counted, piece by piece (`KevTokenizer.encode_prefix`): the response reports the whole
state's count, and memory stays bounded by the limit whatever the state's length.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer

from .request import (
    DEFAULT_LIMITS,
    Limits,
    Record,
    RequestError,
    request_too_costly_message,
    row_too_long_message,
    state_too_long_message,
)
from .text import escape_user_text

# Texts up to this many characters are tokenized whole; longer ones are counted in pieces first (~64 K characters
# is ~15 K tokens of ordinary text: one piece costs a few ms).
LAZY_CHARS = 1 << 16
# Texts longer than this are tokenized without holding the GIL (KevTokenizer._tokenize).
GIL_FREE_CHARS = 4096
CACHE_BYTES = 64 << 20  # the tokenizer cache's budget (texts and their token tuples, as Python holds them)
CACHE_MAX_CHARS = 1 << 16  # longer texts are never cached: their bank entry is what saves work on a repeat
# Longer texts are tokenized in pieces of about this many characters (between half and all of it, but where a long
# run without a lone space makes a larger one), each cached: a growing state's turn tokenizes ~1-2 pieces and its new
# text. 4,096 characters are ~1,000 tokens of ordinary text, under a millisecond to tokenize.
PIECE_CHARS = 4096
PIECES_A_CALL = LAZY_CHARS // PIECE_CHARS  # pieces tokenized (or counted against a budget) together
BATCH_ENCODE_FROM = 4  # output counts: fewer texts are counted one by one, more in one call (the tokenizer's threads)
# Output counts (usage.output_tokens): a tokenizer `in_pieces` counts a response's answers in pieces cut before every
# lone space, each piece's count kept: from one response to the next the answers repeat their keys, option names and
# most of their numbers, so a count is mostly lookups (docs/kernels.md, Output counts). Pieces of at most
# COUNTED_PIECE_CHARS characters are kept, at most COUNTED_PIECES of them (then the kept ones are dropped and the
# counting starts over; ~20 MB at most): a client's own option names cannot grow it.
COUNTED_PIECE_CHARS = 64
COUNTED_PIECES = 1 << 17
LONE_SPACE = re.compile(r"(?<=\S)(?= \S)")  # just before a space between two non-space characters (safe_cuts)
# A cut inside a word may change BPE's count near the cut by a token or two: the count is trusted only past this
# much slack per such cut.
UNSAFE_CUT_TOKENS = 4

Learned = list[tuple[str, tuple[int, ...]]]  # texts and their tokens, to be cached once their request passed

log = logging.getLogger(__name__)

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
    from the tuple. Two of them compare by their copies: finding a request's state in the bank compares it with the
    banked one, which item by item took ~3 ms for a 64k-token state."""

    _hash: int
    ids: np.ndarray
    chains: dict[int, list[int]]  # its chunk boundaries' keys by chunk width (scoring/growth.py, boundary_keys)

    def __new__(cls, tokens: Iterable[int]) -> StateTokens:
        self = super().__new__(cls, tokens)
        self._hash = tuple.__hash__(self)
        self.chains = {}
        self.ids = np.array(self, dtype=np.int64)
        self.ids.flags.writeable = False
        return self

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StateTokens):
            return self._hash == other._hash and bool(np.array_equal(self.ids, other.ids))
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other


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
    state: tuple[int, ...]  # [<state>] + state tokens (a StateTokens from encode): what the model reads
    questions: tuple[EncodedQuestion, ...]
    dropped: int = 0  # state tokens cut off past the limit (Limits.truncate_states); 0 when read whole

    @property
    def state_tokens(self) -> int:
        """The request's whole state in tokens, <state> included (usage.state_tokens)."""
        return len(self.state) + self.dropped

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
        self.cache = TextCache(CACHE_BYTES)
        self.counts: dict[str, int] = {}  # output pieces' token counts (count_tokens_batch)
        self.counts_lock = threading.Lock()
        self.tokenized_chars = 0  # characters of caller text run through the tokenizer (a running total)
        self.in_pieces = pieces_are_exact(self.tokenizer)
        if not self.in_pieces:
            log.info("kev: %s/tokenizer.json may join text across spaces: long texts are tokenized whole", directory)

    def _pad_id(self, directory: Path) -> int:
        config_path = directory / "tokenizer_config.json"
        pad = json.loads(config_path.read_text()).get("pad_token") if config_path.exists() else None
        if isinstance(pad, dict):
            pad = pad.get("content")
        pad_id = self.tokenizer.token_to_id(pad) if pad else None
        return 0 if pad_id is None else pad_id

    def _tokenize(self, text: str) -> Encoding:
        """Caller text escaped and tokenized. A long text goes through `encode_batch`, which lets go of the GIL while
        it works (`encode` holds it: 65 ms for a 52,000-token text, during which the model's thread can neither
        launch work nor deliver answers); a short one through `encode`, cheaper for a few words."""
        self.tokenized_chars += len(text)
        escaped = escape_user_text(text)
        if len(escaped) > GIL_FREE_CHARS:
            return self.tokenizer.encode_batch([escaped], add_special_tokens=False)[0]
        return self.tokenizer.encode(escaped, add_special_tokens=False)

    def _encode(self, text: str, learned: Learned | None = None, budget: int | None = None) -> tuple[int, ...]:
        """Caller text's tokens. A text of PIECE_CHARS or fewer (or any, for a tokenizer not `in_pieces`) whole. A
        longer one in the spans of `safe_cuts(text, PIECE_CHARS)`, PIECES_A_CALL at a time, each from the cache or,
        those missing, through one `encode_batch` (the tokenizer's threads, the GIL let go): the spans' tokens, in
        order, where every cut is safe; else (a run of over half a piece without a lone space) the text again, whole.
        With a budget, OverBudget once the spans so far hold more tokens than it (UNSAFE_CUT_TOKENS more for each
        unsafe cut, as `encode_user_text`'s count). The spans tokenized here join `learned`, to be cached once their
        request passed."""
        if len(text) <= PIECE_CHARS or not self.in_pieces:
            return tuple(self._tokenize(text).ids) if text else ()
        parts: list[tuple[int, ...]] = []
        counted = unsafe = 0
        spans = safe_cuts(text, PIECE_CHARS)
        while group := list(itertools.islice(spans, PIECES_A_CALL)):
            pieces = [text[start:stop] for start, stop, _ in group]
            found = [self.cache.get(piece) for piece in pieces]
            missing = [i for i, tokens in enumerate(found) if tokens is None]
            if missing:
                self.tokenized_chars += sum(len(pieces[i]) for i in missing)
                escaped = [escape_user_text(pieces[i]) for i in missing]
                for i, encoding in zip(missing, self.tokenizer.encode_batch(escaped, add_special_tokens=False)):
                    found[i] = tokens = tuple(encoding.ids)
                    if learned is not None:
                        learned.append((pieces[i], tokens))
            parts.extend(found)  # type: ignore[arg-type]
            counted += sum(len(tokens) for tokens in found)  # type: ignore[arg-type]
            unsafe += sum(not safe for *_, safe in group)
            if budget is not None and counted > budget + UNSAFE_CUT_TOKENS * unsafe:
                raise OverBudget(counted - UNSAFE_CUT_TOKENS * unsafe, group[-1][1])
        if unsafe:
            return tuple(self._tokenize(text).ids)
        return tuple(itertools.chain.from_iterable(parts))

    def _count(self, text: str) -> int:
        return len(self._tokenize(text))

    def encode_user_text(self, text: str, budget: int | None = None, learned: Learned | None = None) -> tuple[int, ...]:
        """Caller text, escaped and tokenized without special tokens (Qwen adds no BOS). With a budget, a text longer
        than LAZY_CHARS is counted piece by piece first, and OverBudget raised once it is known to need more tokens
        than that, having tokenized not much more than the budget's worth of it; a shorter one is tokenized whole and
        left to the caller's exact check; a tokenizer `in_pieces` counts as it tokenizes, in pieces (`_encode`).
        The result is not cached: `remember` does that once the request passed (a long text's pieces tokenized here
        join `learned` for that)."""
        cached = self.cache.get(text)
        if cached is not None:
            return cached
        if budget is not None and len(text) > LAZY_CHARS:
            if self.in_pieces:
                return self._encode(text, learned, budget)
            counted = unsafe = 0
            for start, stop, safe in safe_cuts(text, LAZY_CHARS):
                counted += self._count(text[start:stop])
                unsafe += not safe
                if counted > budget + UNSAFE_CUT_TOKENS * unsafe:
                    raise OverBudget(counted - UNSAFE_CUT_TOKENS * unsafe, stop)
        return self._encode(text, learned)

    def encode_prefix(self, text: str, keep: int, learned: Learned | None = None) -> tuple[tuple[int, ...], int]:
        """The first `keep` tokens of caller text, as the whole text tokenizes, and how many tokens it has in all, in
        memory bounded by `keep` whatever the text's length. A text up to LAZY_CHARS is tokenized whole; a longer one
        is counted piece by piece (`safe_cuts`), its head (up to one whole piece past the `keep`-th token) tokenized
        whole and the rest only counted. At a safe cut the pieces' tokens are the whole text's; a cut inside a word
        (no lone space in half a piece) may move a token or two beside it, a piece away from the head's first `keep`,
        and the count by as much, as the limit check without truncation accepts too. Pieces tokenized here join
        `learned` (`_encode`)."""
        whole = self.cache.get(text)
        if whole is None and len(text) <= LAZY_CHARS:
            whole = self._encode(text, learned)
        if whole is not None:
            return whole[:keep], len(whole)
        pieces = safe_cuts(text, LAZY_CHARS)
        counted, head, past = 0, 0, False
        for start, stop, _ in pieces:
            counted += self._count(text[start:stop])
            head = stop
            if past:
                break
            past = counted > keep
        tokens = self._encode(text[:head], learned)
        rest = sum(self._count(text[start:stop]) for start, stop, _ in pieces)  # the pieces after the head
        return tokens[:keep], len(tokens) + rest

    def remember(self, text: str, tokens: tuple[int, ...]) -> None:
        if len(text) <= CACHE_MAX_CHARS:
            self.cache.put(text, tokens)

    def count_tokens(self, text: str) -> int:
        """Plain token count (no escaping), as Kev counts usage.output_tokens."""
        return self.count_tokens_batch([text])[0]

    def count_tokens_batch(self, texts: list[str]) -> list[int]:
        """count_tokens of each text. A tokenizer `in_pieces` counts them in pieces cut before every lone space (the
        pieces' counts add up to the whole text's: pieces_are_exact), each piece's count looked up or, for those not
        kept yet, counted together in one call (COUNTED_PIECES says why); another tokenizer counts each text whole."""
        if not self.in_pieces:
            return self._counted(texts)
        split = [LONE_SPACE.split(text) for text in texts]
        with self.counts_lock:
            counts = self.counts
            missing = list({piece for pieces in split for piece in pieces if piece not in counts})
            new = dict(zip(missing, self._counted(missing))) if missing else {}
            found = [sum(new[piece] if piece in new else counts[piece] for piece in pieces) for pieces in split]
            if len(counts) + len(new) > COUNTED_PIECES:
                counts.clear()
            counts.update((piece, n) for piece, n in new.items() if len(piece) <= COUNTED_PIECE_CHARS)
        return found

    def _counted(self, texts: list[str]) -> list[int]:
        """Each text's tokens counted by the tokenizer: BATCH_ENCODE_FROM or more in one call, which spreads them over
        its threads, fewer one by one (handing a few to the threads costs more than it saves)."""
        if len(texts) < BATCH_ENCODE_FROM:
            return [len(self.tokenizer.encode(text, add_special_tokens=False).ids) for text in texts]
        return [len(e.ids) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]


class OverBudget(Exception):
    """A text needs more tokens than its budget: at least `counted` tokens in its first `chars` characters."""

    def __init__(self, counted: int, chars: int) -> None:
        super().__init__(f"{counted} tokens in {chars} characters")
        self.counted = counted
        self.chars = chars


def safe_cuts(text: str, size: int) -> Iterator[tuple[int, int, bool]]:
    """Consecutive (start, stop, safe) spans of about `size` characters covering `text`, each cut just before a
    single space that sits between two non-space characters where one lies in the span's second half (safe). There
    every pre-tokenizer Kev's bases use (Qwen's GPT-style regex, whitespace splitting) starts a new piece, the space
    going with the text after it, so the pieces' token counts add up to the whole text's. Where no such space lies
    within a span (one huge word) it is cut anyway (not safe)."""
    start, n = 0, len(text)
    while start < n:
        stop, safe = min(start + size, n), True
        if stop < n:
            cut = stop
            while cut > start + size // 2 and not (
                text[cut] == " " and not text[cut - 1].isspace() and cut + 1 < n and not text[cut + 1].isspace()
            ):
                cut -= 1
            if cut > start + size // 2:
                stop = cut
            else:
                safe = False
        yield start, stop, safe
        start = stop


# The pre-tokenizers and normalizers after which a lone space between two non-space characters always starts a new
# pre-token, whatever comes before it (byte-level BPE with Qwen's or GPT's split, whitespace and digit splitting) and
# nothing joins across it: pieces cut there (`safe_cuts`) tokenize as the whole text does. Metaspace (SentencePiece's
# "▁") is not among them: it marks a piece's start as a word's.
PIECEWISE_PRE_TOKENIZERS = {"Sequence", "Split", "ByteLevel", "Whitespace", "WhitespaceSplit", "Digits", "Punctuation"}
PIECEWISE_NORMALIZERS = {"Sequence", "NFC", "NFD", "Lowercase", "StripAccents"}
# Text that tries the cuts: words, digits, punctuation, contractions, runs of spaces and newlines, accents, CJK.
PIECES_PROBE = (
    "It's 12:45 on 2026-12-07; the user's 3rd reply said:  \"no!\" \n\nThen  we'll\tsee... café naïve "
    'résumé 你好 世界 (x+y)=42 --flag a,b,c [1, 2, 3] {"k": "v"} e\u0301 ok?!  \n  done. '
)


def pieces_are_exact(tokenizer: Tokenizer) -> bool:
    """Whether texts may be tokenized in pieces (`KevTokenizer._encode`): a pre-tokenizer and normalizer made of
    PIECEWISE ones, no added token that holds whitespace or strips it beside itself, and a probe text's tokens in
    pieces as its tokens whole, cut at every lone space."""

    def kinds(part: dict | None, key: str) -> set[str]:
        if not part:
            return set()
        return {part["type"]}.union(*(kinds(p, key) for p in part.get(key) or []))

    def spec(component: object | None) -> dict | None:  # the component's own JSON, not the whole tokenizer's
        return json.loads(component.__getstate__()) if component is not None else None  # type: ignore[attr-defined]

    if not kinds(spec(tokenizer.pre_tokenizer), "pretokenizers") <= PIECEWISE_PRE_TOKENIZERS:
        return False
    if not kinds(spec(tokenizer.normalizer), "normalizers") <= PIECEWISE_NORMALIZERS:
        return False
    for added in tokenizer.get_added_tokens_decoder().values():
        if added.lstrip or added.rstrip or any(c.isspace() for c in added.content):
            return False
    text = PIECES_PROBE * 3
    pieces = re.split(r"(?<=\S)(?= \S)", text)  # cut before every lone space
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    parts = [tokenizer.encode(piece, add_special_tokens=False).ids for piece in pieces]
    return len(pieces) > 20 and [t for part in parts for t in part] == whole


class TextCache:
    """Least recently used texts' token tuples, bounded by an estimate of the bytes Python holds for them. Shared
    by the threads that prepare batches and the one that finishes them."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, tuple[tuple[int, ...], int]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def cost(text: str, tokens: tuple[int, ...]) -> int:
        return sys.getsizeof(text) + sys.getsizeof(tokens) + 32 * len(tokens)  # an int object per token id

    def get(self, text: str) -> tuple[int, ...] | None:
        with self._lock:
            item = self._items.get(text)
            if item is None:
                return None
            self._items.move_to_end(text)
            return item[0]

    def put(self, text: str, tokens: tuple[int, ...]) -> None:
        with self._lock:
            if text in self._items:  # most of a request's texts, found here when it was encoded
                return
            cost = self.cost(text, tokens)
            if cost > self.max_bytes:
                return
            self._items[text] = (tokens, cost)
            self.bytes += cost
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.bytes -= dropped

    def __len__(self) -> int:
        return len(self._items)


def encode(record: Record, tokenizer: KevTokenizer, limits: Limits = DEFAULT_LIMITS) -> Encoded:
    """Kev's layout for one request; a row over the limit is refused, and so is a state over it unless the limits
    truncate states (then it is cut, and the row limit holds after the cut). Each text is tokenized only as far as its
    budget needs to tell; the texts enter the tokenizer's cache once all passed."""
    d = tokenizer.delimiters
    texts: Learned = []

    def tokens_of(text: str, budget: int) -> tuple[int, ...]:
        tokens = tokenizer.encode_user_text(text, budget, texts)
        texts.append((text, tokens))
        return tokens

    state, dropped = encode_state(record.state_text, tokenizer, limits, texts)
    questions = []
    work = len(state)  # the request's model work so far (Limits.max_request_tokens)
    for question in record.questions:
        branch: list[int] = [d.question]
        option_ends = []
        try:
            branch += tokens_of(question.instruction, limits.max_row_tokens - len(state) - len(branch))
            for option in question.options:
                budget = limits.max_row_tokens - len(state) - len(branch) - 1
                branch += [d.option, *tokens_of(option, budget), d.option_end]
                option_ends.append(len(branch) - 1)
        except OverBudget as over:
            at_least = len(branch) + over.counted
            raise RequestError(
                row_too_long_message(at_least, len(state), limits.max_row_tokens, at_least=True)
            ) from None
        branch.append(d.decide)
        if len(state) + len(branch) > limits.max_row_tokens:
            raise RequestError(row_too_long_message(len(branch), len(state), limits.max_row_tokens))
        questions.append(EncodedQuestion(tokens=tuple(branch), option_ends=tuple(option_ends)))
        work += len(branch)
        if work > limits.max_request_tokens:  # refused before the rest is tokenized
            last = question is record.questions[-1]
            raise RequestError(request_too_costly_message(work, limits.max_request_tokens, at_least=not last))
    for text, tokens in texts:
        tokenizer.remember(text, tokens)
    return Encoded(state=state, questions=tuple(questions), dropped=dropped)


def encode_state(text: str, tokenizer: KevTokenizer, limits: Limits, texts: Learned) -> tuple[StateTokens, int]:
    """[<state>] + the state's tokens, and how many were cut off past the limit (only when the limits truncate
    states; else a state over the limit is refused with Kev's 422). A text read whole joins `texts`, to be cached once
    its request passed; a cut one never does: its tokens are not the text's, and the bank keys a state by its tokens,
    so a cut state is banked as what the model read."""
    keep = limits.max_state_tokens - 1
    if limits.truncate_states:
        tokens, total = tokenizer.encode_prefix(text, keep, texts)
        if total == len(tokens):
            texts.append((text, tokens))
        return StateTokens((tokenizer.delimiters.state, *tokens)), total - len(tokens)
    try:
        tokens = tokenizer.encode_user_text(text, keep, texts)
    except OverBudget as over:
        raise RequestError(state_too_long_message(1 + over.counted, limits.max_state_tokens, over.chars)) from None
    if len(tokens) > keep:
        raise RequestError(state_too_long_message(1 + len(tokens), limits.max_state_tokens))
    texts.append((text, tokens))
    return StateTokens((tokenizer.delimiters.state, *tokens)), 0
