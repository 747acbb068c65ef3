"""A checkpoint's files, opened only as what they claim to be: regular files, inside the directory that names them.

A FIFO or a device named `model.safetensors` would block a load (or never end it) instead of failing it, and an
index naming `../elsewhere.safetensors` or an absolute path would read files the checkpoint does not hold. Links are
followed: the Hugging Face cache keeps a snapshot's files as links into its blob store."""

from __future__ import annotations

import stat
from pathlib import Path, PurePosixPath


def regular(path: Path) -> Path:
    """`path`, if it is a regular file once links are followed."""
    if not stat.S_ISREG(path.stat().st_mode):
        raise ValueError(f"{path}: not a regular file")
    return path


def inside(directory: Path, name: str) -> Path:
    """The file `name` (a relative path from an index) in `directory`; never one outside it."""
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise ValueError(f"{directory}: the index names {name!r}, not a file in this directory")
    return directory / relative
