"""Kev's text: a request's JSON values rendered as the text Kev tokenizes (`render`), and caller text with Kev's
delimiter tokens escaped (`escape_user_text`). Pure Python."""

from __future__ import annotations

import re
from typing import Any


def render(value: Any, indent: int = 0) -> str:
    """JSON -> the text the model reads, as Kev renders it. Python str() of scalars is part of the contract (True,
    532.0, 1e-07)."""
    parts: list[str] = []
    _render(value, indent, parts)
    return "".join(parts)


def _render(value: Any, indent: int, out: list[str]) -> None:
    """Kev's recursive rendering, written once into `out`: a list item is "- " and the item's own text with its
    leading whitespace stripped, a key with a list or object under it is "key:" and the value's lines below, one
    more indent each; any other key is "key: value". Each piece is appended once, so the work is the text's length
    (Kev's own form copies every nested text again at every level above it)."""
    if value is None:
        return
    if isinstance(value, (str, int, float, bool)):
        out.append(str(value))
        return
    pad = "  " * indent
    if isinstance(value, list):
        first, then = f"{pad}- ", f"\n{pad}- "  # one string each, however many items
        for i, item in enumerate(value):
            out.append(then if i else first)
            if isinstance(item, str):
                out.append(item.lstrip())
            elif isinstance(item, (dict, list)):
                start = len(out)
                _render(item, indent + 1, out)
                _lstrip(out, start)
            elif item is not None:  # a number or a bool: str() never starts with whitespace
                out.append(str(item))
        return
    for i, (key, item) in enumerate(value.items()):
        line = f"\n{pad}{key}" if i else f"{pad}{key}"
        if isinstance(item, (dict, list)):
            out.append(f"{line}:\n")
            _render(item, indent + 1, out)
        else:
            out.append(f"{line}: ")
            _render(item, 0, out)


def _lstrip(parts: list[str], start: int) -> None:
    """str.lstrip() of the text parts[start:] make up, in place."""
    for i in range(start, len(parts)):
        parts[i] = parts[i].lstrip()
        if parts[i]:
            return


_DELIMITER = re.compile(r"<\|([A-Za-z0-9_]+)\|>")


def escape_user_text(text: str) -> str:
    """<|name|> -> <¦name¦> (U+00A6), so caller text can never spell a delimiter token."""
    return _DELIMITER.sub("<\u00a6\\1\u00a6>", text)
