"""Recovery, shutdown and a soak on a running `make serve` (build/serve.sh, the supervisor): writes one JSON.

    python bench/hardening.py --serve-pid PID --soak-minutes 6 --rate 100 --out DIR

With the server ready: a soak (loadtest/soak.py: the realistic mix through gRPC and the gateway with bad inputs and
departing clients mixed in), then the Python stub killed (kill -9) and the time until a request is answered again,
then SIGTERM to the supervisor and the time until it exited, and the shared-memory regions it left (none expected).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kev_backend.dev.provenance import commit, gpu_name
from kev_backend.dev.workloads import short6
from kev_backend.serve.client import KevClient, KevError
from kev_backend.serve.supervisor.procs import descendant_named

REPO = Path(__file__).resolve().parents[1]


def answers(url: str, timeout_s: float = 5.0) -> bool:
    try:
        with KevClient(url, timeout_s=timeout_s) as kev:
            kev.score(short6(int(time.time() * 1000)))
        return True
    except (KevError, OSError, Exception):  # noqa: BLE001 - any failure means "not answering yet"
        return False


def wait_answering(url: str, deadline_s: float) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        if answers(url):
            return time.monotonic() - started
        time.sleep(0.2)
    return None


def shm_regions() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob("kev_serve_*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-pid", type=int, required=True, help="the supervisor's pid (build/serve.sh)")
    parser.add_argument("--grpc", default="127.0.0.1:8001")
    parser.add_argument("--gateway", default="http://127.0.0.1:8009")
    parser.add_argument("--soak-minutes", type=float, default=0.0)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--shape", default="mix")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", help="the commit the record names (default: git's HEAD)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    record: dict = {
        "gpu": gpu_name(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(args.commit),
    }
    if wait_answering(args.grpc, 600) is None:
        sys.exit("the server never answered")
    triton = descendant_named(args.serve_pid, "tritonserver")
    if args.soak_minutes > 0 and triton is not None:
        soak = subprocess.run(
            [sys.executable, str(REPO / "loadtest" / "soak.py"), "--triton-grpc", args.grpc, "--gateway", args.gateway,
             "--minutes", str(args.soak_minutes), "--rate", str(args.rate), "--shape", args.shape,
             "--server-pid", str(triton), "--out", str(args.out), "--commit", record["commit"]],
            check=False,
        )  # fmt: skip
        record["soak_exit_code"] = soak.returncode
        soak_json = args.out / "soak.json"
        if soak_json.exists():
            record["soak"] = json.loads(soak_json.read_text())["soak"]
            record["soak"].pop("samples", None)
    stub = descendant_named(args.serve_pid, "triton_python_backend_stub")
    if stub is None:
        sys.exit("no Python stub found under the supervisor")
    os.kill(stub, signal.SIGKILL)
    killed = time.monotonic()
    time.sleep(0.5)
    recovered = wait_answering(args.grpc, 300)
    record["kill_to_answer_s"] = None if recovered is None else round(time.monotonic() - killed, 2)
    record["new_stub"] = descendant_named(args.serve_pid, "triton_python_backend_stub") not in (None, stub)
    os.kill(args.serve_pid, signal.SIGTERM)
    stopping = time.monotonic()
    while time.monotonic() - stopping < 30:
        try:
            os.kill(args.serve_pid, 0)
        except ProcessLookupError:
            break
        try:  # our own child when this script started the server; reap it so it stops existing
            if os.waitpid(args.serve_pid, os.WNOHANG)[0]:
                break
        except ChildProcessError:
            pass
        time.sleep(0.05)
    record["shutdown_s"] = round(time.monotonic() - stopping, 2)
    record["shm_regions_left"] = shm_regions()
    (args.out / "hardening.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "soak"}))
    if "soak" in record:
        soak = record["soak"]
        print(f"soak: {soak.get('minutes')} min, {soak.get('requests')} requests, {soak.get('unexpected_errors')} "
              f"unexpected errors; growth {soak.get('growth')}")  # fmt: skip


if __name__ == "__main__":
    main()
