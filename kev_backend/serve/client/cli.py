"""`kev score IN.jsonl OUT.jsonl`: offline batch scoring against a running Kev Triton server.

One System One request per input line; one output line per input line, in input order: the response body, or
`{"error": {"kind", "message"}}` for a line that failed (also reported on stderr; the run goes on), each with
`"line"`, the number of the input line it answers (from 1), so output joins to input without trusting position.
Output is appended in order as it completes, so rerunning the same command resumes after the last line written.

Lines are split at "\n" alone (a "\r" before it is JSON whitespace): JSON allows U+2028, U+2029 and U+0085 raw
inside its strings, and Python's str.splitlines() would split a request there. Output escapes those three, so a
reader that splits at any line boundary still sees one line per answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TextIO

from .clients import AsyncKevClient, KevError

# Line separators JSON allows raw inside strings (str.splitlines() breaks at each), written as escapes in output.
RAW_SEPARATORS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\u0085": "\\u0085"})


def input_lines(path: Path) -> list[str]:
    """The file's lines, split at "\n" only (read as bytes: text mode would also split at a lone "\r"); a last line
    without its "\n" counts, an empty file has none."""
    text = path.read_bytes().decode("utf-8")
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def output_line(line: int, body: dict) -> str:
    """One output line: the body with the number of the input line it answers, on one line whatever it holds."""
    return json.dumps({"line": line, **body}, ensure_ascii=False).translate(RAW_SEPARATORS)


def completed_lines(path: Path) -> int:
    """Lines already answered; a partial last line (an interrupted write) is cut off and redone."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with path.open("r+b") as f:
            f.truncate(keep)
    return data[:keep].count(b"\n")


class Progress:
    def __init__(self, total: int, done: int, stream: TextIO = sys.stderr) -> None:
        self.total, self.done, self.failed, self.stream = total, done, 0, stream
        self.started, self.shown, self.first = time.monotonic(), 0.0, done

    def step(self, failed: bool) -> None:
        self.done += 1
        self.failed += failed
        now = time.monotonic()
        if now - self.shown > 0.2 or self.done == self.total:
            self.shown = now
            rate = (self.done - self.first) / max(now - self.started, 1e-9)
            width = 30
            filled = int(width * self.done / max(self.total, 1))
            self.stream.write(
                f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {rate:.1f}/s failed {self.failed}"
            )
            self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")


async def score_file(
    source: Path, target: Path, url: str, protocol: str, model: str, concurrency: int, progress: bool = True
) -> dict[str, int]:
    lines = input_lines(source)
    start = completed_lines(target)
    bar = Progress(len(lines), start) if progress else None
    results: dict[int, str] = {}
    next_index = iter(range(start, len(lines)))
    written = start
    failures = 0
    async with AsyncKevClient(url, protocol, model) as kev:  # type: ignore[arg-type]
        with target.open("a") as out:

            async def worker() -> None:
                nonlocal written, failures
                for index in next_index:
                    try:
                        reply = output_line(index + 1, await kev.score(lines[index]))
                        failed = False
                    except KevError as error:
                        reply = output_line(index + 1, {"error": {"kind": error.kind, "message": error.message}})
                        print(f"line {index + 1}: {error.kind}: {error.message}", file=sys.stderr)
                        failed = True
                    failures += failed
                    results[index] = reply
                    while written in results:  # keep input order; flush each line as soon as it is next
                        out.write(results.pop(written) + "\n")
                        written += 1
                    out.flush()
                    if bar:
                        bar.step(failed)

            await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    if bar:
        bar.close()
    return {"lines": len(lines), "skipped": start, "scored": len(lines) - start, "failed": failures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kev", description="Kev on Triton tools")
    commands = parser.add_subparsers(dest="command", required=True)
    score = commands.add_parser("score", help="score a JSONL file of System One requests")
    score.add_argument("source", type=Path)
    score.add_argument("target", type=Path)
    score.add_argument("--url", default="127.0.0.1:8001", help="Triton address (gRPC 8001, HTTP 8000)")
    score.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    score.add_argument("--model", default="kev")
    score.add_argument("--concurrency", type=int, default=32)
    score.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    summary = asyncio.run(
        score_file(args.source, args.target, args.url, args.protocol, args.model, args.concurrency, not args.quiet)
    )
    print(json.dumps(summary), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
