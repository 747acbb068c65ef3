"""`kev-fill`: fill a checkpoint directory from a hub snapshot at a pinned commit or from an S3 prefix.

    kev-fill hub OWNER/NAME DEST --revision COMMIT [--include GLOB ...]
    kev-fill s3 s3://BUCKET/PREFIX DEST [--endpoint-url URL] [--region REGION] [--sha256sums FILE]

Settings from the environment (each secret also from a file named by NAME_FILE, as a Kubernetes Secret mounts it):
HF_ENDPOINT (https://huggingface.co), HF_TOKEN (or the file HF_TOKEN_PATH); AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL,
AWS_REGION or AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN. One line a file on
stderr. Exit 0: every file verified and in place, the marker written; 1: the fill stopped (a refused file, a listing
that cannot be trusted, a store that kept failing), nothing unverified left at a final name; 2: a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..version import version_line
from . import hub, s3, sigv4
from .names import UnsafeName
from .place import fill
from .remote import FillError, Source
from .transport import FetchError, Transport


def log(line: str) -> None:
    print(f"kev-fill: {line}", file=sys.stderr, flush=True)


def secret(env: Mapping[str, str], name: str) -> str | None:
    """env[name], else the stripped content of the file env[name + "_FILE"]; a file that is not there reads as unset
    (the manifests name a file for every key, and a Secret holds only those its source needs)."""
    if env.get(name):
        return env[name]
    path = env.get(f"{name}_FILE")
    if not path or not Path(path).is_file():
        return None
    return Path(path).read_text().strip() or None


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="kev-fill", description=__doc__.splitlines()[0])
    main.add_argument("--version", action="version", version=version_line("kev-fill"))
    main.add_argument("--timeout", type=float, default=60.0, help="seconds a connection may stay silent (60)")
    main.add_argument("--retries", type=int, default=5, help="more tries after a 5xx, 429 or network error (5)")
    main.add_argument("--backoff", type=float, default=1.0, help="first pause between tries, doubling (1 s)")
    sources = main.add_subparsers(dest="source", required=True)
    h = sources.add_parser("hub", help="a model hub snapshot at a pinned commit")
    h.add_argument("repo", help="OWNER/NAME")
    h.add_argument("dest", type=Path, help="the directory to fill")
    h.add_argument("--revision", required=True, help="the snapshot's 40-hex commit id (no branch or tag)")
    h.add_argument("--include", action="append", default=[], help="only names matching this glob (repeatable)")
    h.add_argument("--endpoint", help="the hub's URL (default HF_ENDPOINT, else https://huggingface.co)")
    s = sources.add_parser("s3", help="every object under an S3 prefix, vouched for by its SHA256SUMS")
    s.add_argument("url", help="s3://BUCKET/PREFIX")
    s.add_argument("dest", type=Path, help="the directory to fill")
    s.add_argument("--endpoint-url", help="the store's URL (default AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL)")
    s.add_argument("--region", help="the signing region (default AWS_REGION, AWS_DEFAULT_REGION, else us-east-1)")
    s.add_argument("--virtual-host", action="store_true", help="BUCKET.host/KEY instead of host/BUCKET/KEY")
    s.add_argument("--sha256sums", type=Path, help="a local manifest instead of the object PREFIX/SHA256SUMS")
    s.add_argument("--sha256sums-sha256", help="refuse a manifest whose own sha256 is not this")
    s.add_argument("--anonymous", action="store_true", help="unsigned requests (a public bucket)")
    return main


def source_from(args: argparse.Namespace, env: Mapping[str, str], transport: Transport) -> Source:
    if args.source == "hub":
        token = secret(env, "HF_TOKEN")
        if token is None and env.get("HF_TOKEN_PATH") and Path(env["HF_TOKEN_PATH"]).is_file():
            token = Path(env["HF_TOKEN_PATH"]).read_text().strip() or None
        endpoint = args.endpoint or env.get("HF_ENDPOINT") or hub.DEFAULT_ENDPOINT
        return hub.HubSource(args.repo, args.revision, transport, endpoint, token, args.include)
    endpoint = args.endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if not endpoint:
        raise ValueError("no S3 endpoint: --endpoint-url or AWS_ENDPOINT_URL_S3 (https://s3.REGION.amazonaws.com)")
    region = args.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    credentials = None
    if not args.anonymous:
        access, key = secret(env, "AWS_ACCESS_KEY_ID"), secret(env, "AWS_SECRET_ACCESS_KEY")
        if not access or not key:
            raise ValueError(
                "no S3 credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or _FILE), or --anonymous"
            )
        credentials = sigv4.Credentials(access, key, secret(env, "AWS_SESSION_TOKEN"))
    manifest = args.sha256sums.read_bytes() if args.sha256sums else None
    return s3.S3Source(
        args.url, endpoint, region, transport, credentials, args.virtual_host, manifest, args.sha256sums_sha256
    )


def run(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    args = parser().parse_args(argv)
    env = os.environ if env is None else env
    try:
        if args.timeout <= 0 or args.retries < 0 or args.backoff < 0:
            raise ValueError("--timeout must be positive, --retries and --backoff at least 0")
        transport = Transport(args.timeout, args.retries, args.backoff, log)
        source = source_from(args, env, transport)
    except (ValueError, OSError) as error:
        log(f"error: {error}")
        return 2
    try:
        fill(source, args.dest, log)
    except (FillError, FetchError, UnsafeName) as error:
        log(f"error: {error}")
        return 1
    except OSError as error:  # the volume: full, read-only, not ours
        log(f"error: {args.dest}: {error}")
        return 1
    return 0


def main() -> None:
    sys.exit(run())
