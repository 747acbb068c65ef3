"""Kev's optional date preprocessing (the model parameter `date_facts`, KEV_DATE_FACTS): the day count between every
two absolute dates a state mentions, written out as sentences ("August 3, 2026 is 12 days after July 22, 2026.")
that the model reads with the state. The model cannot subtract dates reliably; it can read a stated count.

A date is written "Month D, YYYY" (full English month name) or "YYYY-MM-DD", and read as Kev reads it: strptime with
"%B %d, %Y" when it holds a comma, else "%Y-%m-%d"; a form that is not a calendar date (2026-13-45) is skipped. Each
written form counts once, in order of first appearance, and every pair of them makes one sentence.

k dates make k(k-1)/2 sentences, so the facts are built only up to a character budget (`TooManyDates` past it).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime
from typing import Any

MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
DATE = re.compile(rf"\b(?:{'|'.join(MONTHS)}) \d{{1,2}}, \d{{4}}\b|\b\d{{4}}-\d{{2}}-\d{{2}}\b")
MONTH_NUMBER = {name: i for i, name in enumerate(MONTHS, 1)}
# The shortest sentence: two ISO dates, "1 day" and "after" ("2026-01-02 is 1 day after 2026-01-01."), 37 characters,
# plus the space that joins it to the next.
MIN_SENTENCE_CHARS = 38


class TooManyDates(ValueError):
    """A state's date facts would pass their character budget: it holds at least `dates` distinct dates."""

    def __init__(self, dates: int, max_chars: int) -> None:
        super().__init__(f"{dates:,} dates make date facts over {max_chars:,} characters")
        self.dates = dates
        self.max_chars = max_chars


def parse_date(written: str) -> datetime | None:
    """A written date as strptime reads it ("%B %d, %Y" with a comma, else "%Y-%m-%d"), None when it is no calendar
    date. A match of DATE in ASCII digits has fixed fields, and for those datetime's own checks refuse exactly what
    strptime refuses (month 00 or 13, day 00 or 32, February 30, year 0000) at a fraction of its cost, as a state may
    hold many thousands of distinct forms. Other Unicode digits, which DATE's \\d also matches, go to strptime."""
    if not written.isascii():
        try:
            return datetime.strptime(written, "%B %d, %Y" if "," in written else "%Y-%m-%d")
        except ValueError:
            return None
    if "," in written:
        month_day, year = written.split(", ")
        month, day = month_day.split(" ")
        fields = (int(year), MONTH_NUMBER[month], int(day))
    else:
        fields = (int(written[:4]), int(written[5:7]), int(written[8:]))
    if not (1 <= fields[1] <= 12 and 1 <= fields[2] <= 31):  # the usual refusals, without raising
        return None
    try:
        return datetime(*fields)
    except ValueError:
        return None


def dates_in(text: str, limit: int | None = None) -> list[tuple[str, datetime]]:
    """The distinct written dates of `text` that are calendar dates, in order of first appearance; with a limit, the
    scan stops at the first `limit` + 1 of them."""
    found: dict[str, datetime] = {}
    seen: set[str] = set()  # every form parsed, calendar date or not, so each is parsed once
    for match in DATE.finditer(text):
        written = match.group(0)
        if written in seen:
            continue
        seen.add(written)
        if (day := parse_date(written)) is not None:
            found[written] = day
            if limit is not None and len(found) > limit:
                break
    return list(found.items())


def day_fact(later: str, later_day: datetime, earlier: str, earlier_day: datetime) -> str:
    """One sentence about two dates: `later` is the one that appears later in the state, not the later day."""
    n = (later_day - earlier_day).days
    if n == 0:
        return f"{later} is the same day as {earlier}."
    unit = "day" if abs(n) == 1 else "days"
    return f"{later} is {abs(n)} {unit} {'after' if n > 0 else 'before'} {earlier}."


def sentences(dates: list[tuple[str, datetime]]) -> Iterator[str]:
    """Kev's order: for each date, one sentence with each date that appears after it."""
    for i, earlier in enumerate(dates):
        for later in dates[i + 1 :]:
            yield day_fact(*later, *earlier)


def most_dates(max_chars: int) -> int:
    """The most dates whose facts might fit in `max_chars` characters (each pair's sentence at its shortest)."""
    k = 1
    while (k + 1) * k // 2 * MIN_SENTENCE_CHARS - 1 <= max_chars:
        k += 1
    return k


def date_facts(text: str, max_chars: int) -> str:
    """The facts of every two dates in `text`, joined by single spaces; "" for fewer than two dates. TooManyDates
    when they would be longer than `max_chars` characters, raised before they are built, having parsed at most
    `most_dates(max_chars) + 1` distinct dates."""
    most = most_dates(max_chars)
    dates = dates_in(text, most)
    if len(dates) > most:
        raise TooManyDates(len(dates), max_chars)
    facts, size = [], -1
    for sentence in sentences(dates):
        size += len(sentence) + 1
        if size > max_chars:
            raise TooManyDates(len(dates), max_chars)
        facts.append(sentence)
    return " ".join(facts)


def with_facts(state: Any, facts: str) -> Any:
    """The state with its date facts added, as Kev adds them: an object gets (or has replaced, in place) its
    `date_facts` key, a list a final {"date_facts": ...} item, text a final "date_facts: ..." paragraph. No facts: the
    state unchanged."""
    if not facts:
        return state
    if isinstance(state, dict):
        return {**state, "date_facts": facts}
    if isinstance(state, list):
        return [*state, {"date_facts": facts}]
    return f"{state}\n\ndate_facts: {facts}"
