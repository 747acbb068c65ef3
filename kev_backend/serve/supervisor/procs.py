"""The process table as /proc shows it: what the supervisor watches (Triton's Python stubs, their CPU time), what the
soak and the tests measure (tritonserver's and the stubs' memory), what the front-door measurement reads (their
threads' CPU time) and what the scale-out measurement kills (a server's whole tree). Linux only."""

from __future__ import annotations

import os
from pathlib import Path

STUB_COMM = "triton_python_b"  # the Python backend's triton_python_backend_stub, as /proc spells it (15 characters)


def stat_fields(pid: int, tid: int | None = None) -> tuple[str, list[str]] | None:
    """/proc/PID/stat (or one thread's, /proc/PID/task/TID/stat) as (comm, the fields after it: state, ppid, ...), or
    None once it is gone. comm may hold spaces and parentheses, so the fields start after its last ")"."""
    path = Path(f"/proc/{pid}/stat") if tid is None else Path(f"/proc/{pid}/task/{tid}/stat")
    try:
        text = path.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()


def proc_stat(pid: int) -> tuple[str, str, int] | None:
    """(comm, state, ppid) of a process, or None once it is gone. comm is at most 15 characters, as /proc spells it
    (triton_python_backend_stub is "triton_python_b")."""
    if (stat := stat_fields(pid)) is None:
        return None
    comm, rest = stat
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
    if (stat := stat_fields(pid)) is None:
        return None
    return used_seconds(stat[1])


def used_seconds(fields: list[str]) -> float:
    """utime + stime in seconds, from a stat's fields after comm (field 3, state, on)."""
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """Each live thread of `pid`: tid -> (its comm, the CPU seconds it has used)."""
    try:
        tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return {}
    threads = {}
    for tid in tids:
        if (stat := stat_fields(pid, tid)) is not None:
            threads[tid] = (stat[0], used_seconds(stat[1]))
    return threads


def process_start(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat's field 22); None if there is none."""
    stat = stat_fields(pid)
    return None if stat is None else int(stat[1][19])
