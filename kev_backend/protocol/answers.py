"""Kev's answers: each question's from its option probabilities (noul, choice, score; confidence and rounding as
Kev 1.0 gives them), and the response body with its usage. Pure Python."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .request import Question, Record


def round4(x: float) -> float:
    """Python round(x, 4): the exact binary value is rounded, exact ties go to even."""
    return round(float(x), 4)


def _first_argmax(p: Sequence[float]) -> int:
    return max(range(len(p)), key=p.__getitem__)


def _normalised(p: Sequence[float]) -> list[float]:
    total = sum(p)
    return [1 / len(p)] * len(p) if total == 0 else [x / total for x in p]


def choice_confidence(p: Sequence[float]) -> float:
    """(max p̂ − 1/K) / (1 − 1/K) on p normalised to sum 1; one option is certain."""
    k = len(p)
    if k == 1:
        return 1.0
    return (max(_normalised([float(x) for x in p])) - 1 / k) / (1 - 1 / k)


def score_confidence(p: Sequence[float]) -> float:
    """max(0, 1 − E|i − mode| / D) on normalised p; D = the mean |i − (L−1)/2| of a uniform spread; one level is
    certain."""
    n = len(p)
    if n == 1:
        return 1.0
    q = _normalised([float(x) for x in p])
    mode = _first_argmax(q)
    spread = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return max(0.0, 1.0 - sum(pi * abs(i - mode) for i, pi in enumerate(q)) / spread)


def answers_from_probabilities(record: Record, probs: Sequence[Sequence[float]]) -> dict[str, dict[str, Any]]:
    """One probability row per question (request order, option order) -> the response's answers."""
    if len(probs) != len(record.questions):
        raise ValueError(f"{len(probs)} probability rows for {len(record.questions)} questions")
    return {q.id: _answer(q, [float(x) for x in p]) for q, p in zip(record.questions, probs)}


def _answer(question: Question, p: list[float]) -> dict[str, Any]:
    if len(p) != len(question.keys):
        raise ValueError(f"question {question.id!r}: {len(p)} probabilities for {len(question.keys)} options")
    if question.type == "noul":
        return {"type": "noul", "noul": round4(p[1])}
    probabilities = {key: round4(x) for key, x in zip(question.keys, p)}
    if question.type == "choice":
        return {
            "type": "choice",
            "choice": question.keys[_first_argmax(p)],  # unrounded p: ties go to the earliest option
            "confidence": round4(choice_confidence(p)),
            "probabilities": probabilities,
        }
    return {
        "type": "score",
        "score": round4(sum(i * x for i, x in enumerate(p))),
        "legend": dict(question.legend or {}),
        "probabilities": probabilities,
        "confidence": round4(score_confidence(p)),
    }


# --- the response ----------------------------------------------------------------------------------------------------


def answers_json(answers: dict[str, Any]) -> str:
    """The text whose token count (plain tokenizer, no special tokens) is usage.output_tokens."""
    return json.dumps(answers)


def response_body(
    model: str,
    answers: dict[str, Any],
    input_tokens: int,
    output_tokens: int,
    latency_ms: float,
    state_tokens: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Kev's body. `state_tokens` (the request's whole state, what the model read; both with <state>) is given by a
    server that may truncate states: it says on every response whether it did, as Kev's does, in usage's
    `state_tokens` / `state_tokens_used` and a final `truncated` (TypeSafe SDKs ignore fields they do not model)."""
    body = {
        "model": model,
        "answers": answers,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
        "latency_ms": round(latency_ms, 1),
    }
    if state_tokens is not None:
        whole, used = state_tokens
        body["usage"].update(state_tokens=whole, state_tokens_used=used)
        body["truncated"] = whole > used
    return body
