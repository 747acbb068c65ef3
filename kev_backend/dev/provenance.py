"""What a result file names: its commit (the one given, since a copy of the tree without its git history, e.g. on a
GPU machine, is told with `--commit`; else git's HEAD of this checkout) and its GPU (nvidia-smi's; "cpu" without)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NVIDIA_SMI_TIMEOUT_S = 10.0


def commit(given: str | None = None) -> str:
    """The commit `given` (a name git resolves in this checkout, e.g. HEAD, becomes its hash; otherwise as given), or
    this checkout's HEAD."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", f"{given or 'HEAD'}^{{commit}}"],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return given or "unknown"
    return done.stdout.strip()


def nvidia_smi(query: str) -> list[str]:
    """One line per GPU of `nvidia-smi --query-gpu=QUERY`; empty without nvidia-smi or when it fails."""
    if shutil.which("nvidia-smi") is None:
        return []
    command = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def gpu_name() -> str:
    names = nvidia_smi("name")
    return names[0] if names else "cpu"
