"""The processes kev-serve runs (tritonserver, the gateway): each started in its own process group, killed with the
supervisor whatever kills it, stopped with a deadline; the environment they get; the Python stubs tritonserver
starts; and the shared-memory regions of each start, named so that the next start (or the next supervisor) can
remove what a killed one left."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ...settings import REPO, ServeSettings, use_cuda_allocator
from . import procs
from .shm import SHM_DIR

# Every region of a start is named f"{SHM_PREFIX}{supervisor pid}_{its start time}_{start number}_<uuid>" (the
# Python backend adds the uuid; the stubs' heartbeats end in heartbeat_<instance> instead), so a start's regions,
# this supervisor's, and those of a supervisor no longer running can be found. The start time tells a supervisor
# from an earlier one with the same pid: in a container the supervisor has the same pid every time the container
# starts, and /dev/shm may outlive a container (a pod's).
SHM_PREFIX = "kev_serve_"
# Run in place of each child before it execs its command: SIGKILL when the supervisor dies, whatever kills it, so a
# killed supervisor leaves no server holding its ports (PR_SET_PDEATHSIG survives exec; 1 = PR_SET_PDEATHSIG).
PDEATHSIG_EXEC = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def supervisor_prefix(supervisor_pid: int) -> str:
    return f"{SHM_PREFIX}{supervisor_pid}_{procs.process_start(supervisor_pid)}_"


def shm_prefix(supervisor_pid: int, start: int) -> str:
    return f"{supervisor_prefix(supervisor_pid)}{start}_"


def remove_shm(prefix: str) -> list[str]:
    """Removes the shared-memory regions whose names start with `prefix`; their names."""
    removed = []
    for path in SHM_DIR.glob(f"{prefix}*"):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    return removed


def remove_stale_shm() -> list[str]:
    """Regions of this user left by supervisors no longer running (one killed by SIGKILL cannot clean up): their pid
    gone, or now another process's (another start time). Unlinking a region a process still maps is safe: the memory
    lives until it is unmapped."""
    removed = []
    for path in SHM_DIR.glob(f"{SHM_PREFIX}*"):
        match = re.match(rf"{SHM_PREFIX}(\d+)_(\d+)_", path.name)
        try:
            if not match or path.stat().st_uid != os.getuid():
                continue
            if procs.process_start(int(match[1])) == int(match[2]):  # its supervisor still runs
                continue
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    return removed


def python_stubs(parent: int) -> dict[int, str]:
    """The Python backend's stub processes of tritonserver `parent`: pid -> instance name (e.g. kev_0_0)."""
    stubs = {}
    # A zombie is kept: a stub that died before this scan is found dead by the watch at once.
    for pid, comm in procs.children(parent, zombies=True).items():
        if comm != procs.STUB_COMM:
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # The stub's argv ends with "<instance name> <runtime>" (then an empty string after the last NUL).
        stubs[pid] = argv[-3].decode(errors="replace") if len(argv) >= 3 else "?"
    return stubs


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Child:
    """A child process in its own process group (which its own children share: Triton's stubs), so terminal
    signals reach only the supervisor and SIGKILL of the group leaves nothing behind."""

    def __init__(self, name: str, command: list[str], env: dict[str, str]) -> None:
        self.name = name
        launcher = [sys.executable, "-I", "-S", "-c", PDEATHSIG_EXEC, str(os.getpid())]
        self.process = subprocess.Popen([*launcher, *command], env=env, stdin=subprocess.DEVNULL, process_group=0)
        self.pid = self.process.pid
        self.started = time.monotonic()

    def exited(self) -> bool:
        """True once the process has exited. It is not reaped here: its pid, and so its process group id, stays
        reserved until `reap`, so `kill_group` can never reach an unrelated group that reused the number."""
        if self.process.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def terminate(self) -> None:
        if not self.exited():
            os.kill(self.pid, signal.SIGTERM)

    def kill_group(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def reap(self) -> int:
        """SIGKILL to what is left of the group (a stub outlives a killed tritonserver by ~2 s), then the exit code."""
        if self.process.returncode is not None:
            return self.process.returncode
        self.kill_group()
        return self.process.wait()


def stop_children(children: list[Child], deadline: float, hurry: Callable[[], bool]) -> list[str]:
    """SIGTERM to each, SIGKILL to the groups of those still running at `deadline` (or once `hurry()`); the names of
    those killed (none: all exited on their own)."""
    for child in children:
        child.terminate()
    while not all(child.exited() for child in children) and time.monotonic() < deadline and not hurry():
        time.sleep(0.02)
    killed = [child.name for child in children if not child.exited()]
    for child in children:
        child.reap()
    return killed


def child_env(env: dict[str, str], config: ServeSettings) -> dict[str, str]:
    env = dict(env)
    env.pop("TRITON_ADMIN_KEY", None)  # the children have no use for it
    env["KEV_VENV"] = str(config.venv)  # the stub's environment (build/tritonserver.sh)
    # Triton-language kernels compile once per shape class; keep them for the next start. TRITON_CACHE_AUTOTUNING=1
    # keeps autotuned kernels' results there too.
    env.setdefault("TRITON_CACHE_DIR", str(REPO / "build" / ".triton-cache"))
    env.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    # Expandable segments (settings.CUDA_ALLOCATOR). The host's malloc is chosen at start (allocator.py); glibc's
    # arenas are left at their default: MALLOC_ARENA_MAX=2 flattens the processes' RSS but costs about 30 % of the
    # throughput at 64 clients (docs/operations.md).
    use_cuda_allocator(env)
    return env
