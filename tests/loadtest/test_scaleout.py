"""loadtest/scaleout.py end to end on CPUs: two real tritonservers (tiny model, each its own state bank) behind the real
Envoy that kev_backend.serve.router configures, against one; the repeated-state mix with and without affinity, a
server killed mid-run, and the comparison the GPU run writes (bench/gpu.sh scaleout runs the same on one server per
GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "loadtest" / "scaleout.py"
MIX_CLIENTS = 8


def run(tiny_dir: Path, servers: int, out: Path) -> dict:
    subprocess.run(
        [sys.executable, str(SCRIPT), "run", "--checkpoint", str(tiny_dir / "kev"), "--servers", str(servers),
         "--clients", "4,8", "--mix-clients", str(MIX_CLIENTS), "--seconds", "5", "--procs", "2", "--out", str(out)],
        cwd=REPO, check=True, timeout=400,
    )  # fmt: skip
    return json.loads(out.read_text())


def check_mix(record: dict) -> None:
    """With affinity a repeated state is mostly answered without being computed again. Not always: a repeat sent
    while its state's first request is still being computed computes it again, and with few clients the router's
    bounded load (no server over 1.5x the mean of requests in flight) often sends a request to the other server."""
    for clients, figures in record["throughput"].items():
        assert figures["errors"] == 0 and figures["rps"] > 0, (clients, figures)
    affinity = record["mix"]["affinity"]
    assert affinity["errors"] == 0 and affinity["repeated_states"] > 10, affinity
    assert affinity["repeats_answered"] >= 0.75, affinity
    for mix in record["mix"].values():  # the requests not computed, all of them repeats, over the repeats
        answered = mix["hit_rate"] * mix["requests"] / mix["repeated_states"]
        assert mix["repeats_answered"] == pytest.approx(min(1.0, answered)), mix


def test_servers_behind_the_router_against_one(tiny_dir: Path, tmp_path: Path) -> None:
    two = run(tiny_dir, 2, tmp_path / "two.json")
    assert two["servers"] == 2 and two["gpus"] == [] and two["gpu"] == "cpu"
    check_mix(two)
    # Without affinity a repeated state reaches the server that banked it only by chance. Compared per repeated
    # request: the share of repeats differs from run to run (0.42-0.54 of requests in five runs at these settings),
    # which moved the hit rate over all requests more than affinity did.
    assert two["mix"]["no_affinity"]["repeats_answered"] < two["mix"]["affinity"]["repeats_answered"], two["mix"]
    lost = two["failover"]
    # Only requests in flight on the killed server fail; the rest, its states included, are answered by the other.
    assert 0 < lost["errors_after_kill"] <= MIX_CLIENTS and lost["errors"] == lost["errors_after_kill"], lost
    assert lost["answered_before_kill"] > 0 and lost["answered_after_kill"] > 0, lost
    assert lost["last_error_after_kill_s"] < 5 and lost["router_ejected_after_s"] < 5, lost
    timeline = lost["timeline"]
    last_second = slice(-int(1 / timeline["bucket_s"]), None)
    assert sum(timeline["answered"][last_second]) > 0 and sum(timeline["errors"][last_second]) == 0, timeline

    one = run(tiny_dir, 1, tmp_path / "one.json")
    assert one["servers"] == 1 and "failover" not in one
    check_mix(one)

    out = tmp_path / "scaleout.json"
    runs = [str(tmp_path / "one.json"), str(tmp_path / "two.json")]
    subprocess.run(
        [sys.executable, str(SCRIPT), "report", "--out", str(out), *runs],
        cwd=REPO, check=True, timeout=120,
    )  # fmt: skip
    record = json.loads(out.read_text())
    assert record["gpus"] == 2 and record["one_gpu"] == one and record["several_gpus"] == two
    best = str(record["speedup_clients"])
    assert best == max(two["throughput"], key=lambda c: two["throughput"][c]["rps"])
    assert record["speedup"] == two["throughput"][best]["rps"] / one["throughput"][best]["rps"]
    # p50 against one server at the clients a server (8 over two against 4 over one), where it was measured
    alike = one["throughput"].get(str(int(best) // 2), one["throughput"][best])
    assert record["p50_ratio"] == two["throughput"][best]["p50_ms"] / alike["p50_ms"]
    assert record["hit_rate_one_gpu"] == one["mix"]["affinity"]["hit_rate"]
    assert (record["hit_rate_affinity"], record["hit_rate_no_affinity"]) == (
        two["mix"]["affinity"]["hit_rate"], two["mix"]["no_affinity"]["hit_rate"]
    )  # fmt: skip
    assert record["repeats_answered_one_gpu"] == one["mix"]["affinity"]["repeats_answered"]
    assert (record["repeats_answered_affinity"], record["repeats_answered_no_affinity"]) == (
        two["mix"]["affinity"]["repeats_answered"], two["mix"]["no_affinity"]["repeats_answered"]
    )  # fmt: skip
    assert out.with_suffix(".png").stat().st_size > 10_000
