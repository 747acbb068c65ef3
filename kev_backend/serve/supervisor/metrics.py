"""kev-serve's state for Prometheus: restarts by process and cause, and whether Triton is ready.

kev-serve writes it, as a small JSON file, beside the heartbeats of Triton's current start (in /dev/shm, named with
the start's region prefix, so it goes with the start's other regions); one of that start's Python stubs reads it and
publishes `kev_serve_restarts_total{process,cause}` and `kev_serve_ready` on Triton's metrics port
(kev_backend/serve/stub/metrics.py, SupervisorMetrics). That port is the one Prometheus already scrapes on every
Triton pod, where kev-serve runs without its gateway: no port of kev-serve's own to open, secure or declare. What
it cannot show is the outage itself (no Triton, nothing scraped): the alerts read an absent kev_serve_ready as not
ready, and the restart is counted once the new start serves, the totals being kev-serve's own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..stub.metrics import RESTART_CAUSES, supervisor_state_path


class ServeState:
    """The counts and the readiness; `write` puts them where the current start's stubs read them."""

    def __init__(self) -> None:
        self.restarts = {process: dict.fromkeys(causes, 0) for process, causes in RESTART_CAUSES.items()}
        self.ready = False
        self.path: Path | None = None
        self.written: str | None = None  # what the file holds, so an unchanged state is not written again

    def restarted(self, process: str, cause: str) -> None:
        assert cause in self.restarts[process], (process, cause)
        self.restarts[process][cause] += 1
        self.write()

    def set_ready(self, ready: bool) -> None:
        if ready != self.ready:
            self.ready = ready
            self.write()

    def start(self, heartbeat_prefix: str) -> None:
        """A new start of Triton: its stubs read the state beside their heartbeats."""
        self.path, self.written = supervisor_state_path(heartbeat_prefix), None
        self.write()

    def stop(self) -> None:
        """The start's Triton stopped (its regions, this file with them, are removed next): nothing is written until
        the next start, which gets the whole state."""
        self.path = None

    def write(self) -> None:
        """Replaces the file whole (a reader sees the old state or the new, never a part); a failure to write (no
        shared memory left) costs only the metrics."""
        text = json.dumps({"ready": self.ready, "restarts": self.restarts}, sort_keys=True)
        if self.path is None or text == self.written:
            return
        partial = self.path.with_name(f"{self.path.name}.new")  # same prefix: removed with the start if left
        try:
            partial.write_text(text)
            os.replace(partial, self.path)
        except OSError:
            return
        self.written = text
