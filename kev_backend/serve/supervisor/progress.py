"""What kev-serve and the health check make of the model instances' heartbeats (kev_backend/serve/stub/heartbeat.py):
is an instance broken, hung, or busy with work that progresses.

kev-serve gives tritonserver KEV_HEARTBEAT_PREFIX = `heartbeat_prefix(its start's region prefix)`: each stub writes
`{prefix}{instance name}` in /dev/shm, removed with the start's other regions. An instance is
- broken: it says so (a CUDA error poisons its process): restart at once;
- hung: it holds jobs and its beats have not moved for the progress timeout: restart;
- busy: it holds jobs and its beats moved within the progress timeout. A busy model is not a failing one, however slow
  the probe's answer.

The heartbeat does not cover a batch's preparation (parsing, Kev's limits, tokenizing), which runs on Triton's
execute thread before the model takes the batch as a job: up to 64 requests of 4 MiB each, 2.3 s apiece with the
toy checkpoint's tokenizer on one core, so minutes with jobs 0 and no beat. A stub that keeps a CPU busy (at least
BUSY_CPU_SHARE of one core since the probe was sent) is working, not stuck; an idle stub answering the probe uses
about 1 %, a stopped or deadlocked one nothing.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..stub import heartbeat
from ..stub.heartbeat import Pulse
from . import procs
from .shm import SHM_DIR

HEARTBEAT = "heartbeat_"
# The share of one CPU a stub must have used over a probe's wait to count as working (see the module's docstring).
BUSY_CPU_SHARE = 0.1


def heartbeat_prefix(region_prefix: str) -> str:
    """Where a start's stubs write their heartbeats: inside the start's region prefix, so removing the start's
    regions removes them too."""
    return f"{SHM_DIR}/{region_prefix}{HEARTBEAT}"


@dataclass
class Seen:
    """One instance's last pulse, and when (monotonic) its beats were last seen to move: the first reading counts as a
    move, so an instance is never judged on a time before kev-serve looked."""

    pulse: Pulse
    moved: float


class Watch:
    """The heartbeats of one Triton start's instances, read by kev-serve every supervision step."""

    def __init__(self, prefix: str, progress_timeout_s: float, keep_s: float) -> None:
        self.prefix = prefix
        self.progress_timeout_s = progress_timeout_s
        self.keep_s = keep_s  # how far back `worked_since` may be asked
        self.seen: dict[str, Seen] = {}
        self.cpu: dict[int, deque[tuple[float, float]]] = {}  # stub pid -> (when, CPU seconds it had used)

    def observe(self, stubs: Mapping[int, str], now: float) -> None:
        """Reads the heartbeats of the stubs' instances (pid -> instance name) and the CPU time the stubs used. An
        instance without a heartbeat (not written yet, or a model that does not write it) is left unknown: no verdict
        either way."""
        for pid in stubs:
            if (used := procs.cpu_seconds(pid)) is not None:
                samples = self.cpu.setdefault(pid, deque())
                samples.append((now, used))
                while samples[0][0] < now - self.keep_s:
                    samples.popleft()
        for name in stubs.values():
            pulse = heartbeat.read(Path(f"{self.prefix}{name}"))
            if pulse is None:
                continue
            seen = self.seen.get(name)
            if seen is None or pulse.beats != seen.pulse.beats:
                self.seen[name] = Seen(pulse, now)
            else:
                seen.pulse = pulse

    def broken(self) -> list[str]:
        return [name for name, seen in self.seen.items() if seen.pulse.broken]

    def hung(self, now: float) -> list[str]:
        """Instances holding jobs whose beats have not moved for the progress timeout, described."""
        return [
            f"{name} holds {seen.pulse.jobs} job(s) and its beats have not moved for {now - seen.moved:.0f} s"
            for name, seen in self.seen.items()
            if seen.pulse.jobs and now - seen.moved >= self.progress_timeout_s
        ]

    def busy(self, now: float) -> bool:
        """An instance holds jobs and its beats moved within the progress timeout: a unit of work is under way."""
        return any(seen.pulse.jobs and now - seen.moved < self.progress_timeout_s for seen in self.seen.values())

    def moved_since(self, since: float) -> bool:
        """Some instance's beats moved at or after `since` (it took, advanced or answered a batch)."""
        return any(seen.moved >= since for seen in self.seen.values())

    def worked_since(self, since: float) -> bool:
        """A stub kept at least BUSY_CPU_SHARE of a CPU busy from `since` (its sample at or just before it, else its
        first) to its last sample."""
        return any(worked(samples, since) for samples in self.cpu.values())


def worked(samples: deque[tuple[float, float]], since: float) -> bool:
    """(when, CPU seconds used) samples of one process: it used at least BUSY_CPU_SHARE of a CPU since `since`."""
    before = [sample for sample in samples if sample[0] <= since] or list(samples)[:1]
    if not before:
        return False
    (start, used), (end, now_used) = before[-1], samples[-1]
    return end > start and now_used - used >= BUSY_CPU_SHARE * (end - start)


def pulses_on_disk(prefix: str) -> dict[str, tuple[Pulse, float]]:
    """Every heartbeat under `prefix` with the seconds since it was last written (its mtime: every write but a
    `broken` one moves the beats), for a one-shot reader such as the health check."""
    found = {}
    for path in Path(prefix).parent.glob(f"{Path(prefix).name}*"):
        pulse = heartbeat.read(path)
        try:
            age = max(0.0, time.time() - path.stat().st_mtime)
        except OSError:
            continue
        if pulse is not None:
            found[path.name[len(Path(prefix).name) :]] = (pulse, age)
    return found


@dataclass(frozen=True)
class Served:
    """A running tritonserver that kev-serve started: its pid and its stubs' heartbeat prefix."""

    pid: int
    prefix: str

    def stubs_cpu_seconds(self) -> float:
        """CPU time its Python stubs have used so far."""
        stubs = [pid for pid, comm in procs.children(self.pid).items() if comm == procs.STUB_COMM]
        return sum(procs.cpu_seconds(pid) or 0.0 for pid in stubs)


def served(grpc_port: int) -> Served | None:
    """The tritonserver serving gRPC on `grpc_port`, found by the argv kev-serve gives it (--grpc-port and the Python
    backend's shm-region-prefix-name); None when there is none to be found (another user's, or started by hand)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if not argv or os.path.basename(argv[0]) != "tritonserver" or f"--grpc-port={grpc_port}" not in argv:
            continue
        for arg in argv:
            _, found, region_prefix = arg.partition("shm-region-prefix-name=")
            if found and region_prefix:
                return Served(int(entry.name), heartbeat_prefix(region_prefix))
    return None
