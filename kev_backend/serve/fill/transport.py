"""HTTP GETs with a timeout and bounded retries, streaming into a sink.

Retried: connection errors, timeouts, a body cut short, and answers 408, 429 and 5xx, up to `retries` more tries with
a doubling pause; any other answer (401, 403, 404, ...) fails at once, naming the URL and the server's words.
Headers are made anew for each try (a SigV4 signature carries its time). An Authorization header never follows a
redirect to another host: the hub sends large files to a CDN, which must not see the token.
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from typing import Protocol

CHUNK = 1 << 20
RETRIED_STATUS = {408, 429}
BACKOFF_CAP_S = 30.0


class FetchError(Exception):
    """A GET that failed for good: an answer that is not retried, or the last of the retries."""


class Sink(Protocol):
    def reset(self) -> None: ...

    def write(self, data: bytes) -> None: ...


class _Buffer:
    def __init__(self) -> None:
        self.data = bytearray()

    def reset(self) -> None:
        self.data.clear()

    def write(self, data: bytes) -> None:
        self.data += data


class _SameHostAuthorization(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            for key in [k for k in new.headers if k.lower() == "authorization"]:
                del new.headers[key]
        return new


def _origin(url: str) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, parts.netloc.lower()


class _Retry(Exception):
    """A failure worth another try."""


class _SinkFailed(Exception):
    """Writing what was received failed (a full disk): raised to the caller as its OSError."""


Headers = Mapping[str, str] | Callable[[], Mapping[str, str]]


class Transport:
    def __init__(
        self,
        timeout_s: float = 60.0,
        retries: int = 5,
        backoff_s: float = 1.0,
        log: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.log = log
        self._opener = urllib.request.build_opener(_SameHostAuthorization)

    def get(self, url: str, headers: Headers = ()) -> bytes:
        """The whole body of a small answer (a listing, a manifest)."""
        buffer = _Buffer()
        self.download(url, headers, buffer)
        return bytes(buffer.data)

    def download(self, url: str, headers: Headers, sink: Sink) -> None:
        """Streams the body into `sink`, which is reset before every try."""
        for attempt in range(self.retries + 1):
            sink.reset()
            try:
                self._once(url, headers() if callable(headers) else dict(headers), sink)
                return
            except _SinkFailed as failure:
                raise failure.args[0] from None
            except _Retry as failure:
                if attempt == self.retries:
                    raise FetchError(f"GET {_shown(url)}: {failure} (gave up after {attempt + 1} tries)") from None
                pause = min(BACKOFF_CAP_S, self.backoff_s * 2**attempt)
                self.log(f"retry GET {_shown(url)} in {pause:g} s: {failure}")
                time.sleep(pause)

    def _once(self, url: str, headers: Mapping[str, str], sink: Sink) -> None:
        request = urllib.request.Request(url, headers=dict(headers), method="GET")
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                length = response.headers.get("Content-Length")
                received = 0
                while block := response.read(CHUNK):
                    received += len(block)
                    try:
                        sink.write(block)
                    except OSError as error:  # the disk's fault, not the network's: not retried
                        raise _SinkFailed(error) from error
                if length is not None and length.isdigit() and received != int(length):
                    raise _Retry(f"body cut short: {received} of {length} bytes")
        except urllib.error.HTTPError as error:
            detail = _detail(error)
            if error.code in RETRIED_STATUS or error.code >= 500:
                raise _Retry(f"HTTP {error.code}{detail}") from None
            raise FetchError(f"GET {_shown(url)}: HTTP {error.code}{detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException, OSError) as error:
            reason = getattr(error, "reason", error)
            raise _Retry(f"{type(reason).__name__}: {reason}") from None


def _detail(error: urllib.error.HTTPError) -> str:
    """The server's own words: the hub's X-Error-Message, else the start of the body (S3's XML error)."""
    message = error.headers.get("X-Error-Message") if error.headers else None
    if not message:
        try:
            message = error.read(600).decode("utf-8", "replace").strip()
        except OSError:
            message = ""
    return f": {' '.join(message.split())}" if message else ""


def _shown(url: str) -> str:
    """The URL without its query (a presigned or paged query adds nothing to a message)."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
