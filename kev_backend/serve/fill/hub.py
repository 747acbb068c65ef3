"""A model hub snapshot at one pinned commit, through the Hugging Face hub's HTTP API.

`GET {endpoint}/api/models/{repo}/revision/{commit}?blobs=true` lists the snapshot: its `sha` (the commit it
resolved to) and `siblings`, each `{rfilename, size, blobId, lfs?: {sha256, size}}`; `GET {endpoint}/{repo}/resolve/
{commit}/{path}` serves a file (LFS files through a redirect to a CDN). Only a 40-hex commit is accepted: a branch or
tag moves, and a volume filled from one would hold whatever it named that day. An LFS file must match the sha256 of
its pointer; a file kept in git itself, its git blob id (the listing gives no sha256 for those).
"""

from __future__ import annotations

import fnmatch
import json
import re
import urllib.parse
from collections.abc import Sequence
from typing import Any

from .digest import Expected
from .names import UnsafeName, safe_name
from .remote import FillError, RemoteFile
from .transport import Sink, Transport

DEFAULT_ENDPOINT = "https://huggingface.co"
COMMIT = re.compile(r"[0-9a-f]{40}")
REPO = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*")


def check_revision(revision: str) -> str:
    if not COMMIT.fullmatch(revision):
        raise ValueError(
            f"revision {revision!r} is not a pinned commit: give the 40-hex commit id (a branch or tag moves; "
            "the hub's `sha` of the revision you want)"
        )
    return revision


class HubSource:
    def __init__(
        self,
        repo: str,
        revision: str,
        transport: Transport,
        endpoint: str = DEFAULT_ENDPOINT,
        token: str | None = None,
        include: Sequence[str] = (),
    ) -> None:
        if not REPO.fullmatch(repo) or ".." in repo:
            raise ValueError(f"not a hub repository id: {repo!r} (owner/name)")
        self.repo, self.revision = repo, check_revision(revision)
        self.endpoint = endpoint.rstrip("/")
        self.transport, self.include = transport, list(include)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    def files(self) -> list[RemoteFile]:
        url = f"{self.endpoint}/api/models/{self.repo}/revision/{self.revision}?blobs=true"
        try:
            info = json.loads(self.transport.get(url, self._headers))
        except json.JSONDecodeError as error:
            raise FillError(f"{url}: not a JSON listing ({error})") from None
        if not isinstance(info, dict) or info.get("sha") != self.revision:
            got = info.get("sha") if isinstance(info, dict) else None
            raise FillError(f"{self.repo}: the hub resolved {self.revision} to {got!r}, not to that commit")
        siblings = info.get("siblings")
        if not isinstance(siblings, list):
            raise FillError(f"{self.repo}@{self.revision}: the listing has no siblings")
        files = [self._file(sibling) for sibling in siblings]
        if self.include:
            files = [f for f in files if any(fnmatch.fnmatchcase(f.name, p) for p in self.include)]
        if not files:
            raise FillError(f"{self.repo}@{self.revision}: no file to fill (include: {self.include or 'all'})")
        return files

    def _file(self, sibling: Any) -> RemoteFile:
        name = sibling.get("rfilename") if isinstance(sibling, dict) else None
        if not isinstance(name, str):
            raise FillError(f"{self.repo}@{self.revision}: a listed file without a name: {sibling!r}")
        try:
            safe_name(name)
            lfs = sibling.get("lfs")
            if isinstance(lfs, dict):
                expected = Expected("sha256", str(lfs.get("sha256")), _size(lfs.get("size", sibling.get("size"))))
            else:
                expected = Expected("git-blob", str(sibling.get("blobId")), _size(sibling.get("size")))
        except (UnsafeName, ValueError) as error:
            raise FillError(f"{self.repo}@{self.revision}: refused: {error}") from None
        return RemoteFile(name, expected)

    def fetch(self, file: RemoteFile, sink: Sink) -> None:
        path = urllib.parse.quote(file.name, safe="/")
        self.transport.download(f"{self.endpoint}/{self.repo}/resolve/{self.revision}/{path}", self._headers, sink)

    def describe(self) -> dict[str, Any]:
        return {"kind": "hub", "endpoint": self.endpoint, "repo": self.repo, "revision": self.revision}


def _size(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"not a size: {value!r}")
    return value
