"""The System One contract on a CPU, no model: rendering, escaping, parsing, errors, confidence, answers, limits."""

from __future__ import annotations

import json
import random

import pytest

from kev_backend.protocol.answers import (
    answers_from_probabilities,
    answers_json,
    choice_confidence,
    response_body,
    round4,
    score_confidence,
)
from kev_backend.protocol.request import (
    MAX_ROW_TOKENS,
    MAX_STATE_TOKENS,
    Record,
    RequestError,
    parse_request,
    row_too_long_message,
    state_too_long_message,
)
from kev_backend.protocol.text import escape_user_text, render


def body(questions: dict, state: object = "doc", **extra: object) -> str:
    return json.dumps({"state": state, "questions": questions, **extra})


def refused(raw: str | bytes | dict) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(raw)
    return info.value


# --- render -----------------------------------------------------------------------------------------------------------


def test_render_worked_example():
    state = json.loads('{"a":true,"b":2,"c":2.5,"d":["x",{"e":null}],"f":{"g":"h"}}')
    assert render(state) == "a: True\nb: 2\nc: 2.5\nd:\n  - x\n  - e: \nf:\n  g: h"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"b": 1, "a": 2}', "b: 1\na: 2"),  # key order kept
        ('{"x": 1e-7, "y": 532.0, "z": 0.1}', "x: 1e-07\ny: 532.0\nz: 0.1"),
        ("12345678901234567890", "12345678901234567890"),
        ("[[1, 2], [3, [4]]]", "- - 1\n  - 2\n- - 3\n  - - 4"),
        ('[{"a": 1, "b": {"c": 2}}]', "- a: 1\n  b:\n    c: 2"),
        ('{"t": true, "f": false, "n": null}', "t: True\nf: False\nn: "),
        ('{"a": [], "b": {}}', "a:\n\nb:\n"),  # empty containers still take the nested form
        ('"  keep <|q|>\\n  é  "', "  keep <|q|>\n  é  "),  # strings verbatim, never escaped here
        ("null", ""),
        ("-0.0", "-0.0"),
    ],
)
def test_render_cases(text: str, expected: str):
    assert render(json.loads(text)) == expected


def test_render_indent_argument():
    assert render({"a": {"b": 1}}, indent=1) == "  a:\n    b: 1"


def kev_render(value: object, indent: int = 0) -> str:
    """Kev's rendering in its recursive form (every nested text built, then copied into its parent's): the oracle."""
    pad = "  " * indent
    if value is None:
        return ""
    if isinstance(value, (str, int, float, bool)):
        return str(value)
    if isinstance(value, list):
        return "\n".join(f"{pad}- {kev_render(item, indent + 1).lstrip()}" for item in value)
    lines = []
    for key, item in value.items():
        if isinstance(item, (dict, list)):
            lines.append(f"{pad}{key}:\n{kev_render(item, indent + 1)}")
        else:
            lines.append(f"{pad}{key}: {kev_render(item)}")
    return "\n".join(lines)


def random_json(rng: random.Random, depth: int) -> object:
    # Whitespace of every kind where a list item's text begins: leading whitespace is stripped across lines there.
    texts = ["", " ", "  x", "\n y", " \n ", "\u2028z", "\x1c", "a b", "é ", "<|q|>"]
    kind = rng.choice(["scalar", "scalar", "list", "dict"] if depth < 6 else ["scalar"])
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == "dict":
        return {rng.choice(texts) + str(i): random_json(rng, depth + 1) for i in range(rng.randrange(4))}
    return rng.choice([None, True, False, 0, -3, 2.5, 1e-07, *texts])


def test_render_is_kevs_rendering() -> None:
    rng = random.Random(11)
    for _ in range(3000):
        value, indent = random_json(rng, 0), rng.randrange(3)
        assert render(value, indent) == kev_render(value, indent), value


# --- escaping ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<|im_start|>x<|box_end|>", "<\u00a6im_start\u00a6>x<\u00a6box_end\u00a6>"),
        ("<|A_9|>", "<¦A_9¦>"),
        ("<<|a|>|>", "<<¦a¦>|>"),
        ("<|a b|>", "<|a b|>"),
        ("<|x", "<|x"),
        ("<||>", "<||>"),
        ("<|é|>", "<|é|>"),  # ASCII names only
        ("<think>", "<think>"),
        ("", ""),
    ],
)
def test_escape_user_text(text: str, expected: str):
    assert escape_user_text(text) == expected


# --- parsing and option texts -----------------------------------------------------------------------------------------


def test_noul_options():
    record = parse_request(
        body(
            {
                "bare": {"type": "noul"},
                "null": {"type": "noul", "criteria": None},
                "desc": {"type": "noul", "criteria": {"true": "it is", "false": "", "other": "x"}},
                "rich": {"type": "noul", "criteria": {"true": {"k": 1}, "false": 0}},
            }
        )
    )
    options = {q.id: q.options for q in record.questions}
    assert options == {
        "bare": ("no", "yes"),
        "null": ("no", "yes"),
        "desc": ("no", "yes: it is"),
        "rich": ("no: 0", "yes: k: 1"),
    }
    assert all(q.keys == ("false", "true") and q.legend is None for q in record.questions)


def test_choice_options_in_criteria_order():
    criteria = '{"z": null, "b": "", "c": "desc", "d": 0, "e": false, "f": [1, 2.0]}'
    record = parse_request(f'{{"state": "s", "questions": {{"q": {{"type": "choice", "criteria": {criteria}}}}}}}')
    (q,) = record.questions
    assert q.keys == ("z", "b", "c", "d", "e", "f")
    assert q.options == ("z", "b", "c: desc", "d: 0", "e: False", "f: - 1\n- 2.0")


def test_score_options_keys_and_legend():
    record = parse_request(body({"q": {"type": "score", "criteria": ["low", 2, None, {"k": "v"}, 1.0]}}))
    (q,) = record.questions
    assert q.options == ("low", "2", "", "k: v", "1.0")
    assert q.keys == ("0", "1", "2", "3", "4")
    assert q.legend == {"0": "low", "1": "2", "2": "", "3": "k: v", "4": "1.0"}


def test_record_fields_and_order():
    raw = body(
        {
            "zeta": {"type": "noul", "instructions": {"ask": "late?", "n": 3}},
            "alpha": {"type": "choice", "criteria": {"x": None}, "instructions": "pick"},
            "mid": {"type": "score", "criteria": ["a"]},
        },
        state={"doc": [1, {"x": None}]},
        model="kev-4b",
        extra_field={"ignored": True},
    )
    record = parse_request(raw)
    assert record == parse_request(raw.encode()) == parse_request(json.loads(raw))
    assert isinstance(record, Record)
    assert record.model == "kev-4b"
    assert record.state_text == "doc:\n  - 1\n  - x: "
    assert [q.id for q in record.questions] == ["zeta", "alpha", "mid"]
    assert [q.type for q in record.questions] == ["noul", "choice", "score"]
    assert [q.instruction for q in record.questions] == ["ask: late?\nn: 3", "pick", ""]


def test_defaults_null_state_and_unknown_fields():
    record = parse_request(
        {"state": None, "questions": {"q": {"type": "noul", "label": 1, "src": "s"}}, "temperature": 2}
    )
    assert record.model == "kev-latest"
    assert record.state_text == ""
    assert record.questions[0].instruction == ""


def test_option_limits_accepted_at_the_edges():
    for n in (1, 255):
        names = {f"o{i}": None for i in range(n)}
        assert len(parse_request(body({"q": {"type": "choice", "criteria": names}})).questions[0].options) == n
        levels = [f"l{i}" for i in range(n)]
        assert len(parse_request(body({"q": {"type": "score", "criteria": levels}})).questions[0].keys) == n


# --- validation errors ------------------------------------------------------------------------------------------------


def test_missing_state():
    error = refused(json.dumps({"questions": {"q": {"type": "noul"}}}))
    assert error.status == 422
    assert error.detail[0]["type"] == "missing"
    assert error.detail[0]["loc"] == ["body", "state"]
    assert error.message == "state: Field required"


def test_empty_questions():
    error = refused(body({}))
    assert [e["loc"] for e in error.detail] == [["body", "questions"]]
    assert error.detail[0]["type"] == "too_short"
    assert error.message.startswith("questions: Dictionary should have at least 1 item")


def test_bad_question_type_lists_every_union_member():
    error = refused(body({"q": {"type": "ranking", "criteria": ["a"]}}))
    assert "questions.q.Noul.type: Input should be 'noul'" in error.message
    assert "questions.q.function-after[_check(), Choice].type: Input should be 'choice'" in error.message
    assert "questions.q.Score.type: Input should be 'score'" in error.message
    assert all(e["loc"][:3] == ["body", "questions", "q"] for e in error.detail)


@pytest.mark.parametrize("n", [0, 256])
def test_choice_option_count(n: int):
    error = refused(body({"q": {"type": "choice", "criteria": {f"o{i}": None for i in range(n)}}}))
    (value_error,) = [e for e in error.detail if e["type"] == "value_error"]
    assert value_error["msg"] == "Value error, criteria must have 1..255 options"
    assert value_error["loc"] == ["body", "questions", "q", "function-after[_check(), Choice]"]
    assert "criteria must have 1..255 options" in error.message
    # FastAPI's jsonable_encoder turns the ValueError in ctx into {} (its vars()); the body must still serialise.
    (encoded,) = [e for e in error.json_detail if e["type"] == "value_error"]
    assert encoded["ctx"] == {"error": {}}
    assert json.loads(json.dumps(error.body))["detail"] == error.json_detail


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "List should have at least 1 item after validation, not 0"), (256, "List should have at most 255 items")],
)
def test_score_level_count(n: int, text: str):
    error = refused(body({"q": {"type": "score", "criteria": ["x"] * n}}))
    assert f"questions.q.Score.criteria: {text}" in error.message


def test_non_json_body():
    raw = b'{"state": '
    error = refused(raw)
    assert error.status == 422
    assert error.detail == [
        {
            "type": "json_invalid",
            "loc": ["body", len(raw)],
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": "Expecting value"},
        }
    ]
    assert error.message == "10: JSON decode error (Expecting value)"


@pytest.mark.parametrize("raw", ["[1, 2]", '"text"', "3"])
def test_non_object_body(raw: str):
    error = refused(raw)
    assert error.detail == [
        {
            "type": "model_attributes_type",
            "loc": ["body"],
            "msg": "Input should be a valid dictionary or object to extract fields from",
            "input": json.loads(raw),
        }
    ]
    assert error.message == "body: Input should be a valid dictionary or object to extract fields from"


@pytest.mark.parametrize("raw", [b"", "null"])
def test_empty_or_null_body_is_missing(raw: str | bytes):
    assert refused(raw).detail == [{"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}]


def test_undecodable_bytes_are_a_400():
    error = refused(b'{"state": "\xff", "questions": {}}')
    assert (error.status, error.detail, error.message) == (400, "There was an error parsing the body", error.detail)


def test_wrong_field_types():
    assert "model: Input should be a valid string" in refused(body({"q": {"type": "noul"}}, model=4)).message
    error = refused(body({"q": {"type": "noul", "criteria": ["yes"]}}))
    assert any(e["loc"][:5] == ["body", "questions", "q", "Noul", "criteria"] for e in error.detail)


def test_string_detail():
    error = RequestError(state_too_long_message(70_002))
    assert error.message == error.detail == str(error)
    assert error.body == {"detail": error.detail}


# --- confidence and rounding ------------------------------------------------------------------------------------------


def test_choice_confidence():
    # Bit for bit (max - 1/K) / (1 - 1/K): writing the denominator as 2/3 or (K-1)/K gives 0.82 instead.
    assert choice_confidence([0.88, 0.12, 0.0]) == (0.88 - 1 / 3) / (1 - 1 / 3) == 0.8199999999999998
    assert round4(choice_confidence([0.88, 0.12, 0.0])) == 0.82
    assert choice_confidence([1.0]) == 1.0
    assert choice_confidence([0.0]) == 1.0
    assert choice_confidence([0.25] * 4) == 0.0
    assert choice_confidence([0.6, 0.2, 0.0]) == pytest.approx(0.625)  # normalised to [0.75, 0.25, 0]
    assert choice_confidence([0.0, 0.0, 0.0]) == 0.0  # all zeros -> uniform


def test_score_confidence():
    assert score_confidence([0.2, 0.5, 0.3]) == pytest.approx(0.25)  # E|i-1| = 0.5, D = 2/3
    assert score_confidence([0.0, 1.0, 0.0]) == 1.0
    assert score_confidence([1.0]) == 1.0
    assert score_confidence([0.5, 0.0, 0.5]) == 0.0  # 1 - 1/(2/3) < 0, clamped
    assert score_confidence([0.5, 0.5]) == 0.0  # D = 0.5 for two levels
    assert score_confidence([0.6, 0.2, 0.0]) == pytest.approx(0.625)  # normalised to [0.75, 0.25, 0]
    assert score_confidence([0.0, 0.0, 0.0]) == 0.0
    assert score_confidence([0.3, 0.35, 0.35]) == pytest.approx(1 - 1.0 / (2 / 3) * 0.65)  # mode = first max (1)


@pytest.mark.parametrize(
    ("x", "expected"),
    [
        (0.03125, 0.0312),  # exact binary tie -> even
        (0.09375, 0.0938),  # exact binary tie -> even
        (0.00015, 0.0001),  # stored just below the tie
        (0.12345, 0.1235),  # stored just above the tie
        (0.123449, 0.1234),
        (1, 1.0),
    ],
)
def test_round4(x: float, expected: float):
    assert round4(x) == expected
    assert type(round4(x)) is float


# --- answers ----------------------------------------------------------------------------------------------------------


def three_questions() -> Record:
    return parse_request(
        body(
            {
                "late": {"type": "noul"},
                "team": {"type": "choice", "criteria": {"billing": "money", "shipping": None, "refund": ""}},
                "mood": {"type": "score", "criteria": ["calm", "upset", "furious"]},
            }
        )
    )


def test_answers_values_and_key_order():
    answers = answers_from_probabilities(three_questions(), [[0.312345, 0.687655], [0.88, 0.12, 0.0], [0.2, 0.5, 0.3]])
    assert list(answers) == ["late", "team", "mood"]
    assert answers["late"] == {"type": "noul", "noul": 0.6877}
    assert list(answers["late"]) == ["type", "noul"]
    assert answers["team"] == {
        "type": "choice",
        "choice": "billing",
        "confidence": 0.82,
        "probabilities": {"billing": 0.88, "shipping": 0.12, "refund": 0.0},
    }
    assert list(answers["team"]) == ["type", "choice", "confidence", "probabilities"]
    assert answers["mood"] == {
        "type": "score",
        "score": 1.1,
        "legend": {"0": "calm", "1": "upset", "2": "furious"},
        "probabilities": {"0": 0.2, "1": 0.5, "2": 0.3},
        "confidence": 0.25,
    }
    assert list(answers["mood"]) == ["type", "score", "legend", "probabilities", "confidence"]


def test_choice_ties_go_to_the_earliest_option():
    record = parse_request(body({"q": {"type": "choice", "criteria": {"a": None, "b": None, "c": None}}}))
    assert answers_from_probabilities(record, [[0.4, 0.4, 0.2]])["q"]["choice"] == "a"
    assert answers_from_probabilities(record, [[0.2, 0.4, 0.4]])["q"]["choice"] == "b"
    # Equal once rounded, not before: the argmax reads the unrounded probabilities.
    answer = answers_from_probabilities(record, [[0.49999, 0.50001, 0.0]])["q"]
    assert answer["probabilities"]["a"] == answer["probabilities"]["b"] == 0.5
    assert answer["choice"] == "b"


def test_score_value_uses_raw_probabilities():
    record = parse_request(body({"q": {"type": "score", "criteria": ["a", "b", "c"]}}))
    answer = answers_from_probabilities(record, [[0.6, 0.2, 0.0]])["q"]
    assert answer["score"] == 0.2  # sum i*p_i on p as given
    assert answer["confidence"] == 0.625  # on p normalised


def test_answers_check_shapes():
    record = three_questions()
    with pytest.raises(ValueError, match="2 probability rows for 3 questions"):
        answers_from_probabilities(record, [[0.5, 0.5], [1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="'team': 2 probabilities for 3 options"):
        answers_from_probabilities(record, [[0.5, 0.5], [1.0, 0.0], [1.0, 0.0, 0.0]])


# --- response and limits ----------------------------------------------------------------------------------------------


def test_response_body_order_and_rounding():
    answers = {"q": {"type": "noul", "noul": 0.5}}
    out = response_body("kev-4b", answers, input_tokens=120, output_tokens=14, latency_ms=12.3456)
    assert list(out) == ["model", "answers", "usage", "latency_ms"]
    assert out["usage"] == {"input_tokens": 120, "output_tokens": 14}
    assert list(out["usage"]) == ["input_tokens", "output_tokens"]
    assert out["latency_ms"] == 12.3
    assert out["answers"] is answers and out["model"] == "kev-4b"


def test_answers_json_default_separators_and_ascii():
    answers = {"é": {"type": "noul", "noul": 0.5}}
    assert answers_json(answers) == '{"\\u00e9": {"type": "noul", "noul": 0.5}}'


def test_limit_messages():
    assert (MAX_STATE_TOKENS, MAX_ROW_TOKENS) == (65_536, 73_728)
    assert state_too_long_message(70_002) == (
        "state is 70,002 tokens, over the 65,536-token limit (the <state> token included): shorten the document or "
        "split it across requests; or start the server with KEV_TRUNCATE_STATES=1 to read only its first 65,536 "
        "tokens (responses then say truncated: true)"
    )
    assert state_too_long_message(9_000, limit=8_192).startswith("state is 9,000 tokens, over the 8,192-token limit")
    assert (
        row_too_long_message(9_001, 65_000) == "branch too long: 9001 tokens with a 65000-token state (row limit 73728)"
    )
    assert row_too_long_message(12, 8_190, limit=8_192).endswith("(row limit 8192)")
