"""`kev score IN.jsonl OUT.jsonl`: batch scoring against a running Kev server (Triton's port or the gateway), fit for
a pipeline (kev_backend/serve/client/batch.py says how the output is kept in order and resumed).

Exit codes: 0 every line answered (with --dry-run: every line valid); 1 some lines failed (written as errors; run the
same command again to retry them); 2 a usage error or an input that cannot be read; 130 interrupted (SIGINT or
SIGTERM; the output keeps every answer so far, and a rerun goes on from it).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from ...protocol.request import DEFAULT_LIMITS, RequestError, parse_request
from ...settings import api_key
from ..version import version_line
from .batch import Summary, count_lines, input_lines, score_file
from .targets import GatewayTarget, Retries, Target, TritonTarget

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def parser() -> argparse.ArgumentParser:
    kev = argparse.ArgumentParser(prog="kev", description="Kev on Triton tools")
    kev.add_argument("--version", action="version", version=version_line("kev"))
    commands = kev.add_subparsers(dest="command", required=True)
    score = commands.add_parser(
        "score",
        help="score a JSONL file of System One requests",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    score.add_argument("source", type=Path, help="one System One request (JSON) a line")
    score.add_argument("target", type=Path, help="one answer a line, in input order; rerun to retry failed lines")
    where = score.add_mutually_exclusive_group()
    where.add_argument("--url", default="127.0.0.1:8001", help="Triton's address (gRPC 8001; HTTP 8000)")
    where.add_argument("--gateway", metavar="URL", help="the System One gateway instead, e.g. http://127.0.0.1:8009")
    score.add_argument("--protocol", choices=["grpc", "http"], default="grpc", help="with --url")
    score.add_argument("--model", default="kev", help="with --url: Triton's model name")
    score.add_argument(
        "--api-key-file", type=Path, help="with --gateway: a file holding its key (else KEV_API_KEY, if set)"
    )
    score.add_argument("--concurrency", type=int, default=32, help="requests in flight (default 32)")
    score.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take (default 60)")
    score.add_argument(
        "--retries", type=int, default=5, help="retries of a line the server or network failed (default 5)"
    )
    score.add_argument("--dry-run", action="store_true", help="validate every line as the server would; send nothing")
    score.add_argument("--quiet", action="store_true", help="no progress bar (there is none when not on a terminal)")
    return kev


def target_of(args: argparse.Namespace) -> Target:
    if args.gateway:
        key = api_key()
        if args.api_key_file is not None:
            key = args.api_key_file.read_text().strip()
        return GatewayTarget(args.gateway, key, args.timeout)
    return TritonTarget(args.url, args.protocol, args.model, args.timeout)


def dry_run(source: Path) -> int:
    """Every line through the request validation the server runs before tokenizing (Kev's messages; the token
    limits need the model's tokenizer and are checked by the server alone)."""
    invalid = lines = 0
    with source.open("rb") as f:
        for number, raw in input_lines(f):
            lines = number
            try:
                parse_request(raw, DEFAULT_LIMITS)
            except RequestError as error:
                invalid += 1
                print(f"line {number}: invalid: {error.message}", file=sys.stderr)
    print(json.dumps({"lines": lines, "invalid": invalid}), file=sys.stderr)
    return EXIT_FAILED if invalid else EXIT_OK


def score(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    # tqdm draws only on a terminal (disable=None): a log gets the failures and the summary line, no carriage returns.
    bar = tqdm(total=count_lines(args.source), unit="line", disable=True if args.quiet else None, file=sys.stderr)

    def on_line(number: int, failure: str | None) -> None:
        bar.update()
        if failure is not None:
            bar.write(f"line {number}: {failure}", file=sys.stderr)

    target = target_of(args)
    try:
        retries = Retries(attempts=max(0, args.retries))
        summary: Summary = score_file(args.source, args.target, target, args.concurrency, retries, stopping, on_line)
    finally:
        bar.close()
        target.close()
    print(json.dumps(summary.as_dict()), file=sys.stderr)
    if summary.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_FAILED if summary.failed else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.source.is_file():
        print(f"kev score: no such input file: {args.source}", file=sys.stderr)
        return EXIT_USAGE
    if not args.dry_run and not args.target.parent.is_dir():
        print(f"kev score: the output's folder does not exist: {args.target.parent}", file=sys.stderr)
        return EXIT_USAGE
    if args.api_key_file is not None and not args.api_key_file.is_file():
        print(f"kev score: no such key file: {args.api_key_file}", file=sys.stderr)
        return EXIT_USAGE
    return dry_run(args.source) if args.dry_run else score(args)


if __name__ == "__main__":
    sys.exit(main())
