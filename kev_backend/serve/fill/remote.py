"""What a source is: a list of files, each with the digest it must have, and a way to stream one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from .digest import Expected
from .transport import Sink


class FillError(Exception):
    """A fill that must stop: a refused file, a listing that cannot be trusted, a store that keeps failing."""


@dataclass(frozen=True)
class RemoteFile:
    name: str  # a safe relative path (names.safe_name)
    expected: Expected


class Source(Protocol):
    def files(self) -> list[RemoteFile]:
        """Every file to place, each name checked by names.safe_name."""
        ...

    def fetch(self, file: RemoteFile, sink: Sink) -> None:
        """Streams the file's bytes into sink (reset before each try)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Where the files came from, for the completion marker (no secret in it)."""
        ...
