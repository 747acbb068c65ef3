"""A System One request as Kev 1.0 reads it: its limits, its shapes, Kev's 422s, its parsing and its state's routing
key. Rendering is protocol/text.py, the answers and the response body protocol/answers.py.

Pure Python (pydantic, no torch, no tokenizer): the engine tokenizes the texts of a `Record` and hands back one
probability row per question. Where Kev's HTTP layer (FastAPI) shapes an error, the same shape is produced here so
clients see the same 422 bodies.

Hostile input is refused by design, before any rendering or tokenizing: a body over `Limits.max_request_bytes`,
JSON nested deeper than `Limits.max_json_depth` (rendering recurses once per level, so the depth bound is what keeps
it within Python's recursion limit), text that is not valid Unicode (a lone surrogate from a `\ud800` escape cannot
be encoded as UTF-8, so it could be neither tokenized nor sent back), and more than `Limits.max_questions`
questions. Each is a RequestError for that request alone.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from .dates import TooManyDates, date_facts, with_facts
from .text import render

JSONContent = str | dict | list | int | float | bool | None
MAX_OPTIONS = 255
MAX_STATE_TOKENS = 65_536  # Ls, the <state> token included
MAX_ROW_TOKENS = 73_728  # Ls + len(branch) for each question row (65,536 + 8,192)
# A body's bytes: Kev's 65,536-token state at 64 bytes a token (ordinary text is 3-5 bytes a token, JSON-escaped
# non-Latin text up to ~12), so no request Kev would answer is refused for its size alone.
MAX_REQUEST_BYTES = 4 << 20
MAX_JSON_DEPTH = 64  # nesting of lists and objects, the body itself counted as 1
MAX_JSON_DEPTH_CEILING = 200  # rendering recurses ~3 frames a level; Python's recursion limit is 1,000
MAX_QUESTIONS = 256
# A request's model work: its state once and every question's branch, in tokens. Twice Kev's state limit: a full
# state with its longest single row (73,728) fits, and so do 64 orders of a 255-option question; 256 questions of
# 255 options each (~200,000 tokens, a minute of CPU on the toy model) do not. Kev has no such limit.
MAX_REQUEST_TOKENS = 131_072
DEFAULT_MODEL = "kev-latest"


@dataclass(frozen=True)
class Limits:
    """What one request may hold; everything is checked before the text is rendered or tokenized."""

    max_request_bytes: int = MAX_REQUEST_BYTES
    max_json_depth: int = MAX_JSON_DEPTH
    max_questions: int = MAX_QUESTIONS
    max_state_tokens: int = MAX_STATE_TOKENS  # Ls, <state> included
    max_row_tokens: int = MAX_ROW_TOKENS  # Ls + branch
    max_request_tokens: int = MAX_REQUEST_TOKENS  # Ls + every branch: the request's model work
    # A state over max_state_tokens: refused with Kev's 422 (off), or cut to its first max_state_tokens tokens (on),
    # and then every response says whether it was (response_body's marks). The row limit holds after the cut.
    truncate_states: bool = False

    def __post_init__(self) -> None:
        if not 2 <= self.max_json_depth <= MAX_JSON_DEPTH_CEILING:
            raise ValueError(f"max_json_depth must be 2..{MAX_JSON_DEPTH_CEILING}, not {self.max_json_depth}")
        for name in ("max_request_bytes", "max_questions", "max_state_tokens", "max_row_tokens", "max_request_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")


DEFAULT_LIMITS = Limits()


# --- request models (Kev 1.0 shapes; unknown fields are ignored, pydantic's default) -----------------------------


class Noul(BaseModel):
    type: Literal["noul"]
    instructions: JSONContent = None
    criteria: dict[str, JSONContent] | None = None  # only "true" / "false" are read


class Choice(BaseModel):
    type: Literal["choice"]
    instructions: JSONContent = None
    criteria: dict[str, JSONContent]

    # The name matters: pydantic tags union errors "function-after[_check(), Choice]", as Kev's 422 bodies do.
    @model_validator(mode="after")
    def _check(self) -> Choice:
        if not 1 <= len(self.criteria) <= MAX_OPTIONS:
            raise ValueError(f"criteria must have 1..{MAX_OPTIONS} options")
        return self


class Score(BaseModel):
    type: Literal["score"]
    instructions: JSONContent = None
    criteria: list[JSONContent] = Field(min_length=1, max_length=MAX_OPTIONS)


QuestionModel = Noul | Choice | Score  # plain (smart) union, like Kev: errors list every member


class SystemOneRequest(BaseModel):
    state: JSONContent
    model: str = DEFAULT_MODEL
    questions: dict[str, QuestionModel] = Field(min_length=1)


# --- errors --------------------------------------------------------------------------------------------------------


class RequestError(ValueError):
    """A request Kev refuses. `detail` is what FastAPI puts under "detail": a string (context overflow) or the
    list of pydantic errors with "body" first in each loc. `status` is 422, or 400 for a body FastAPI cannot read."""

    def __init__(self, detail: str | list[dict[str, Any]], status: int = 422) -> None:
        self.detail = detail
        self.status = status
        super().__init__(self.message)

    @property
    def message(self) -> str:
        if isinstance(self.detail, str):
            return self.detail
        return "; ".join(_error_line(e) for e in self.detail)

    @property
    def json_detail(self) -> str | list[dict[str, Any]]:
        """`detail` as FastAPI's jsonable_encoder writes it: an exception in ctx becomes {} (its vars())."""
        return _jsonable(self.detail)

    @property
    def body(self) -> dict[str, Any]:
        return {"detail": self.json_detail}


def body_too_large(size: int, limit: int) -> RequestError:
    return RequestError(f"request body is {size:,} bytes, over the {limit:,}-byte limit", status=413)


def _error_line(error: dict[str, Any]) -> str:
    path = ".".join(str(part) for part in error["loc"][1:]) or "body"
    line = f"{path}: {error['msg']}"
    if error["type"] == "json_invalid":
        line += f" ({error['ctx']['error']})"
    return line


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, BaseException):
        return {}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _body_error(error: dict[str, Any]) -> dict[str, Any]:
    """A pydantic error as FastAPI reports a body error: loc prefixed with "body", no url."""
    out = {"type": error["type"], "loc": ["body", *error["loc"]], "msg": error["msg"], "input": error["input"]}
    if "ctx" in error:
        out["ctx"] = error["ctx"]
    return out


# --- parsing ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Question:
    id: str  # reported back, never shown to the model
    type: str
    instruction: str
    options: tuple[str, ...]  # option texts, in option order (unescaped)
    keys: tuple[str, ...]  # the keys probabilities are reported under, same order
    legend: dict[str, str] | None  # score only: {"i": level text}


@dataclass(frozen=True)
class Record:
    model: str
    state_text: str  # the rendered state the model reads (with its date facts where the server adds them)
    questions: tuple[Question, ...]
    sent_text: str | None = None  # the state as sent, rendered, where the model reads another text (date facts)

    @property
    def state_key(self) -> str:
        """The routing key of the state as sent: the one clients and the gateway compute (state_key)."""
        return state_key(self.state_text if self.sent_text is None else self.sent_text)


def _load_json(body: str | bytes, limits: Limits) -> Any:
    """json.loads as Starlette runs it (bytes: encoding detected), with FastAPI's error shapes."""
    if not body:
        return None  # FastAPI reads an empty body as a missing one
    size = len(body) if isinstance(body, bytes) else len(body.encode("utf-8", "surrogatepass"))
    if size > limits.max_request_bytes:
        raise body_too_large(size, limits.max_request_bytes)
    try:
        return json.loads(body)
    except json.JSONDecodeError as e:
        error = {"type": "json_invalid", "loc": ["body", e.pos], "msg": "JSON decode error", "input": {}}
        raise RequestError([{**error, "ctx": {"error": e.msg}}]) from None
    except RecursionError:  # the C parser's own depth guard, far past max_json_depth
        raise too_deep(limits.max_json_depth) from None
    except ValueError:  # undecodable bytes, an int over Python's digit limit: FastAPI answers 400
        raise RequestError("There was an error parsing the body", status=400) from None


def load_body(body: str | bytes, limits: Limits = DEFAULT_LIMITS) -> Any:
    """A body's JSON as FastAPI reads it (bytes: json.loads' own encoding detection, a UTF-8 BOM skipped), with its
    refusals in FastAPI's shapes; None for an empty body. For an envelope around a System One request."""
    return _load_json(body, limits)


def too_deep(limit: int) -> RequestError:
    return RequestError(f"request JSON is nested more than {limit} levels deep")


# Where a value sits in a request's JSON: its key or index and its container's place, out to the body (None).
Place = tuple[Any, "Place"] | None


def check_json(data: Any, limits: Limits) -> None:
    """Walks parsed JSON without recursion: refuses nesting deeper than the limit and any string (key or value)
    that is not valid Unicode, naming where it is. A value's place links to its container's, the path spelled out
    only for an error: a wide body nested deep costs what its size does, not its size times its depth."""
    stack: list[tuple[Any, int, Place]] = [(data, 1, None)]
    while stack:
        value, depth, place = stack.pop()
        if isinstance(value, dict):
            if depth > limits.max_json_depth:
                raise too_deep(limits.max_json_depth)
            for key, item in value.items():
                _check_text(key, (key, place))
                if _to_walk(item):
                    stack.append((item, depth + 1, (key, place)))
        elif isinstance(value, list):
            if depth > limits.max_json_depth:
                raise too_deep(limits.max_json_depth)
            stack.extend((item, depth + 1, (i, place)) for i, item in enumerate(value) if _to_walk(item))
        elif isinstance(value, str):
            _check_text(value, place)


def _to_walk(item: Any) -> bool:
    """Whether check_json has anything to check in `item`: a container, or a string that is not plain ASCII."""
    return isinstance(item, (dict, list)) or (isinstance(item, str) and not item.isascii())


def _check_text(text: Any, place: Place) -> None:
    if not isinstance(text, str) or text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        path: list[Any] = []
        while place is not None:
            key, place = place
            path.append(printable(key) if isinstance(key, str) else key)
        bad = f"U+{ord(text[e.start]):04X}"
        raise RequestError(
            [
                {
                    "type": "string_unicode",
                    "loc": ["body", *reversed(path)],
                    "msg": f"Input should be valid Unicode text: it holds a lone surrogate ({bad})",
                    "input": printable(text[:64]),
                }
            ]
        ) from None


def printable(text: str) -> str:
    """The text with anything UTF-8 cannot hold escaped (\\udXXX), so an error message about it can be sent."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def parse_request(
    body: str | bytes | dict[str, Any], limits: Limits = DEFAULT_LIMITS, date_facts: bool = False
) -> Record:
    """Validate a /v1/systemone body and build the record the engine encodes. Pass the raw bytes for FastAPI parity
    (a str with a BOM is refused by json.loads; bytes are decoded as utf-8-sig). `date_facts`: the state the record
    holds is the one with its date facts (`with_date_facts`), as a server with KEV_DATE_FACTS prepares it."""
    data = body if isinstance(body, dict) else _load_json(body, limits)
    if data is None:
        raise RequestError([{"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}])
    check_json(data, limits)
    questions = data.get("questions") if isinstance(data, dict) else None
    if isinstance(questions, dict) and len(questions) > limits.max_questions:
        raise RequestError(f"request has {len(questions):,} questions, over the limit of {limits.max_questions:,}")
    try:
        request = SystemOneRequest.model_validate(data, from_attributes=True)  # as FastAPI validates a body
    except ValidationError as e:
        raise RequestError([_body_error(err) for err in e.errors(include_url=False)]) from None
    # Render from the raw JSON: the texts must not depend on any coercion the models might do.
    questions = tuple(_question(qid, raw) for qid, raw in data["questions"].items())
    text = render(data["state"])
    if date_facts:
        state = with_date_facts(data["state"], limits, text)
        if state is not data["state"]:
            return Record(model=request.model, state_text=render(state), questions=questions, sent_text=text)
    return Record(model=request.model, state_text=text, questions=questions)


def with_date_facts(state: JSONContent, limits: Limits = DEFAULT_LIMITS, text: str | None = None) -> JSONContent:
    """Kev's date preprocessing (protocol/dates.py): the state with the day counts between its dates added. The facts
    may be as long as a whole request (max_request_bytes characters), so building and tokenizing them costs no more
    than the largest request's own text; a state with more dates than that (k dates make k(k-1)/2 sentences) is
    refused, as no token limit could hold its facts. `text`: the state already rendered."""
    try:
        return with_facts(state, date_facts(render(state) if text is None else text, limits.max_request_bytes))
    except TooManyDates as error:
        raise RequestError(
            f"state has at least {error.dates:,} distinct dates: their date facts (KEV_DATE_FACTS) would be over "
            f"{error.max_chars:,} characters"
        ) from None


# Routing by state: a request goes to the replica whose bank may hold its state (docs/operations.md, Past one GPU).
STATE_KEY_HEADER = "x-kev-state-key"


STATE_KEY_CHARS = 1024  # the state's beginning that its routing key hashes


def state_key(state_text: str) -> str:
    """The routing key of a state: a hash of the beginning of the text Kev renders it to (its first STATE_KEY_CHARS
    characters, all of it when shorter), the text a replica's bank is keyed by. The same state with other whitespace,
    other questions or other options gets the same key; key order and scalar spellings are part of that text (the
    model reads them), so they make another state, as they do in the bank.

    Only the beginning, so that a conversation whose state grows at its end (text appended, a JSON list or object
    growing at its end) keeps its key once past it, and each turn reaches the replica that banked the turn before and
    computes only its new tokens there (growing states: kev_backend/scoring/growth.py). States that share their first
    STATE_KEY_CHARS characters share a key; the router's bounded load (kev_backend/serve/router.py) spreads a key
    that is too busy for one replica.

    The text hashed is the caller's state as rendered, before a server prepares it (date facts added, a long state
    cut): what a server banks is a function of that state alone, so equal states still get one key and meet on one
    replica, and every door (the gateway, KevClient, a router's client) computes the same key without knowing the
    servers' settings."""
    return hashlib.blake2b(state_text[:STATE_KEY_CHARS].encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def state_key_of(body: str | bytes | dict[str, Any]) -> str | None:
    """A request body's routing key, or None when it has no state to key (the server will refuse it anyway)."""
    try:
        data = body if isinstance(body, dict) else json.loads(body)
        return state_key(render(data["state"]))
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None


def _question(qid: str, raw: dict[str, Any]) -> Question:
    kind, criteria, legend = raw["type"], raw.get("criteria"), None
    if kind == "noul":
        criteria = criteria or {}
        keys = ("false", "true")
        options = (_option_text("no", criteria.get("false")), _option_text("yes", criteria.get("true")))
    elif kind == "choice":
        keys = tuple(criteria)
        options = tuple(_option_text(name, desc) for name, desc in criteria.items())
    else:
        keys = tuple(str(i) for i in range(len(criteria)))
        options = tuple(render(level) for level in criteria)
        legend = dict(zip(keys, options))
    return Question(qid, kind, render(raw.get("instructions")), options, keys, legend)


def _option_text(name: str, description: Any) -> str:
    return name if description is None or description == "" else f"{name}: {render(description)}"


# --- Kev's messages for requests over a token limit ------------------------------------------------------------------


def state_too_long_message(n_tokens: int, limit: int = MAX_STATE_TOKENS, counted_chars: int | None = None) -> str:
    """Kev 1.0's 422 text for a state over the limit (its admission check plus the truncation hint). A state
    refused before it was tokenized whole says how far it was counted."""
    size = f"{n_tokens:,} tokens"
    if counted_chars is not None:
        size = f"at least {n_tokens:,} tokens (counted in its first {counted_chars:,} characters)"
    return (
        f"state is {size}, over the {limit:,}-token limit (the <state> token included): "
        "shorten the document or split it across requests; "
        f"or start the server with KEV_TRUNCATE_STATES=1 to read only its first {limit:,} tokens "
        "(responses then say truncated: true)"
    )


def request_too_costly_message(tokens: int, limit: int = MAX_REQUEST_TOKENS, at_least: bool = False) -> str:
    """The 422 text for a request whose model work (its state once and every question's branch) is over the limit;
    `at_least` when it was refused before every question was tokenized."""
    size = f"at least {tokens:,}" if at_least else f"{tokens:,}"
    return (
        f"request is {size} tokens of model work (its state once and every question's branch), over the "
        f"{limit:,}-token limit: split its questions across requests"
    )


def row_too_long_message(
    branch_tokens: int, state_tokens: int, limit: int = MAX_ROW_TOKENS, at_least: bool = False
) -> str:
    """Kev's 422 text for a question row (state + branch) over the row limit; `at_least` when the branch was
    refused before it was tokenized whole."""
    size = f"at least {branch_tokens}" if at_least else str(branch_tokens)
    return f"branch too long: {size} tokens with a {state_tokens}-token state (row limit {limit})"
