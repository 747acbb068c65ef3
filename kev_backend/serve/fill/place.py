"""Placing a source's files into a directory, each verified before it takes its final name, then the marker.

Invariants, which make a rerun safe at any point:
- a file at its final name was verified: it is only ever put there by a rename of a temporary file (in the same
  directory, so the rename is atomic) whose bytes were fsynced and matched the expected digest; a file already there
  that does not match is removed before its replacement is fetched, so a refused download leaves nothing there;
- the marker (names.MARKER) exists only while every listed file is in place: it is removed first and written last
  (temp, fsync, rename), so a volume with a marker is complete and one without it is not yet;
- files already in place with the right digest are kept, not fetched again; temporary files of an interrupted run are
  removed.
"""

from __future__ import annotations

import datetime
import json
import os
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .digest import Hasher, hash_file
from .names import MARKER, PART_SUFFIX, PART_TAG, safe_name
from .remote import FillError, RemoteFile, Source

Log = Callable[[str], None]


@dataclass(frozen=True)
class Placed:
    name: str
    sha256: str
    size: int
    action: str  # "kept", "fetched" or "replaced"


def fill(source: Source, directory: Path, log: Log) -> list[Placed]:
    directory.mkdir(parents=True, exist_ok=True)
    _remove(directory / MARKER, directory)
    _remove_parts(directory, log)
    files = source.files()
    _check_names(files)
    placed = [_place(source, file, directory, log) for file in files]
    _write_marker(directory, source.describe(), placed)
    kept = sum(p.action == "kept" for p in placed)
    log(f"complete: {len(placed)} files in {directory} ({len(placed) - kept} fetched, {kept} kept), marker written")
    return placed


def _check_names(files: list[RemoteFile]) -> None:
    names = [safe_name(f.name) for f in files]  # the sources check them; checked again where they are used
    if len(set(names)) != len(names):
        raise FillError("the listing names a file twice")
    folders = {"/".join(n.split("/")[:i]) for n in names for i in range(1, n.count("/") + 1)}
    clash = sorted(folders & set(names))
    if clash:
        raise FillError(f"the listing has {clash[0]} both as a file and as a folder")


def _place(source: Source, file: RemoteFile, directory: Path, log: Log) -> Placed:
    parent = _parent(directory, file.name)
    final = directory / file.name
    action = "fetched"
    try:
        mode = os.lstat(final).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and stat.S_ISREG(mode):
        have = hash_file(final, file.expected)
        problem = have.mismatch()
        if problem is None:
            log(f"kept {file.name}: {have.size} bytes, sha256 {have.sha256}")
            return Placed(file.name, have.sha256, have.size, "kept")
        log(f"replacing {file.name}: {problem}")
        _remove(final, parent)
        action = "replaced"
    elif mode is not None and stat.S_ISLNK(mode):
        log(f"replacing {file.name}: a symbolic link, not a file")
        _remove(final, parent)
        action = "replaced"
    elif mode is not None:
        raise FillError(f"{file.name}: {final} exists and is not a regular file")

    started = time.monotonic()
    fd, temp = tempfile.mkstemp(dir=parent, prefix=f".{final.name}{PART_TAG}", suffix=PART_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as out:
            sink = _FileSink(out, file)
            source.fetch(file, sink)
            out.flush()
            os.fsync(out.fileno())
        problem = sink.hasher.mismatch()
        if problem is not None:
            raise FillError(f"{file.name}: refused: {problem}; the download was discarded, nothing is at {final}")
        os.chmod(temp, 0o644)  # mkstemp's 0600 would keep the file from a server running as another uid
        os.replace(temp, final)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    _fsync_dir(parent)
    hasher = sink.hasher
    log(f"{action} {file.name}: {hasher.size} bytes, sha256 {hasher.sha256}, {time.monotonic() - started:.1f} s")
    return Placed(file.name, hasher.sha256, hasher.size, action)


class _FileSink:
    """The temporary file and the hashes of what went into it; a retry starts both again."""

    def __init__(self, out: BinaryIO, file: RemoteFile) -> None:
        self.out, self.file = out, file
        self.hasher = Hasher(file.expected)

    def reset(self) -> None:
        self.out.seek(0)
        self.out.truncate()
        self.hasher = Hasher(self.file.expected)

    def write(self, data: bytes) -> None:
        self.out.write(data)
        self.hasher.update(data)


def _parent(directory: Path, name: str) -> Path:
    """The file's folder, made where missing; a component that is a link or a file is refused (it could lead out of
    the directory)."""
    folder = directory
    for part in name.split("/")[:-1]:
        folder = folder / part
        try:
            mode = os.lstat(folder).st_mode
        except FileNotFoundError:
            folder.mkdir()
            _fsync_dir(folder.parent)
            continue
        if not stat.S_ISDIR(mode):
            raise FillError(f"{name}: {folder} is in the way (a link or a file, not a folder)")
    return folder


def _remove_parts(directory: Path, log: Log) -> None:
    for root, _, names in os.walk(directory):
        for name in names:
            if name.startswith(".") and PART_TAG in name and name.endswith(PART_SUFFIX):
                os.unlink(os.path.join(root, name))
                log(f"removed {os.path.relpath(os.path.join(root, name), directory)}: left by an interrupted run")


def _remove(path: Path, parent: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        return
    _fsync_dir(parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(directory: Path, source: dict[str, Any], placed: list[Placed]) -> None:
    marker = {
        "source": source,
        "completed": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "files": {p.name: {"sha256": p.sha256, "size": p.size} for p in sorted(placed, key=lambda p: p.name)},
    }
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{MARKER}{PART_TAG}", suffix=PART_SUFFIX)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(marker, out, indent=2)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temp, 0o644)
        os.replace(temp, directory / MARKER)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
