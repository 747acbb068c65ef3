"""Rewrites a Triton model config for bench/gpu.sh batcher's sweep: the dynamic batcher's delay and the number of
model instances. Each setting must stand on exactly one line; a trailing comment stays.
    python bench/batcher_config.py CONFIG DELAY_US [INSTANCES]"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def _set_one(text: str, pattern: str, value: int, what: str) -> str:
    updated, count = re.subn(pattern, lambda m: f"{m.group(1)}{value}{m.group(2)}", text, flags=re.MULTILINE)
    if count != 1:
        raise ValueError(f"expected one {what} line, found {count}")
    return updated


def set_queue_delay(text: str, delay_us: int) -> str:
    return _set_one(
        text, r"^(\s*max_queue_delay_microseconds:\s*)\d+(\s*(?:#.*)?)$", delay_us, "max_queue_delay_microseconds"
    )


def set_instance_count(text: str, count: int) -> str:
    """The instance group's count: several instances on one GPU, each a process with its own weights, bank and
    graphs, can overlap one batch's Python work with another's GPU work."""
    return _set_one(text, r"^(\s*\{ kind: KIND_GPU, count: )\d+(\s*\}.*)$", count, "KIND_GPU instance group")


if __name__ == "__main__":
    path = Path(sys.argv[1])
    text = set_queue_delay(path.read_text(), int(sys.argv[2]))
    if len(sys.argv) > 3:
        text = set_instance_count(text, int(sys.argv[3]))
    path.write_text(text)
