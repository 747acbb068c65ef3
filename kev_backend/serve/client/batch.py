"""`kev score`'s run over a JSONL file: input and output streamed (memory does not grow with the file), output in
input order, every input line answered at most once in it, and a rerun that keeps the earlier answers and scores
only the lines that failed or were never reached.

The output holds one line per input line it has answered, in input order, each with `"line"` (the input line's
number, from 1): the response body, or `{"error": {"kind", "message"}}`. A run writes a new output beside the old
one (`.NAME.partial`), copying the old answers forward and scoring the rest, and puts it in place when it ends, also
when interrupted (SIGINT, SIGTERM: it stops reading, lets the requests in flight end, and keeps the old answers past
them). Killed outright, the old output stays as it was and the next run starts over from it: never a line twice.

Lines are split at "\\n" alone (a "\\r" before it is JSON whitespace): JSON allows U+2028, U+2029 and U+0085 raw
inside its strings, and Python's str.splitlines() would split a request there. Output escapes those three, so a
reader that splits at any line boundary still sees one line per answer.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .targets import Failed, Retries, Target, score_with_retries

# Line separators JSON allows raw inside strings (str.splitlines() breaks at each), written as escapes in output.
RAW_SEPARATORS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\u0085": "\\u0085"})


def output_line(number: int, body: dict[str, Any]) -> str:
    """One output line: the body with the number of the input line it answers, on one line whatever it holds."""
    return json.dumps({"line": number, **body}, ensure_ascii=False).translate(RAW_SEPARATORS) + "\n"


def error_line(number: int, kind: str, message: str) -> str:
    return output_line(number, {"error": {"kind": kind, "message": message}})


def input_lines(source: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """(number from 1, bytes without the "\\n") for each line; a last line without its "\\n" counts."""
    for number, raw in enumerate(source, 1):  # a binary file's lines end at b"\n" only
        yield number, raw[:-1] if raw.endswith(b"\n") else raw


def count_lines(path: Path) -> int:
    """Input lines, counted in blocks (for the progress bar's total)."""
    count, last = 0, b"\n"
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


class EarlierOutput:
    """An earlier run's output, read forward alongside the input: `answered(n)` is its answer line for input line n,
    or None when it has none or an error there. A partial last line (an interrupted write) or a line that is not one
    of ours counts as no answer."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("rb") if path.exists() else None
        self.ahead: tuple[int, bytes, bool] | None = None

    def _next(self) -> tuple[int, bytes, bool] | None:
        while self.file is not None:
            raw = self.file.readline()
            if not raw.endswith(b"\n"):
                self.file.close()
                self.file = None
                return None
            try:
                body = json.loads(raw)
                number = body["line"]
            except (ValueError, KeyError, TypeError):
                continue
            if isinstance(number, int) and isinstance(body, dict):
                return number, raw, "error" in body
        return None

    def answered(self, number: int) -> str | None:
        while True:
            if self.ahead is None and (found := self._next()) is not None:
                self.ahead = found
            if self.ahead is None or self.ahead[0] > number:
                return None
            ahead, raw, failed = self.ahead
            self.ahead = None
            if ahead == number:
                return None if failed else raw.decode()

    def rest(self) -> Iterator[str]:
        """The answers after the last line asked about (an interrupted run keeps them)."""
        while True:
            if self.ahead is None and (found := self._next()) is not None:
                self.ahead = found
            if self.ahead is None:
                return
            _, raw, failed = self.ahead
            self.ahead = None
            if not failed:
                yield raw.decode()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


@dataclass
class Summary:
    lines: int = 0  # input lines read
    kept: int = 0  # answered by an earlier run, copied forward
    scored: int = 0  # answered by this run
    failed: int = 0  # written as errors (a rerun retries them)
    interrupted: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"lines": self.lines, "kept": self.kept, "scored": self.scored, "failed": self.failed,
                "interrupted": self.interrupted}  # fmt: skip


Pending = tuple[int, "str | Future[dict[str, Any]]"]  # an input line's number: its kept answer, or its request


def score_file(
    source: Path,
    target_path: Path,
    target: Target,
    concurrency: int,
    retries: Retries,
    stopping: threading.Event,
    on_line: Callable[[int, str | None], None] = lambda number, failure: None,
) -> Summary:
    """Scores every line of `source` the output at `target_path` has not answered (see the module's docstring).
    `on_line(number, failure)`: after each line is written (failure: its error's text, else None)."""
    summary = Summary()
    earlier = EarlierOutput(target_path)
    partial = target_path.with_name(f".{target_path.name}.partial")
    # At most this many lines between the next to write and the last sent: memory stays flat whatever the file.
    window = max(1, concurrency) * 4
    pending: deque[Pending] = deque()
    with source.open("rb") as lines, partial.open("w", encoding="utf-8") as out:
        with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="kev-score") as pool:

            def write(entry: Pending, wait: bool) -> bool:
                number, work = entry
                if isinstance(work, str):
                    out.write(work)
                    on_line(number, None)
                    return True
                if not wait and not work.done():
                    return False
                try:
                    out.write(output_line(number, work.result()))
                    summary.scored += 1
                    on_line(number, None)
                except Failed as failed:
                    if stopping.is_set() and not failed.final:
                        return True  # cut short by the interruption: left for the next run, not written
                    out.write(error_line(number, failed.kind, failed.message))
                    summary.failed += 1
                    on_line(number, f"{failed.kind}: {failed.message}")
                return True

            for number, raw in input_lines(lines):
                if stopping.is_set():
                    break
                summary.lines = number
                if (kept := earlier.answered(number)) is not None:
                    summary.kept += 1
                    pending.append((number, kept))
                else:
                    try:
                        request = pool.submit(score_with_retries, target, raw.decode("utf-8"), retries, stopping)
                    except UnicodeDecodeError as error:
                        request = Future()
                        request.set_exception(Failed("invalid", f"the line is not UTF-8: {error}", final=True))
                    pending.append((number, request))
                while pending and write(pending[0], wait=len(pending) >= window):
                    pending.popleft()
            summary.interrupted = stopping.is_set()
            while pending:
                entry = pending.popleft()
                if summary.interrupted and isinstance(entry[1], Future) and entry[1].cancel():
                    continue  # never sent: left for the next run
                write(entry, wait=True)
        if summary.interrupted:
            for kept in earlier.rest():
                out.write(kept)
        earlier.close()
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, target_path)
    return summary
