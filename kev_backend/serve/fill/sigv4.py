"""AWS Signature Version 4 for S3 GETs, with hmac and hashlib (the image holds no AWS SDK).

The canonical request, string to sign and signing key of AWS's "Signature Version 4 signing process" for the
`s3` service: the path's segments percent-encoded once (S3 does not normalise or double-encode), the query sorted
by encoded name, the signed headers host, x-amz-content-sha256, x-amz-date (and x-amz-security-token with temporary
credentials), the payload's sha256 (a GET's empty body).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

ALGORITHM = "AWS4-HMAC-SHA256"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str
    session_token: str | None = None

    def __repr__(self) -> str:  # never print a secret
        return f"Credentials(access_key={self.access_key!r})"


def _encode(text: str, safe: str = "") -> str:
    # RFC 3986 unreserved characters stay; everything else is %XX, upper-case hex (quote's own style).
    return urllib.parse.quote(text, safe="-_.~" + safe)


def canonical_query(query: Mapping[str, str]) -> str:
    """The query as signed, and as it must be sent (the URL's query is this string)."""
    return "&".join(f"{k}={v}" for k, v in sorted((_encode(k), _encode(v)) for k, v in query.items()))


def canonical_path(path: str) -> str:
    """The path as signed, and as it must be sent."""
    return _encode(path, safe="/")


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def signing_key(secret_key: str, date: str, region: str, service: str = "s3") -> bytes:
    key = _hmac(f"AWS4{secret_key}".encode(), date)
    for part in (region, service, "aws4_request"):
        key = _hmac(key, part)
    return key


def sign(
    method: str,
    host: str,
    path: str,
    query: Mapping[str, str],
    credentials: Credentials,
    region: str,
    now: datetime.datetime | None = None,
    extra_headers: Mapping[str, str] | None = None,
    payload_sha256: str = EMPTY_SHA256,
) -> dict[str, str]:
    """The headers a request to `host` + `path` (unencoded; encoded here) with `query` must carry: Host, the
    x-amz-* headers and Authorization. `extra_headers` are signed too and returned with them."""
    now = (now or datetime.datetime.now(datetime.UTC)).astimezone(datetime.UTC)
    stamp, date = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    headers = {"host": host, "x-amz-content-sha256": payload_sha256, "x-amz-date": stamp}
    if credentials.session_token:
        headers["x-amz-security-token"] = credentials.session_token
    headers.update({k.lower(): v for k, v in (extra_headers or {}).items()})
    names = sorted(headers)
    canonical = "\n".join(
        [
            method,
            canonical_path(path),
            canonical_query(query),
            "".join(f"{name}:{' '.join(headers[name].split())}\n" for name in names),
            ";".join(names),
            payload_sha256,
        ]
    )
    scope = f"{date}/{region}/s3/aws4_request"
    to_sign = "\n".join([ALGORITHM, stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    signature = hmac.new(signing_key(credentials.secret_key, date, region), to_sign.encode(), hashlib.sha256)
    headers["authorization"] = (
        f"{ALGORITHM} Credential={credentials.access_key}/{scope}, "
        f"SignedHeaders={';'.join(names)}, Signature={signature.hexdigest()}"
    )
    return headers
