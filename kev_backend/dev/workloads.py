"""Request shapes for benchmarks and parity checks.

`short6` and `long5` follow Kev's own serving benchmark (docs/benchmarking.md): a ~34-token support ticket with six
questions, and a ~2,200-token document with five of them; a "new" state differs by a "Ticket {i}. " prefix.
`realistic` draws a reproducible mix of states (text, objects, lists; 30 to 2,500 tokens) and 1 to 8 questions of
every type. `sized` puts long5's questions on a state of an exact token count (the scaling workload, long states).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from typing import Any

# The words of generated states and questions, and of the tiny checkpoints' word-level tokenizer
# (kev_backend.dev.synthetic, which imports them from here: this module stays free of torch, so a Locust file that
# draws traffic starts fast).
WORDS = """
a an the and or but not no yes is are was were be been has have had do does did can could will would should may might
must of to in on at by for with from as about into over after before under between through during without within up
down out off again then once here there when where why how all any both each few more most other some such only own
same so than too very just now this that these those it its i me my we our you your he him his she her they them
their what which who whom whose if because while until against above below customer user account order invoice
payment refund charge charged billing card credit price plan subscription cancel renew upgrade downgrade trial free
ticket support issue problem error bug crash outage login password reset email phone address shipping delivery
package late lost damaged broken return exchange item product service app website page server database api request
response timeout slow fast failed failure success urgent priority high medium low critical minor major question
answer help please thanks thank hello hi dear team agent manager sales technical billing legal security privacy data
report log warning info debug status open closed pending resolved escalated spam abuse fraud risk policy terms
contract renewal discount coupon tax fee amount total balance due overdue paid unpaid month year week day today
yesterday tomorrow time date hour minute second january february march april june july august september october
november december monday tuesday wednesday thursday friday saturday sunday new old same again still already never
always sometimes often good bad great terrible happy angry frustrated satisfied unhappy neutral positive negative
sentiment category topic label intent tone language english spanish french german sure maybe unknown other none
true false valid invalid correct incorrect complete incomplete document section clause party agreement name title
description summary note notes comment comments message text body subject from to cc id number code version
release update feature request improvement question praise complaint feedback review rating score level one two
three four five six seven eight nine ten zero first second third last next previous is it does should we route
""".split()

TICKET = (
    "Shoes arrived two weeks late and in the wrong size. Also I see two charges on my card. "
    "What are you going to do about this?"
)
PARAGRAPH = (
    "The customer reports that the order was placed on the first of the month and paid with a credit card. "
    "The package was marked as delivered but the box was damaged and one item was missing. The customer called "
    "support twice, was promised a refund within five days, and has not received it. The account shows a second "
    "charge for the same amount, and the customer asks whether the subscription renewal was also billed twice. "
)
SUPPORT_QUESTIONS: dict[str, dict[str, Any]] = {
    "department": {
        "type": "choice",
        "instructions": "Which department should handle this ticket?",
        "criteria": {
            "billing": "charges, refunds and invoices",
            "shipping": "late, lost or damaged deliveries",
            "product": "sizing, defects and product questions",
        },
    },
    "return_reason": {
        "type": "choice",
        "instructions": "Why does the customer want to return the item?",
        "criteria": {
            "wrong_size": "the item does not fit",
            "damaged": "the item arrived broken",
            "late": "the item arrived too late",
            "not_as_described": None,
            "no_return": "the customer does not want a return",
        },
    },
    "requested_resolution": {
        "type": "choice",
        "instructions": "What resolution does the customer ask for?",
        "criteria": {"refund": None, "exchange": None, "store_credit": None, "apology": "only an apology"},
    },
    "tone": {
        "type": "choice",
        "instructions": "What is the tone of the message?",
        "criteria": {"calm": None, "annoyed": None, "furious": None},
    },
    "escalate": {
        "type": "noul",
        "instructions": "Should this ticket be escalated to a manager?",
        "criteria": {"true": "the customer is at risk of leaving", "false": "support can resolve it"},
    },
    "frustration": {
        "type": "score",
        "instructions": "How frustrated is the customer?",
        "criteria": ["not frustrated", "somewhat frustrated", "very frustrated"],
    },
}
FIVE = {k: v for k, v in SUPPORT_QUESTIONS.items() if k != "tone"}


def short6(i: int | None = None) -> dict[str, Any]:
    """Kev's support ticket with its six questions; `i` makes a new state ("Ticket {i}. " prefix)."""
    state = TICKET if i is None else f"Ticket {i}. {TICKET}"
    return {"state": state, "questions": SUPPORT_QUESTIONS}


def long5(i: int | None = None, paragraphs: int = 30) -> dict[str, Any]:
    """A ~2,200-token document (Kev's PARAGRAPH x30) with five questions."""
    text = PARAGRAPH * paragraphs
    return {"state": text if i is None else f"Ticket {i}. {text}", "questions": FIVE}


GROW_OPENING_PARAGRAPHS = 27  # a conversation's first state: ~2,000 tokens (Kev's PARAGRAPH x27)
GROW_MAX_TOKENS = 65_536  # Kev's state limit: a conversation ends before its state would pass it


def grow(conversation: int, turn: int, opening_paragraphs: int = GROW_OPENING_PARAGRAPHS) -> dict[str, Any]:
    """Turn `turn` of a growing conversation (the `grow` workload): the opening document (~2,000 tokens by default)
    and `turn` messages of ~200 tokens each appended, with short6's six questions. Each turn's state is the turn
    before's plus one message; `conversation` makes the opening new."""
    state = f"Conversation {conversation}. " + PARAGRAPH * opening_paragraphs
    for t in range(turn):
        said = " ".join(WORDS[(11 * t + 3 * j) % len(WORDS)] for j in range(40))
        state += f"\n\nTurn {t + 1}, the customer writes: {PARAGRAPH * 2}{said}."
    return {"state": state, "questions": SUPPORT_QUESTIONS}


def filler(words: int, i: int | None = None) -> str:
    """`words` of WORDS (each one token with the tiny checkpoints' tokenizer), after a "Ticket {i}. " prefix that
    makes the state new."""
    text = " ".join(WORDS[(7 * j) % len(WORDS)] for j in range(words))
    return text if i is None else f"Ticket {i}. {text}"


def state_counter(tokenizer: Any) -> Callable[[dict[str, Any]], int]:
    """A request's state tokens as the engine encodes them with `tokenizer` (a KevTokenizer; <state> included),
    counted past any request limit: `sized` may step over Kev's 65,536-token limit on its way to a length just
    under it."""
    from ..protocol.encoding import encode
    from ..protocol.request import Limits, parse_request

    limits = Limits(
        max_request_bytes=1 << 40, max_state_tokens=1 << 40, max_row_tokens=1 << 40, max_request_tokens=1 << 40
    )
    return lambda body: len(encode(parse_request(body, limits), tokenizer, limits).state)


def sized(
    tokens: int, count: Callable[[dict[str, Any]], int], i: int | None = None, questions: dict | None = None
) -> dict[str, Any]:
    """long5's five questions (or `questions`) on a filler state of exactly `tokens` tokens as `count` counts a
    request's state (the engine's encoder: <state> included). Where a tokenizer cannot land on it (a word of several
    tokens steps over it), the longest state under it."""

    def body(words: int) -> dict[str, Any]:
        return {"state": filler(words, i), "questions": FIVE if questions is None else questions}

    words, tried = tokens, set()
    while words not in tried:  # a word a token: the first step lands
        tried.add(words)
        got = count(body(words))
        if got == tokens:
            return body(words)
        words = max(0, words + tokens - got)
    low, high = 0, tokens  # every word is at least a token, so `tokens` words are over
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if count(body(middle)) <= tokens else (low, middle - 1)
    return body(low)


def _sentence(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _state(rng: random.Random, n_words: int) -> Any:
    kind = rng.choice(["text", "object", "list"])
    if kind == "text":
        return _sentence(rng, n_words)
    parts = max(1, n_words // 40)
    chunks = [_sentence(rng, max(1, n_words // parts)) for _ in range(parts)]
    if kind == "list":
        return [{"note": c, "id": rng.randint(1, 9999)} if rng.random() < 0.3 else c for c in chunks]
    return {f"field_{j}": c for j, c in enumerate(chunks)} | {"priority": rng.choice([1, 2.5, True, None])}


def _question(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["noul", "choice", "choice", "score"])
    instructions = _sentence(rng, rng.randint(3, 14))
    if kind == "noul":
        criteria = {"true": _sentence(rng, 4)} if rng.random() < 0.5 else None
        return {"type": "noul", "instructions": instructions, "criteria": criteria}
    if kind == "choice":
        names = rng.sample(WORDS, rng.randint(2, 8))
        return {
            "type": "choice",
            "instructions": instructions,
            "criteria": {n: (_sentence(rng, rng.randint(1, 6)) if rng.random() < 0.6 else None) for n in names},
        }
    return {
        "type": "score",
        "instructions": instructions,
        "criteria": [_sentence(rng, rng.randint(1, 4)) for _ in range(rng.randint(3, 5))],
    }


def realistic(n_questions: int, seed: int = 0, min_words: int = 30, max_words: int = 2_500) -> list[dict[str, Any]]:
    """Requests until `n_questions` questions: log-uniform state sizes, 1–8 questions, some states repeated."""
    rng = random.Random(seed)
    requests: list[dict[str, Any]] = []
    total = 0
    while total < n_questions:
        if requests and rng.random() < 0.15:
            state = rng.choice(requests)["state"]  # several requests about the same document
        else:
            words = int(round(min_words * (max_words / min_words) ** rng.random()))
            state = _state(rng, words)
        questions = {f"q{j}": _question(rng) for j in range(rng.randint(1, 8))}
        requests.append({"state": state, "questions": questions})
        total += len(questions)
    return requests


def jevbench_cases() -> list[dict[str, Any]]:
    """The 240 cases of jevbench-240 (PyPI `jevbench`, Apache-2.0), read from the installed package: tickets, logs
    and documents with several typed questions each."""
    from jevbench.suites import load_suite

    return [{"state": case.state, "questions": case.questions} for case in load_suite("jevbench-240").cases]


class Traffic:
    """An endless, reproducible stream of requests of one shape: `short6`, `long5`, `mix` (jevbench-240) or `grow`
    (the next turn of one of CONVERSATIONS growing conversations, picked at random; a conversation that reaches Kev's
    state limit starts over as a new one). `repeat` is the share of requests that reuse a state already sent (the
    rest are new states), drawn from the last HISTORY_KEEP sent (as a state bank with LRU eviction would see them; a
    stream of hours would otherwise keep every state it sent). A mix's new states are numbered from `numbered_from`
    + 1: streams given ranges apart never send the same state."""

    SHAPES = ("short6", "long5", "mix", "grow")
    CONVERSATIONS = 8
    # A turn adds ~200 tokens to a ~2,000-token opening: ~300 turns stay under GROW_MAX_TOKENS.
    GROW_TURNS = (GROW_MAX_TOKENS - 4_000) // 200
    HISTORY_KEEP = 10_000

    def __init__(self, shape: str = "short6", repeat: float = 0.0, seed: int = 0, numbered_from: int = 0) -> None:
        if shape not in self.SHAPES:
            raise ValueError(f"shape must be one of {self.SHAPES}, not {shape!r}")
        if not 0.0 <= repeat <= 1.0:
            raise ValueError("repeat must be in [0, 1]")
        self.shape, self.repeat = shape, repeat
        self.rng = random.Random(seed)
        self.cases = jevbench_cases() if shape == "mix" else []
        self.sent = numbered_from
        # What `repeat` draws from (only with repeat > 0): requests, or a grow turn's (conversation, turn), made again
        # when drawn (a turn's state is up to Kev's 64k tokens).
        self.history: deque[dict[str, Any] | tuple[int, int]] = deque(maxlen=self.HISTORY_KEEP)
        self.turns: dict[int, int] = {}  # grow: each open conversation's next turn

    def next(self) -> dict[str, Any]:
        if self.history and self.rng.random() < self.repeat:
            drawn = self.rng.choice(self.history)
            return grow(*drawn) if isinstance(drawn, tuple) else drawn
        self.sent += 1
        if self.shape == "grow":
            conversation, turn = self.next_turn()
            if self.repeat:
                self.history.append((conversation, turn))
            return grow(conversation, turn)
        if self.shape == "mix":
            case = self.rng.choice(self.cases)
            # A new state: the same document under a fresh request number.
            state = case["state"]
            fresh = (
                f"Request {self.sent}. {state}" if isinstance(state, str) else {"request": self.sent, "state": state}
            )
            request = {"state": fresh, "questions": case["questions"]}
        else:
            request = (short6 if self.shape == "short6" else long5)(self.rng.randrange(10**9))
        if self.repeat:
            self.history.append(request)
        return request

    def next_turn(self) -> tuple[int, int]:
        """The conversation and turn to send next."""
        while len(self.turns) < self.CONVERSATIONS:  # a new conversation: drawn, as short6's and long5's states are
            self.turns[self.rng.randrange(10**12)] = 0
        conversation = self.rng.choice(sorted(self.turns))
        turn = self.turns[conversation]
        if turn >= self.GROW_TURNS:
            del self.turns[conversation]
            return self.next_turn()
        self.turns[conversation] = turn + 1
        return conversation, turn
