"""What travels around a System One body between our own doors and the model, over Triton: the request parameters
the model reads beside `REQUEST`, and how the model marks the errors it gives a request about that request.

Request parameters (a Triton request's `parameters`; Triton also forwards the x-kev-state-key header as one):
- STATE_KEY (`x-kev-state-key`): the state's routing key (protocol/request.py, `state_key`); `check_state_key`
  says what a key may be, the same at every door.
- USAGE_BY_QUESTION (bool): the response's `usage` gains `questions`, each question's own usage as Kev reports it
  for a request holding that question alone (the state's tokens and its branch's; the tokens of its answer alone).
  The gateway's /separate and /permute send one request for all their parts and report Kev's per-part sums from it.
- TAGGED_ERRORS (bool): every error the model gives the request about the request itself (a refusal, a fault while
  preparing or answering it) has a message of the form `ERROR_TAG{"status": S, "detail": D}`: S the HTTP status
  Kev's server would answer (422, 413, 400 for a refusal; 500 for a fault), D what Kev's body holds under "detail"
  (its message, or FastAPI's list of validation errors). An error without the
  tag did not come from the model's judgement of that request: Triton refused it (its queue, a batch-mate's
  malformed tensor, shared memory), the stub is gone, or its batch failed; a door must not blame the request for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .request import STATE_KEY_HEADER

STATE_KEY = STATE_KEY_HEADER
USAGE_BY_QUESTION = "kev_usage_by_question"
TAGGED_ERRORS = "kev_tagged_errors"
ERROR_TAG = "kev-error: "
STATE_KEY_MAX = 128


class BadParameter(ValueError):
    """A request parameter the model cannot take: the request is refused with this message."""


def check_state_key(value: Any) -> str | None:
    """The routing key a request carries, None without one. Surrounding whitespace is no part of a header's value, and
    an empty key is no key (Triton's HTTP door forwards an empty header as " ", its gRPC door as ""), so every door
    treats them alike; otherwise 1 to STATE_KEY_MAX visible ASCII characters, else BadParameter."""
    if isinstance(value, str):
        value = value.strip(" \t")
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > STATE_KEY_MAX or not all("!" <= c <= "~" for c in value):
        raise BadParameter(f"the {STATE_KEY} header must be 1 to {STATE_KEY_MAX} visible ASCII characters")
    return value


def flag(value: Any) -> bool:
    """A boolean request parameter: true, or a string Triton's HTTP door forwards ("true", "1")."""
    return value is True or (isinstance(value, str) and value.strip().lower() in ("1", "true"))


UNREADABLE = "the request's parameters (or a header forwarded as one) are not valid UTF-8 JSON"


def read_parameters(raw: Callable[[], str | bytes | None]) -> dict[str, Any]:
    """A request's parameters as the Python backend hands them over (`raw()`, a JSON object), BadParameter when they
    are not readable: a header that is not UTF-8 fails the stub's own conversion to text."""
    try:
        text = raw()
        parameters = json.loads(text) if text else {}
    except ValueError:  # UnicodeDecodeError included
        raise BadParameter(UNREADABLE) from None
    if not isinstance(parameters, dict):
        raise BadParameter("the request's parameters are not a JSON object")
    return parameters


def tag_error(status: int, detail: str | list[dict[str, Any]]) -> str:
    """The message of an error the model gives a request about the request itself (TAGGED_ERRORS)."""
    return ERROR_TAG + json.dumps({"status": status, "detail": detail}, ensure_ascii=False)


def read_tagged(message: str) -> tuple[int, str | list[Any]] | None:
    """(status, detail) of a tagged error message; None for any other message (not the model's about this request)."""
    if not message.startswith(ERROR_TAG):
        return None
    try:
        body = json.loads(message[len(ERROR_TAG) :])
        status, detail = body["status"], body["detail"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(status, int) or not isinstance(detail, (str, list)):
        return None
    return status, detail
