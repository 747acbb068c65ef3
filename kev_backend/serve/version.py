"""This project's version as installed (pyproject.toml's), for every command's `--version`."""

from __future__ import annotations

from importlib import metadata


def version() -> str:
    try:
        return metadata.version("kev-backend")
    except metadata.PackageNotFoundError:  # run from a tree that was never installed
        return "unknown"


def version_line(command: str) -> str:
    return f"{command} (kev-backend) {version()}"
