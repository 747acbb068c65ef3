"""Kev's date preprocessing (`date_facts`, KEV_DATE_FACTS) on a CPU, no model: golden facts and prepared states as
Kev's `with_date_facts` makes them, the record a server with the option reads, its bound, and its settings."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from kev_backend.engine.engine import EngineOptions
from kev_backend.protocol.dates import date_facts, dates_in, most_dates, parse_date, with_facts
from kev_backend.protocol.request import Limits, RequestError, parse_request, state_key, state_key_of, with_date_facts
from kev_backend.serve.stub.triton_config import engine_options
from kev_backend.settings import ModelSettings, SettingError

NO_LIMIT = 1 << 30

GOLDEN = [
    ("no dates here", ""),
    ("only July 22, 2026 is named", ""),
    (
        "signed July 22, 2026, due August 3, 2026",
        "August 3, 2026 is 12 days after July 22, 2026.",
    ),
    ("from 2026-01-05 back to 2026-01-01", "2026-01-01 is 4 days before 2026-01-05."),
    ("2026-01-01 then 2026-01-02", "2026-01-02 is 1 day after 2026-01-01."),
    ("2026-01-02 then 2026-01-01", "2026-01-01 is 1 day before 2026-01-02."),
    ("2026-03-01 then March 1, 2026", "March 1, 2026 is the same day as 2026-03-01."),
    ("bad 2026-13-45, good 2026-02-01 and 2026-02-03", "2026-02-03 is 2 days after 2026-02-01."),
    ("2026-02-30 and 2025-02-29 are no days, 2024-02-29 is", ""),
    ("May 1, 2026; May 1, 2026; 2026-05-03", "2026-05-03 is 2 days after May 1, 2026."),
    (
        "a 2026-01-01, b 2026-01-11, c December 31, 2025",
        "2026-01-11 is 10 days after 2026-01-01. December 31, 2025 is 1 day before 2026-01-01. "
        "December 31, 2025 is 11 days before 2026-01-11.",
    ),
    ("leap: 2024-02-28 to 2024-03-01", "2024-03-01 is 2 days after 2024-02-28."),
    ("years: 2000-01-01 to 2001-01-01", "2001-01-01 is 366 days after 2000-01-01."),
    ("May 7, 2026 and May 07, 2026 are two forms", "May 07, 2026 is the same day as May 7, 2026."),
    # Word boundaries, month names written in full and capitalised, two-digit days at most.
    ("x2026-01-01 and 2026-01-011 and 12026-01-01", ""),
    ("Jul 22, 2026 and july 23, 2026 and July 123, 2026", ""),
    ("Mayday 1, 2026 and 2026-01-01", ""),
]


@pytest.mark.parametrize(("text", "facts"), GOLDEN)
def test_golden_facts(text: str, facts: str) -> None:
    assert date_facts(text, NO_LIMIT) == facts


def test_dates_parse_as_strptime_reads_them() -> None:
    for written in ("2026-08-03", "August 3, 2026", "August 03, 2026", "0001-01-01", "9999-12-31"):
        fmt = "%B %d, %Y" if "," in written else "%Y-%m-%d"
        assert parse_date(written) == datetime.strptime(written, fmt)
    for written in (
        "2026-13-45",
        "2026-00-10",
        "2026-01-00",
        "2026-04-31",
        "0000-01-01",
        "May 0, 2026",
        "May 32, 2026",
    ):
        assert parse_date(written) is None
    # Other Unicode digits match \d: strptime takes them in the year, not in the month.
    assert parse_date("\u0662\u0660\u0662\u0666-01-05") == datetime(2026, 1, 5)
    assert parse_date("2026-0\u0661-05") is None
    assert dates_in("2026-01-01 2026-01-01 2026-13-01 2026-01-02") == [
        ("2026-01-01", datetime(2026, 1, 1)),
        ("2026-01-02", datetime(2026, 1, 2)),
    ]


FACTS = "2026-01-02 is 1 day after 2026-01-01."


@pytest.mark.parametrize(
    ("state", "prepared"),
    [
        ({"a": "2026-01-01", "b": "2026-01-02"}, {"a": "2026-01-01", "b": "2026-01-02", "date_facts": FACTS}),
        # An existing date_facts key keeps its place and is replaced (Python's {**state, "date_facts": ...}).
        (
            {"date_facts": "mine", "a": "2026-01-01", "b": "2026-01-02"},
            {"date_facts": FACTS, "a": "2026-01-01", "b": "2026-01-02"},
        ),
        (["2026-01-01", {"b": "2026-01-02"}], ["2026-01-01", {"b": "2026-01-02"}, {"date_facts": FACTS}]),
        ("from 2026-01-01 to 2026-01-02", f"from 2026-01-01 to 2026-01-02\n\ndate_facts: {FACTS}"),
        # Dates are found in the rendered state, keys and nested values included.
        ({"2026-01-01": {"x": ["2026-01-02"]}}, {"2026-01-01": {"x": ["2026-01-02"]}, "date_facts": FACTS}),
    ],
)
def test_with_date_facts_as_kev_prepares_states(state, prepared) -> None:
    out = with_date_facts(state)
    assert out == prepared
    if isinstance(state, dict):
        assert list(out) == list(prepared)


@pytest.mark.parametrize("state", ["no dates", "one date 2026-01-01", {"a": "2026-01-01"}, ["x"], 20260101, None])
def test_fewer_than_two_dates_leave_the_state_unchanged(state) -> None:
    assert with_date_facts(state) is state
    assert with_facts(state, "") is state


def test_the_record_reads_the_prepared_state_but_the_key_is_the_callers() -> None:
    body = {"state": {"signed": "July 22, 2026", "due": "August 3, 2026"}, "questions": {"q": {"type": "noul"}}}
    plain = parse_request(body)
    prepared = parse_request(body, date_facts=True)
    assert plain.state_text == "signed: July 22, 2026\ndue: August 3, 2026"
    assert prepared.state_text == plain.state_text + "\ndate_facts: August 3, 2026 is 12 days after July 22, 2026."
    assert prepared.questions == plain.questions
    # The routing key hashes the caller's state whatever a server adds to it: every door computes the same key.
    assert state_key_of(json.dumps(body)) == state_key(plain.state_text) != state_key(prepared.state_text)
    no_dates = {"state": "nothing dated", "questions": {"q": {"type": "noul"}}}
    assert parse_request(no_dates, date_facts=True) == parse_request(no_dates)


def test_facts_are_bounded_by_the_request_limit() -> None:
    """k dates make k(k-1)/2 sentences: past max_request_bytes characters of facts the request is refused, before
    they are built and having parsed no more dates than could fit."""
    text = " ".join(f"2026-01-{day:02d}" for day in range(1, 11))
    body = {"state": text, "questions": {"q": {"type": "noul"}}}
    facts = date_facts(text, NO_LIMIT)
    assert facts.count(".") == 45
    fits = parse_request(body, Limits(max_request_bytes=len(facts)), date_facts=True)
    assert fits.state_text == f"{text}\n\ndate_facts: {facts}"
    with pytest.raises(RequestError, match=f"state has at least 10 distinct dates: .* over {len(facts) - 1:,} char"):
        parse_request(body, Limits(max_request_bytes=len(facts) - 1), date_facts=True)
    many = " ".join(f"{year:04d}-01-01" for year in range(1, 5001))
    assert most_dates(4_000) == 15 and len(dates_in(many, 15)) == 16
    with pytest.raises(RequestError, match="state has at least 16 distinct dates"):
        parse_request({"state": many, "questions": {"q": {"type": "noul"}}}, Limits(max_request_bytes=4_000), True)


def test_the_setting_is_a_switch_for_the_engine() -> None:
    def read(params: dict[str, str], **env: str) -> ModelSettings:
        return ModelSettings.read({"checkpoint": "kev", **params}, Path("/models/kev"), env)

    assert "date_facts" not in read({}).engine and read({"date_facts": ""}).engine == {}
    assert read({"date_facts": "on"}).engine["date_facts"] is True
    assert read({"date_facts": "on"}, KEV_DATE_FACTS="0").engine["date_facts"] is False
    assert read({}, KEV_DATE_FACTS="yes").engine["date_facts"] is True
    assert engine_options(read({}, KEV_DATE_FACTS="1"), "auto") == EngineOptions(date_facts=True)
    with pytest.raises(SettingError, match="KEV_DATE_FACTS='maybe'"):
        read({}, KEV_DATE_FACTS="maybe")
