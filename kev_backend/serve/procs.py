"""The process table as /proc shows it: what the supervisor watches (Triton's Python stubs), what the soak and the
tests measure (tritonserver's and the stubs' memory) and what the scale-out measurement kills (a server's whole
tree). Linux only."""

from __future__ import annotations

import os
from pathlib import Path

STUB_COMM = "triton_python_b"  # the Python backend's triton_python_backend_stub, as /proc spells it (15 characters)


def proc_stat(pid: int) -> tuple[str, str, int] | None:
    """(comm, state, ppid) of a process, or None once it is gone. comm is at most 15 characters, as /proc spells it
    (triton_python_backend_stub is "triton_python_b")."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    comm, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
    return comm, rest[0], int(rest[1])


def children(parent: int, zombies: bool = False) -> dict[int, str]:
    """pid -> comm of `parent`'s children (zombies too when asked: a child that died but is not reaped yet)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := proc_stat(int(entry))) is not None and stat[2] == parent:
            if zombies or stat[1] != "Z":
                found[int(entry)] = stat[0]
    return found


def descendant_named(root: int, comm: str) -> int | None:
    """The first live process below `root` (breadth first) whose comm is `comm` (cut to /proc's 15 characters)."""
    frontier = [root]
    while frontier:
        below = [(pid, name) for parent in frontier for pid, name in children(parent).items()]
        for pid, name in below:
            if name == comm[:15]:
                return pid
        frontier = [pid for pid, _ in below]
    return None


def descendants(root: int) -> list[int]:
    """Every live process below `root`, breadth first."""
    found, frontier = [], [root]
    while frontier:
        frontier = [pid for parent in frontier for pid in children(parent)]
        found.extend(frontier)
    return found


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """CPU time a process has used so far, all its threads, user and system (/proc/PID/stat's utime and stime); None
    once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # from field 3 (state) on
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
