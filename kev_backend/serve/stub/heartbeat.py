"""The model's progress signal to kev-serve: a busy server is not a dead one.

Each model instance (a Python stub) keeps a small file, `{KEV_HEARTBEAT_PREFIX}{instance name}`, in shared memory
(kev-serve names it with its start's region prefix, so it is removed with the start's other regions). The stub writes
one record whenever its state changes:

- `beats`: units of model work completed so far (a layer of a chunk on the CPU reference path, a pass on the GPU),
  and batches taken or answered;
- `jobs`: batches in the model's hands and not yet answered (0: idle);
- `broken`: 1 once the engine can no longer answer (a CUDA error poisons the process's context): only a restart
  helps, and kev-serve restarts at once.

kev-serve reads it (`read`): an instance with jobs whose `beats` have not moved for KEV_PROGRESS_TIMEOUT_S has hung;
one whose beats move is busy, however slow the probe's answer. Without KEV_HEARTBEAT_PREFIX (tritonserver started by
hand) nothing is written.
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

RECORD = struct.Struct("<QQQ")  # beats, jobs, broken


@dataclass(frozen=True)
class Pulse:
    beats: int
    jobs: int
    broken: bool


class Heartbeat:
    """The writer, in the stub: every call writes the whole record at offset 0 (one pwrite of 24 bytes)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.beats = self.jobs = 0
        self.is_broken = False
        self.lock = threading.Lock()
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) if path is not None else None
        self._write()

    @classmethod
    def for_instance(cls, prefix: str | None, instance: str) -> Heartbeat:
        """The heartbeat of model instance `instance` (Triton's name, e.g. kev_0_0) under kev-serve's `prefix`
        (ModelSettings.heartbeat_prefix); None: nothing is written."""
        return cls(Path(f"{prefix}{instance}") if prefix else None)

    def beat(self) -> None:
        with self.lock:
            self.beats += 1
            self._write()

    def started(self) -> None:
        with self.lock:
            self.beats += 1
            self.jobs += 1
            self._write()

    def finished(self) -> None:
        with self.lock:
            self.beats += 1
            self.jobs = max(0, self.jobs - 1)
            self._write()

    def broken(self) -> None:
        with self.lock:
            self.is_broken = True
            self._write()

    def _write(self) -> None:
        if self.fd is not None:
            os.pwrite(self.fd, RECORD.pack(self.beats, self.jobs, int(self.is_broken)), 0)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read(path: Path) -> Pulse | None:
    """An instance's last record; None when there is none (yet) or it cannot be read."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < RECORD.size:
        return None
    beats, jobs, broken = RECORD.unpack_from(data)
    return Pulse(beats, jobs, bool(broken))
