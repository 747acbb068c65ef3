"""Where one client's request spends its time, phase by phase, from Triton's own trace (TIMESTAMPS level) beside the
client's clock and the engine's `latency_ms` in each answer.

Triton's trace API is one of the restricted APIs: turning it on needs the admin key (kev-serve takes a chosen one from
TRITON_ADMIN_KEY_FILE) and a server started with a trace file, e.g. `build/serve.sh --trace-config
triton,file=/tmp/kev-trace.json --trace-config level=OFF --trace-config rate=1 --trace-config triton,log-frequency=1`
(every trace written as soon as it ends, to FILE.0, FILE.1, ...). Tracing is on for the model only while `traced` runs,
and the files it wrote are read and removed afterwards. Triton's and the client's timestamps are both CLOCK_MONOTONIC
(steady_clock; time.monotonic_ns), so the two sides line up on one machine.

The phases of a request (medians, ms); through the gateway, its own work is in to_triton and to_client:
  to_triton      client's call to Triton having read it (the client's encoding, gRPC, Triton's read)
  triton_queue   read to its execution starting (Triton's request handling, the batcher's queue)
  execute        the model's execute (the Python backend's IPC in, parsing, tokenizing, handing the batch over)
  in_model       execution start to the model's response complete (everything the model's process does for it)
  engine         the engine's model time (the answer's latency_ms): a part of in_model
  backend        in_model less the engine's time: the Python backend's own work and IPC around the engine
  to_sent        response complete to gRPC's send done (Triton encoding and writing the response)
  to_client      send done to the client's call returning (the network, the client decoding)
  total          the client's whole call
"""

from __future__ import annotations

import glob
import json
import os
import statistics
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

PHASES = ("to_triton", "triton_queue", "execute", "in_model", "engine", "backend", "to_sent", "to_client", "total")


class TritonTrace:
    """Triton's tracing for one model, through its gRPC trace API with the admin key."""

    def __init__(self, grpc_url: str, key_file: Path, model: str = "kev") -> None:
        self.grpc_url, self.model = grpc_url, model
        # Over gRPC, Triton reads a restricted protocol's key from "triton-grpc-protocol-<header>".
        self.headers = {"triton-grpc-protocol-admin-key": key_file.read_text().strip()}

    def _settings(self, level: str) -> dict:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            got = client.update_trace_settings(self.model, {"trace_level": [level]}, headers=self.headers, as_json=True)
        finally:
            client.close()
        return {key: value["value"] for key, value in got.get("settings", {}).items()}

    @contextmanager
    def traced(self) -> Iterator[list[dict[str, int]]]:
        """Traces every request of the model while the block runs; the list it gives is filled afterwards with one
        dict of Triton's timestamps (name: ns) per request traced."""
        settings = self._settings("TIMESTAMPS")
        (trace_file,) = settings.get("trace_file") or [""]
        if not trace_file:
            self._settings("OFF")
            raise RuntimeError("the server has no trace file: start it with --trace-config triton,file=FILE")
        for stale in glob.glob(f"{trace_file}*"):
            os.remove(stale)
        traces: list[dict[str, int]] = []
        try:
            yield traces
        finally:
            self._settings("OFF")
            traces.extend(read_traces(trace_file))


def read_traces(trace_file: str) -> list[dict[str, int]]:
    """Each request's timestamps from the trace files Triton wrote (FILE and FILE.N), by trace id; the files are
    removed once read."""
    by_id: dict[int, dict[str, int]] = {}
    for path in glob.glob(f"{trace_file}*"):
        try:
            events = json.loads(Path(path).read_text() or "[]")
        except json.JSONDecodeError:  # a file still being written: its traces are left out
            events = []
        for event in events:
            for stamp in event.get("timestamps", ()):
                by_id.setdefault(event["id"], {})[stamp["name"]] = stamp["ns"]
        os.remove(path)
    return [by_id[key] for key in sorted(by_id)]


def phases(calls: Iterable[tuple[int, int, float]], traces: list[dict[str, int]]) -> dict[str, float | int]:
    """Median milliseconds of each phase (PHASES) over the calls (client start ns, end ns, the answer's latency_ms)
    whose one trace started within them; `matched` says how many."""
    stamps = {"GRPC_WAITREAD_END", "COMPUTE_START", "COMPUTE_END", "INFER_RESPONSE_COMPLETE", "GRPC_SEND_END"}
    complete = [t for t in traces if stamps <= t.keys()]
    rows = []
    for start, end, engine_ms in calls:
        mine = [t for t in complete if start <= t["GRPC_WAITREAD_END"] <= end]
        if len(mine) != 1:
            continue
        t = mine[0]
        in_model = (t["INFER_RESPONSE_COMPLETE"] - t["COMPUTE_START"]) / 1e6
        rows.append({
            "to_triton": (t["GRPC_WAITREAD_END"] - start) / 1e6,
            "triton_queue": (t["COMPUTE_START"] - t["GRPC_WAITREAD_END"]) / 1e6,
            "execute": (t["COMPUTE_END"] - t["COMPUTE_START"]) / 1e6,
            "in_model": in_model,
            "engine": engine_ms,
            "backend": in_model - engine_ms,
            "to_sent": (t["GRPC_SEND_END"] - t["INFER_RESPONSE_COMPLETE"]) / 1e6,
            "to_client": (end - t["GRPC_SEND_END"]) / 1e6,
            "total": (end - start) / 1e6,
        })  # fmt: skip
    out: dict[str, float | int] = {"matched": len(rows)}
    if rows:
        out |= {phase: statistics.median(row[phase] for row in rows) for phase in PHASES}
    return out
