"""Sets `max_queue_delay_microseconds` in a Triton model config (bench/gpu_batcher.sh's sweep): exactly one such
line must be there.
    python bench/set_queue_delay.py CONFIG DELAY_US"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def set_queue_delay(text: str, delay_us: int) -> str:
    pattern = re.compile(r"^(\s*max_queue_delay_microseconds:\s*)\d+(\s*(?:#.*)?)$", re.MULTILINE)
    updated, count = pattern.subn(lambda m: f"{m.group(1)}{delay_us}{m.group(2)}", text)
    if count != 1:
        raise ValueError(f"expected one max_queue_delay_microseconds line, found {count}")
    return updated


if __name__ == "__main__":
    path = Path(sys.argv[1])
    path.write_text(set_queue_delay(path.read_text(), int(sys.argv[2])))
