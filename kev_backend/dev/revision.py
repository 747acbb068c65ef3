"""The commit a result file names: the one given (a copy of the tree without its git history, e.g. on a GPU machine,
is told with `--commit`), else git's HEAD of this checkout."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def commit(given: str | None = None) -> str:
    if given:
        return given
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=REPO, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip()
