"""An S3-compatible object store: every object under a prefix, each vouched for by the prefix's SHA256SUMS.

ListObjectsV2 (paged by continuation token) names the objects; GetObject fetches each, both signed with SigV4 (or
unsigned for a public bucket). The manifest is the object `<prefix>SHA256SUMS` unless one is given; its own sha256
can be pinned. An object the manifest does not list is refused, and so is a listed name with no object: the
directory is filled with exactly what the manifest vouches for, or not at all.
"""

from __future__ import annotations

import hashlib
import urllib.parse
import xml.etree.ElementTree as ElementTree
from typing import Any

from . import sigv4, sums
from .digest import Expected
from .names import UnsafeName, safe_name
from .remote import FillError, RemoteFile
from .transport import Sink, Transport

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


def parse_url(url: str) -> tuple[str, str]:
    """s3://BUCKET/PREFIX -> (bucket, prefix ending in `/`, or empty for the whole bucket)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"not an s3://BUCKET/PREFIX URL: {url!r}")
    prefix = parts.path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"  # `models/kev` must not take `models/kev-old/...` along
    return parts.netloc, prefix


class S3Source:
    def __init__(
        self,
        url: str,
        endpoint: str,
        region: str,
        transport: Transport,
        credentials: sigv4.Credentials | None = None,
        virtual_host: bool = False,
        manifest: bytes | None = None,
        manifest_sha256: str | None = None,
    ) -> None:
        self.bucket, self.prefix = parse_url(url)
        parts = urllib.parse.urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path.strip("/"):
            raise ValueError(f"not an S3 endpoint URL: {endpoint!r} (scheme://host[:port])")
        self.scheme = parts.scheme
        # Path style (`host/bucket/key`) by default: every S3-compatible store serves it; virtual-host style
        # (`bucket.host/key`) where the store wants it.
        self.host = f"{self.bucket}.{parts.netloc}" if virtual_host else parts.netloc
        self.root = "/" if virtual_host else f"/{self.bucket}/"
        self.region, self.transport, self.credentials = region, transport, credentials
        self.manifest, self.manifest_sha256 = manifest, manifest_sha256
        self._manifest_digest: str | None = None

    def _url_and_headers(self, key: str, query: dict[str, str]) -> tuple[str, Any]:
        path = self.root + key
        url = f"{self.scheme}://{self.host}{sigv4.canonical_path(path)}"
        if query:
            url += "?" + sigv4.canonical_query(query)
        if self.credentials is None:
            return url, {}
        credentials = self.credentials
        return url, lambda: sigv4.sign("GET", self.host, path, query, credentials, self.region)

    def _get(self, key: str, query: dict[str, str] | None = None) -> bytes:
        url, headers = self._url_and_headers(key, query or {})
        return self.transport.get(url, headers)

    def objects(self) -> dict[str, int]:
        """key -> size of every object under the prefix."""
        found: dict[str, int] = {}
        query = {"list-type": "2", "prefix": self.prefix}
        while True:
            body = self._get("", query)
            try:
                root = ElementTree.fromstring(body)
            except ElementTree.ParseError as error:
                raise FillError(f"s3://{self.bucket}/{self.prefix}: not a ListObjectsV2 answer ({error})") from None
            for item in root.iter(f"{_NS}Contents"):
                found[item.findtext(f"{_NS}Key", "")] = int(item.findtext(f"{_NS}Size", "-1"))
            token = root.findtext(f"{_NS}NextContinuationToken")
            if root.findtext(f"{_NS}IsTruncated") != "true" or not token:
                return found
            query = {**query, "continuation-token": token}

    def files(self) -> list[RemoteFile]:
        objects = self.objects()
        manifest_key = self.prefix + sums.NAME
        manifest = self.manifest if self.manifest is not None else self._get(manifest_key)
        self._manifest_digest = hashlib.sha256(manifest).hexdigest()
        if self.manifest_sha256 and self._manifest_digest != self.manifest_sha256.lower():
            raise FillError(
                f"{sums.NAME}: sha256 {self._manifest_digest} where {self.manifest_sha256} was expected: refused"
            )
        listed = sums.parse(manifest.decode("utf-8", "replace"), f"s3://{self.bucket}/{manifest_key}")
        files = []
        for key, size in sorted(objects.items()):
            if key == manifest_key or (key.endswith("/") and size == 0):  # the manifest; a console's folder marker
                continue
            name = key[len(self.prefix) :]
            try:
                safe_name(name)
            except UnsafeName as error:
                raise FillError(f"s3://{self.bucket}/{key}: refused: {error}") from None
            if name not in listed:
                raise FillError(f"s3://{self.bucket}/{key}: not listed in {sums.NAME}: refused")
            # The manifest's sha256 alone decides (not the listed size): a file in place that matches it is right
            # whatever the object holds now.
            files.append(RemoteFile(name, Expected("sha256", listed[name])))
        missing = sorted(set(listed) - {f.name for f in files})
        if missing:
            raise FillError(f"{sums.NAME} lists {', '.join(missing)}, absent under s3://{self.bucket}/{self.prefix}")
        return files

    def fetch(self, file: RemoteFile, sink: Sink) -> None:
        url, headers = self._url_and_headers(self.prefix + file.name, {})
        self.transport.download(url, headers, sink)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "s3",
            "endpoint": f"{self.scheme}://{self.host}",
            "bucket": self.bucket,
            "prefix": self.prefix,
            "sha256sums": self._manifest_digest,
        }
