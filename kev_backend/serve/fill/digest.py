"""What a file must hash to, and hashing it.

Every file has an expected digest before a byte of it is written: the sha256 of a SHA256SUMS line (S3) or of the
hub's LFS pointer, or, for a hub file kept in git itself (no LFS), its git blob id, the sha1 of `blob <size>\\0`
followed by the bytes. The sha256 of every file is computed as well: it is what the completion marker records.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 20
SHA256 = re.compile(r"[0-9a-f]{64}")
SHA1 = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class Expected:
    """`kind` "sha256" (hex of the file's sha256) or "git-blob" (hex of its git blob sha1); `size` in bytes when the
    source states it (a git blob's id cannot be computed without it)."""

    kind: str
    hex: str
    size: int | None = None

    def __post_init__(self) -> None:
        pattern = {"sha256": SHA256, "git-blob": SHA1}.get(self.kind)
        if pattern is None or not pattern.fullmatch(self.hex):
            raise ValueError(f"not a {self.kind} digest: {self.hex!r}")
        if self.kind == "git-blob" and self.size is None:
            raise ValueError("a git blob id needs the file's size")


class Hasher:
    """Hashes bytes as they are written: sha256 always, the git blob sha1 when `expected` is one."""

    def __init__(self, expected: Expected) -> None:
        self.expected = expected
        self.size = 0
        self._sha256 = hashlib.sha256()
        self._git = None
        if expected.kind == "git-blob":
            self._git = hashlib.sha1(f"blob {expected.size}\0".encode(), usedforsecurity=False)

    def update(self, data: bytes) -> None:
        self.size += len(data)
        self._sha256.update(data)
        if self._git is not None:
            self._git.update(data)

    @property
    def sha256(self) -> str:
        return self._sha256.hexdigest()

    @property
    def actual(self) -> str:
        """The digest of the expected kind, of the bytes seen so far."""
        return self._git.hexdigest() if self._git is not None else self.sha256

    def mismatch(self) -> str | None:
        """None when the bytes seen are the expected ones; else both digests (and sizes when they differ)."""
        want = self.expected
        if (want.size is None or self.size == want.size) and self.actual == want.hex:
            return None
        sizes = f"; {self.size} bytes where {want.size} were expected" if want.size not in (None, self.size) else ""
        if want.kind == "sha256":
            return f"sha256 {self.sha256} where {want.hex} was expected{sizes}"
        return f"git blob {self.actual} where {want.hex} was expected (sha256 {self.sha256}){sizes}"


def hash_stream(stream: BinaryIO, expected: Expected) -> Hasher:
    hasher = Hasher(expected)
    while block := stream.read(CHUNK):
        hasher.update(block)
    return hasher


def hash_file(path: Path, expected: Expected) -> Hasher:
    """The file's hashes, never following a link at the final component (a link placed in the volume is not the
    file the source listed)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as stream:
        return hash_stream(stream, expected)
