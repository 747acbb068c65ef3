"""Which names a source may give a file: relative POSIX paths that stay inside the directory being filled.

A listing comes from a remote store; a name such as `../x`, `/etc/x` or `a//b` would write outside the volume or
somewhere the loader never looks, so it is refused before anything is written, not cleaned up.
"""

from __future__ import annotations

import re

MARKER = ".kev-fill.json"
# Downloads go to `.<name>.kev-fill-<random>.part` beside their final name; no listed file may look like one.
PART_SUFFIX = ".part"
PART_TAG = ".kev-fill-"
_BAD_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")


class UnsafeName(ValueError):
    """A listed name that could escape the directory or collide with the fill's own files."""


def safe_name(name: str) -> str:
    """`name` itself when it is a safe relative path; else UnsafeName saying why."""
    if not name:
        raise UnsafeName("an empty file name")
    if name.startswith("/"):
        raise UnsafeName(f"{name!r}: an absolute path")
    if _BAD_CHARS.search(name):
        raise UnsafeName(f"{name!r}: a backslash or control character")
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise UnsafeName(f"{name!r}: an empty, '.' or '..' path component")
    if name == MARKER or (parts[-1].startswith(".") and PART_TAG in parts[-1] and parts[-1].endswith(PART_SUFFIX)):
        raise UnsafeName(f"{name!r}: the name of the fill's own marker or temporary files")
    return name
