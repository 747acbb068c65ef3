"""The load-test tools run for real, briefly, against the real stack: Locust (every user class) and the open-loop
driver, with their outputs checked."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kev_backend.dev.workloads import Traffic, jevbench_cases
from tests.conftest import REPO, Gateway, TritonServer, start_gateway, start_triton, stop_gateway, stop_triton


def test_traffic_shapes_and_repeat_share() -> None:
    assert len(jevbench_cases()) == 240
    for shape in Traffic.SHAPES:
        stream = Traffic(shape, repeat=0.5, seed=3)
        states = [json.dumps(stream.next()["state"]) for _ in range(400)]
        repeated = sum(1 for i, s in enumerate(states) if s in states[:i])
        assert 0.35 < repeated / len(states) < 0.65
    same = Traffic("short6", repeat=1.0)
    assert len({same.next()["state"] for _ in range(10)}) == 1
    new = Traffic("long5", repeat=0.0)
    assert len({new.next()["state"] for _ in range(10)}) == 10

    # Two mix streams with the same seed and numbers apart share no state; from the same numbers they would.
    def mix_states(numbered_from: int) -> set[str]:
        stream = Traffic("mix", seed=1, numbered_from=numbered_from)
        return {json.dumps(stream.next()["state"]) for _ in range(50)}

    assert mix_states(0) == mix_states(0) and not mix_states(0) & mix_states(10**7)


def test_traffic_repeats_only_its_recent_states() -> None:
    """A stream keeps what `repeat` draws from only with repeat > 0, and only its last HISTORY_KEEP new states: a
    repeat is always one of those (a driver running for hours holds a bounded number)."""

    class Recent(Traffic):
        HISTORY_KEEP = 5

    for shape in ("grow", "mix"):
        never = Recent(shape, repeat=0.0, seed=4)
        [never.next() for _ in range(50)]
        assert not never.history
        stream, sent, repeats = Recent(shape, repeat=0.5, seed=4), [], 0
        for _ in range(300):
            state = json.dumps(stream.next()["state"])
            if state in sent:
                assert state in sent[-Recent.HISTORY_KEEP :]
                repeats += 1
            else:
                sent.append(state)
        assert len(stream.history) == Recent.HISTORY_KEEP and 100 < repeats < 200


def test_locust_users(triton: TritonServer, tmp_path: Path) -> None:
    gateway = start_gateway(triton, tmp_path / "gateway.log")
    try:
        command = [
            str(Path(sys.prefix) / "bin" / "locust"),
            "-f",
            str(REPO / "loadtest" / "kev.py"),
            "TritonGrpcUser",
            "TritonHttpUser",
            "GatewayUser",
            "--headless",
            "-u",
            "6",
            "-r",
            "6",
            # gevent's clock starts before the locustfile is imported, so the import's time comes off the 5 s: the
            # locustfile must not import torch (dev.workloads stays torch-free), or a user class may send nothing.
            "-t",
            "5s",
            # Requests in flight at the 5 s mark finish and count (the mix's long states take seconds on the CPU
            # model, and a user class whose only request was cut off there had no row: seen in CI)
            "--stop-timeout",
            "60",
            "--shape",
            "mix",
            "--repeat",
            "0.3",
            "--triton-grpc",
            triton.grpc_url,
            "--triton-http",
            triton.http_url,
            "--host",
            gateway.url,
            "--csv",
            str(tmp_path / "kev"),
            "--only-summary",
        ]
        result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True)
    finally:
        stop_gateway(gateway)
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader((tmp_path / "kev_stats.csv").open())}
    for kind in ("grpc", "http", "POST"):
        assert (kind, "mix") in rows, (list(rows), result.stderr[-4000:])
        row = rows[(kind, "mix")]
        assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, row


# Each user class of loadtest/kev.py and the Type its rows have in locust's stats.
LOCUST_USERS = {"TritonGrpcUser": "grpc", "TritonHttpUser": "http", "GatewayUser": "POST"}


def locust_command(triton: TritonServer, gateway: Gateway | None, out: Path, users: list[str], *options: str) -> list:
    host = ["--host", gateway.url] if gateway else []
    return [
        str(Path(sys.prefix) / "bin" / "locust"),
        "-f",
        str(REPO / "loadtest" / "kev.py"),
        *users,
        "--headless",
        "--triton-grpc",
        triton.grpc_url,
        "--triton-http",
        triton.http_url,
        *host,
        "--csv",
        str(out / "kev"),
        *options,
    ]


def locust_rows(out: Path) -> dict[str, dict[str, str]]:
    """kev_stats.csv's rows by Type (locust rewrites the file in place while it runs: a torn read is no rows)."""
    try:
        rows = list(csv.DictReader((out / "kev_stats.csv").open()))
        return {r["Type"]: r for r in rows if r["Name"] != "Aggregated" and r["Request Count"].isdigit()}
    except (OSError, KeyError, csv.Error):
        return {}


@pytest.mark.parametrize("user", list(LOCUST_USERS))
def test_locust_user_exits_when_the_run_ends(triton: TritonServer, tmp_path: Path, user: str) -> None:
    """The new user's command (`-t`, no --stop-timeout), each user class alone: locust exits by itself. With gRPC it
    once printed its summary and hung for good about one run in five (the channels closed twice, the second time at
    interpreter exit: loadtest/kev.py's `close` says why); 60 s bounds "exits at all", not speed."""
    gateway = start_gateway(triton, tmp_path / "gateway.log") if user == "GatewayUser" else None
    try:
        command = locust_command(triton, gateway, tmp_path, [user], "-u", "2", "-r", "2", "-t", "5s")
        try:
            result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{user}: locust did not exit within 60 s of a 5 s run:\n{(e.stderr or b'')[-3000:]!r}")
    finally:
        if gateway:
            stop_gateway(gateway)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Shutting down (exit code 0)" in result.stderr, result.stderr[-4000:]
    row = locust_rows(tmp_path).get(LOCUST_USERS[user])
    assert row and int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, (row, result.stderr[-4000:])


def test_locust_exits_on_sigterm(triton: TritonServer, tmp_path: Path) -> None:
    """SIGTERM mid-run, every user class at once with requests flowing: locust stops the users, closes their clients,
    prints its summary and exits 0; no request counts as failed (stopped first, no user's call is cut off by its
    channel closing)."""
    gateway = start_gateway(triton, tmp_path / "gateway.log")
    log = tmp_path / "locust.log"
    try:
        command = locust_command(triton, gateway, tmp_path, list(LOCUST_USERS), "-u", "3", "-r", "3", "-t", "300s")
        with log.open("wb") as handle:
            process = subprocess.Popen(command, cwd=tmp_path, stdout=handle, stderr=subprocess.STDOUT)
        try:
            # Mid-run: every user class has answers in the CSV (locust flushes it every 5 s).
            deadline = time.monotonic() + 90
            while len(locust_rows(tmp_path)) < len(LOCUST_USERS) and time.monotonic() < deadline:
                assert process.poll() is None, log.read_text()[-4000:]
                time.sleep(0.5)
            assert len(locust_rows(tmp_path)) == len(LOCUST_USERS), log.read_text()[-4000:]
            process.send_signal(signal.SIGTERM)
            try:
                returncode = process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"locust did not exit within 60 s of SIGTERM:\n{log.read_text()[-3000:]}")
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    finally:
        stop_gateway(gateway)
    output = log.read_text()
    assert returncode == 0 and "Got SIGTERM signal" in output, output[-4000:]
    rows = locust_rows(tmp_path)
    for kind in LOCUST_USERS.values():
        row = rows.get(kind)
        assert row and int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, (kind, row, output[-4000:])


def test_locust_closes_each_grpc_channel_once(tmp_path: Path) -> None:
    """The hang's cause, deterministically: tritonclient's client closes its gRPC channel again when collected, and
    under grpc's gevent mode that second close, at interpreter exit, could block forever on a mutex a finished thread
    left held. loadtest/kev.py's `close` leaves the collected client nothing to close: one count-off per channel."""
    script = f"""
import gc, importlib.util
spec = importlib.util.spec_from_file_location("kev_locustfile", {str(REPO / "loadtest" / "kev.py")!r})
kev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kev)
from grpc._cython import cygrpc
closes = []
count_off = cygrpc.gevent_decrement_channel_count
cygrpc.gevent_decrement_channel_count = lambda: (closes.append(1), count_off())
client = kev.KevClient("127.0.0.1:1", "grpc")  # a channel connects on its first call: none here
kev.OPEN_CLIENTS.add(client)
kev.close(client)
del client
gc.collect()
print(len(closes), len(kev.OPEN_CLIENTS))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.split() == ["1", "0"], result.stdout + result.stderr[-3000:]


def test_openloop(triton: TritonServer, tmp_path: Path) -> None:
    out = tmp_path / "openloop"
    command = [
        str(Path(sys.prefix) / "bin" / "python"),
        str(REPO / "loadtest" / "openloop.py"),
        "--triton-grpc",
        triton.grpc_url,
        "--rates",
        "5,15",
        "--seconds",
        "3",
        "--out",
        str(out),
    ]
    subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    record = json.loads(out.with_suffix(".json").read_text())
    assert [r["offered_rps"] for r in record["rates"]] == [5.0, 15.0]
    for rate in record["rates"]:
        assert rate["sent"] > 0 and not rate["errors"] and rate["p50_ms"] <= rate["p99_ms"]
        assert rate["queue_ms"] is None or rate["queue_ms"] >= 0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_frontdoor_against_tritonserver_and_the_gateway(triton: TritonServer, tiny_dir: Path, tmp_path: Path) -> None:
    """loadtest/frontdoor.py briefly on the CPU model: one client and a closed loop over two client processes, through
    Triton's gRPC and through the gateway, set beside the same engine's in-process figures (a bench record)."""
    from kev_backend.dev import bench
    from kev_backend.dev.workloads import short6
    from kev_backend.engine.engine import Engine
    from kev_backend.model.checkpoint import load_checkpoint

    engine = Engine(load_checkpoint(tiny_dir / "kev", "cpu"))
    ceil = {"bf16_gemm_tflops": 1.0, "bf16_gemm_tflops_sustained": 0.5, "copy_tb_s": 1.0}
    short = bench.measure(engine, short6, ceil, 1.0, (4,), full=False, baseline=False, label="short6")
    local = tmp_path / "bench.json"
    local.write_text(json.dumps({"model": "tiny", "workloads": {"short6": short}}))
    gateway = start_gateway(triton, tmp_path / "gateway.log")
    out = tmp_path / "frontdoor.json"
    try:
        subprocess.run(
            [sys.executable, "loadtest/frontdoor.py", "--grpc", triton.grpc_url, "--gateway", gateway.url,
             "--metrics", triton.metrics_url,
             "--inprocess", str(local), "--clients", "4", "--procs", "2", "--alone", "5", "--seconds", "2",
             "--out", str(out)],
            capture_output=True, text=True, timeout=300, check=True, cwd=REPO,
        )  # fmt: skip
    finally:
        stop_gateway(gateway)
    record = json.loads(out.read_text())
    assert record["model"] == "tiny" and record["procs"] == 2
    for door in ("grpc", "gateway"):
        level = record[door]["levels"]["4"]
        assert record[door]["one_client_p50_ms"] > 0 and level["requests"] > 0 and level["p50_ms"] <= level["p99_ms"]
        # The server answered at least what the clients counted (they count only answers within the run).
        assert level["server"]["requests"] >= level["requests"] and level["server"]["mean_batch"] >= 1
        assert any(name.startswith("tritonserver") for name in level["server"]["busiest_threads"])
    grpc, gateway_level = record["grpc"], record["gateway"]["levels"]["4"]
    # One client alone: batches of one, the engine's time among the server's; the blocking client measured too.
    alone = grpc["one_client_server"]
    assert alone["mean_batch"] == 1.0 and alone["requests"] >= 5 and alone["engine_ms_per_batch"] > 0
    assert grpc["one_client_blocking_p50_ms"] > 0
    assert record["one_client_overhead_ms"] == grpc["one_client_p50_ms"] - short["wall_new_ms"]
    assert record["served_over_inprocess"] == {"4": grpc["levels"]["4"]["rps"] / short["rps"]["4"]}
    assert record["gateway_over_grpc"] == {"4": gateway_level["rps"] / grpc["levels"]["4"]["rps"]}
    added = record["gateway"]["one_client_p50_ms"] - grpc["one_client_p50_ms"]
    assert record["gateway_one_client_added_ms"] == added


def test_frontdoor_traces_one_client_by_phase(tiny_dir: Path, tmp_path: Path) -> None:
    """With the admin key, loadtest/frontdoor.py runs its one client once more with Triton's trace on (through the
    restricted trace API), over gRPC and through the gateway: every traced call is found in Triton's trace files, its
    phases (loadtest/tracing.py) lie within its time, the engine's within the model's, and tracing is off again, its
    files removed, afterwards."""
    import tritonclient.grpc as grpcclient

    key = tmp_path / "admin-key"
    key.write_text("frontdoor-trace-key\n")
    trace = tmp_path / "trace.json"
    server = start_triton(
        tiny_dir / "kev", tmp_path / "tritonserver.log",
        args=("--trace-config", f"triton,file={trace}", "--trace-config", "level=OFF", "--trace-config", "rate=1",
              "--trace-config", "triton,log-frequency=1"),
        TRITON_ADMIN_KEY_FILE=str(key),
    )  # fmt: skip
    out = tmp_path / "frontdoor.json"
    gateway = None
    try:
        gateway = start_gateway(server, tmp_path / "gateway.log")
        subprocess.run(
            [sys.executable, "loadtest/frontdoor.py", "--grpc", server.grpc_url, "--metrics", server.metrics_url,
             "--gateway", gateway.url, "--admin-key-file", str(key), "--clients", "2", "--procs", "1", "--alone",
             "6", "--seconds", "1", "--out", str(out)],
            capture_output=True, text=True, timeout=300, check=True, cwd=REPO,
        )  # fmt: skip
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            headers = {"triton-grpc-protocol-admin-key": "frontdoor-trace-key"}
            level = client.get_trace_settings("kev", headers=headers, as_json=True)["settings"]["trace_level"]
        finally:
            client.close()
    finally:
        if gateway is not None:
            stop_gateway(gateway)
        stop_triton(server)
    record = json.loads(out.read_text())
    for door in ("grpc", "gateway"):
        phases = record[door]["one_client_phases_ms"]
        assert phases["matched"] == 6, (door, phases)
        assert 0 < phases["engine"] <= phases["in_model"] <= phases["total"]
        assert all(phases[name] >= 0 for name in ("to_triton", "triton_queue", "execute", "to_sent", "to_client"))
        assert phases["to_triton"] + phases["triton_queue"] + phases["to_client"] < phases["total"]
    # Off once the traced client is done: the closed loop after it left no trace files behind.
    assert level == {"value": ["OFF"]} and not list(tmp_path.glob("trace.json*"))


@pytest.mark.parametrize("shape", ["bogus"])
def test_traffic_refuses_unknown_shapes(shape: str) -> None:
    with pytest.raises(ValueError):
        Traffic(shape)


def bench_record(commit: str, date: str, rps: float) -> dict:
    """A bench JSON as python -m kev_backend.dev.bench writes it (the fields compare.py reads)."""

    def workload(scale: float) -> dict:
        return {
            "new_ms": 5.7 * scale,
            "same_ms": 5.1 * scale,
            "rps": {"1": rps / 20 / scale, "64": rps / scale},
            "p50_ms": {"1": 5.9 * scale, "64": 210.0 * scale},
            "floor_rps": 2 * rps / scale,
        }

    return {
        "gpu": "NVIDIA H200",
        "date": date,
        "commit": commit,
        "backend": "fused",
        "graphs": True,
        "complete": True,
        "workloads": {"short6": workload(1.0), "long5": workload(7.0)},
    }


def test_bench_results_compare_by_script(tmp_path: Path) -> None:
    """Bench JSON reads back through bench/compare.py: one row per run and workload, oldest first; other JSON (a
    soak's) is skipped."""
    runs = [
        bench_record("bbbbbbb", "2026-12-02T00:00:00Z", 290.0),
        bench_record("aaaaaaa", "2026-12-01T00:00:00Z", 280),
    ]
    paths = []
    for i, record in enumerate([*runs, {"gpu": "NVIDIA H200", "soak": {}}]):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(record))
    out = subprocess.run(
        [str(Path(sys.prefix) / "bin" / "python"), str(REPO / "bench" / "compare.py"), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert len(out) == 1 + 4 and out[0].split()[:3] == ["commit", "variant", "workload"]
    assert [line.split()[0] for line in out[1:]] == ["aaaaaaa", "aaaaaaa", "bbbbbbb", "bbbbbbb"]  # oldest first
    assert "short6" in out[1] and "290" in out[3]


def test_merge_json_adds_keys_and_never_overwrites(tmp_path: Path) -> None:
    """bench/merge_json.py puts the Triton start times into the bench JSON; a key already there stops it."""
    target, start = tmp_path / "bench.json", tmp_path / "start.json"
    target.write_text(json.dumps({"graphs": True, "workloads": {}}))
    start.write_text(json.dumps({"ready_s": 12.5, "first_answer_s": 13.0}))
    script = [sys.executable, str(REPO / "bench" / "merge_json.py")]
    subprocess.run([*script, str(target), str(start)], check=True, capture_output=True, timeout=60)
    assert json.loads(target.read_text()) == {"graphs": True, "workloads": {}, "ready_s": 12.5, "first_answer_s": 13.0}
    again = subprocess.run([*script, str(target), str(start)], capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and "ready_s" in again.stderr
    assert json.loads(target.read_text())["ready_s"] == 12.5


def test_fairness_against_tritonserver(triton: TritonServer, tiny_dir: Path, tmp_path: Path) -> None:
    """loadtest/fairness.py briefly on the CPU model: its phases run, every short and long request is answered, and
    its goal is computed from what it measured (one unit: the longest wait beside a lone long request less the
    solo p50)."""
    out = tmp_path / "fairness.json"
    command = [sys.executable, str(REPO / "loadtest" / "fairness.py"), "--grpc", triton.grpc_url]
    command += ["--tokenizer", str(tiny_dir / "base"), "--tokens", "3000", "--clients", "2", "--seconds", "2"]
    command += ["--alone", "1", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["state_tokens"] == 3000 and not record["failures"]
    assert record["quiet"]["requests"] > 0 and record["solo"]["requests"] > 0 and record["loaded"]["requests"] > 0
    assert record["loaded_long"]["requests"] >= 1 and len(record["long_alone_ms"]) == 1
    assert record["unit_ms"] == pytest.approx(record["beside_alone"]["max_ms"] - record["solo"]["p50_ms"])
    assert record["goal_ms"] == pytest.approx(2 * record["quiet"]["p99_ms"] + record["unit_ms"])
