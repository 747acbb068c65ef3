"""kev_backend.serve.client (sync and async, gRPC and HTTP) and `kev score` against the real tritonserver and gateway:
exit codes, reruns, a server stopped mid-run, SIGTERM, the gateway with its key, the dry run, `--version`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kev_backend.engine.engine import Engine
from kev_backend.serve.client import AsyncKevClient, KevClient, KevError
from kev_backend.serve.version import version
from tests.conftest import TritonServer, start_gateway, start_triton, stop_gateway, stop_triton
from tests.helpers import assert_same_answer, make_request


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:
    return Engine.from_checkpoint(tiny_dir / "kev")


def url(triton: TritonServer, protocol: str) -> str:
    return triton.grpc_url if protocol == "grpc" else triton.http_url


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_sync_client(triton: TritonServer, engine: Engine, protocol: str) -> None:
    with KevClient(url(triton, protocol), protocol) as kev:
        for i in range(3):
            assert_same_answer(kev.score(make_request(i)), engine.answer([make_request(i)])[0])
        assert_same_answer(kev.score(json.dumps(make_request(5))), engine.answer([make_request(5)])[0])
        with pytest.raises(KevError) as error:
            kev.score({"state": "x", "questions": {}})
        assert error.value.kind == "invalid" and "at least 1 item" in error.value.message


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_async_client(triton: TritonServer, engine: Engine, protocol: str) -> None:
    async def run() -> list:
        async with AsyncKevClient(url(triton, protocol), protocol) as kev:
            return await asyncio.gather(
                *(kev.score(make_request(i)) for i in range(12)), kev.score(b'{"state": 1}'), return_exceptions=True
            )

    results = asyncio.run(run())
    for i, result in enumerate(results[:-1]):
        assert_same_answer(result, engine.answer([make_request(i)])[0])
    assert isinstance(results[-1], KevError) and results[-1].kind == "invalid"


KEV = str(Path(sys.prefix) / "bin" / "kev")


def kev_score(
    source: Path, target: Path, triton: TritonServer, *extra: str, code: int = 0
) -> subprocess.CompletedProcess:
    """`kev score` against the server; its exit code must be `code`."""
    command = [KEV, "score", str(source), str(target), "--url", triton.grpc_url, "--concurrency", "8", *extra]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == code, f"exit {run.returncode}: {run.stderr[-3000:]}"
    return run


def summary_of(run: subprocess.CompletedProcess) -> dict:
    return json.loads(run.stderr.strip().splitlines()[-1])


def numbered(target: Path) -> list[dict]:
    """The output's lines, parsed; their numbers must rise strictly (input order, each line at most once)."""
    lines = [json.loads(line) for line in target.read_text().splitlines()]
    numbers = [line["line"] for line in lines]
    assert numbers == sorted(set(numbers)), numbers
    return lines


def test_kev_score_cli_orders_reports_and_resumes(triton: TritonServer, engine: Engine, tmp_path: Path) -> None:
    lines = [json.dumps(make_request(i)) for i in range(24)]
    lines[7] = '{"state": "no questions"}'
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    run = kev_score(source, target, triton, code=1)  # a line failed: exit 1
    assert "line 8: invalid: questions: Field required" in run.stderr
    assert summary_of(run) == {"lines": 24, "kept": 0, "scored": 23, "failed": 1, "interrupted": False}
    out = target.read_text().splitlines()
    assert len(out) == 24 and json.loads(out[7]) == {
        "line": 8,
        "error": {"kind": "invalid", "message": "questions: Field required"},
    }
    for i, line in enumerate(out):
        if i != 7:
            answer = json.loads(line)
            assert answer.pop("line") == i + 1
            assert_same_answer(answer, engine.answer([make_request(i)])[0])
    # Cut off after 10 lines, half-way through the 11th: a rerun keeps the 10 and scores the rest, the failed line
    # again (it fails again: the request itself is invalid).
    target.write_text("\n".join(out[:10]) + "\n" + out[10][:15])
    run = kev_score(source, target, triton, "--protocol", "grpc", "--quiet", code=1)
    assert summary_of(run) == {"lines": 24, "kept": 9, "scored": 14, "failed": 1, "interrupted": False}
    resumed = target.read_text().splitlines()
    assert len(resumed) == 24 and resumed[:10] == out[:10]
    for a, b in zip(resumed, out):
        if "error" in a:
            assert a == b
        else:
            a_body, b_body = json.loads(a), json.loads(b)
            assert a_body.pop("line") == b_body.pop("line")
            assert_same_answer(a_body, b_body | {"latency_ms": a_body["latency_ms"]})
    # The invalid line fixed: a rerun sends that line alone and exits 0.
    lines[7] = json.dumps(make_request(7))
    source.write_text("\n".join(lines) + "\n")
    run = kev_score(source, target, triton)
    assert summary_of(run) == {"lines": 24, "kept": 23, "scored": 1, "failed": 0, "interrupted": False}
    fixed = numbered(target)
    assert len(fixed) == 24 and [line["line"] for line in fixed] == list(range(1, 25))
    assert_same_answer({k: v for k, v in fixed[7].items() if k != "line"}, engine.answer([make_request(7)])[0])


def test_kev_score_over_http_with_a_client_a_thread(triton: TritonServer, engine: Engine, tmp_path: Path) -> None:
    """--protocol http: Triton's HTTP client is not thread-safe, so each of the run's threads has its own; every
    answer is the engine's."""
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(make_request(i)) + "\n" for i in range(32)))
    command = [KEV, "score", str(source), str(target), "--url", triton.http_url, "--protocol", "http", "--quiet"]
    run = subprocess.run([*command, "--concurrency", "8"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for i, line in enumerate(numbered(target)):
        assert line.pop("line") == i + 1
        assert_same_answer(line, engine.answer([make_request(i)])[0])


def wait_for_lines(path: Path, count: int, process: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until `path` (a run's output in progress) holds `count` lines."""
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_bytes().count(b"\n") >= count):
        assert process.poll() is None, f"kev score ended early: {process.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"{path} did not reach {count} lines"
        time.sleep(0.05)


def test_kev_score_through_a_server_killed_mid_run_and_a_rerun(tiny_dir: Path, engine: Engine, tmp_path: Path) -> None:
    """The server stops mid-run: the lines it leaves are retried, then written as errors and the run exits 1. A
    server started again, the same command answers exactly those lines: every line once, in input order."""
    count = 240
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(make_request(i)) + "\n" for i in range(count)))
    server = start_triton(tiny_dir / "kev", tmp_path / "first.log")
    command = [KEV, "score", str(source), str(target), "--concurrency", "4", "--retries", "2", "--quiet"]
    try:
        run = subprocess.Popen([*command, "--url", server.grpc_url], stderr=subprocess.PIPE, text=True)
        wait_for_lines(target.with_name(".out.jsonl.partial"), 40, run)
    finally:
        stop_triton(server)
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == 1, stderr[-3000:]
    first = numbered(target)
    assert [line["line"] for line in first] == list(range(1, count + 1))
    answered = sum("error" not in line for line in first)
    assert 40 <= answered < count and all(line["error"]["kind"] != "invalid" for line in first if "error" in line)
    server = start_triton(tiny_dir / "kev", tmp_path / "second.log")
    try:
        rerun = kev_score(source, target, server, "--quiet")
    finally:
        stop_triton(server)
    assert summary_of(rerun) == {
        "lines": count, "kept": answered, "scored": count - answered, "failed": 0, "interrupted": False
    }  # fmt: skip
    final = numbered(target)
    assert [line["line"] for line in final] == list(range(1, count + 1))
    expected = engine.answer([make_request(i) for i in range(count)])
    for line, want in zip(final, expected):
        assert_same_answer({k: v for k, v in line.items() if k != "line"}, want)


def test_kev_score_interrupted_keeps_its_answers_and_exits_130(triton: TritonServer, tmp_path: Path) -> None:
    """SIGTERM: the run stops reading, lets the requests in flight end and exits 130; its output holds each answered
    line once, in order, and no error for the lines it did not reach; a rerun finishes them."""
    count = 400
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(make_request(i % 50)) + "\n" for i in range(count)))
    command = [KEV, "score", str(source), str(target), "--url", triton.grpc_url, "--concurrency", "4", "--quiet"]
    run = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    wait_for_lines(target.with_name(".out.jsonl.partial"), 30, run)
    run.send_signal(signal.SIGTERM)
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 130, stderr[-2000:]
    assert json.loads(stderr.strip().splitlines()[-1])["interrupted"] is True
    first = numbered(target)
    assert 30 <= len(first) < count and not any("error" in line for line in first)
    rerun = kev_score(source, target, triton, "--quiet")
    assert summary_of(rerun)["kept"] == len(first)
    assert [line["line"] for line in numbered(target)] == list(range(1, count + 1))


def test_kev_score_through_the_gateway_with_its_key(triton: TritonServer, engine: Engine, tmp_path: Path) -> None:
    """--gateway URL with --api-key-file: the gateway's answers; a wrong key is final for every line (exit 1)."""
    gateway = start_gateway(triton, tmp_path / "gateway.log", KEV_API_KEY="the-key")
    source, target, key = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "key"
    source.write_text("".join(json.dumps(make_request(i)) + "\n" for i in range(6)))
    key.write_text("the-key\n")
    base = [KEV, "score", str(source), str(target), "--gateway", gateway.url, "--quiet"]
    try:
        wrong = subprocess.run([*base, "--retries", "0"], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "KEV_API_KEY": "not-the-key"})  # fmt: skip
        assert wrong.returncode == 1, wrong.stderr[-2000:]
        assert {line["error"]["kind"] for line in numbered(target)} == {"unauthorized"}
        right = subprocess.run([*base, "--api-key-file", str(key)], capture_output=True, text=True, timeout=120)
        assert right.returncode == 0, right.stderr[-2000:]
    finally:
        stop_gateway(gateway)
    for i, line in enumerate(numbered(target)):
        assert line.pop("line") == i + 1
        assert_same_answer(line, engine.answer([make_request(i)])[0])


def test_kev_score_dry_run_validates_every_line(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(make_request(1)) + "\n" + '{"state": "x", "questions": {}}\n' + "not json\n")
    run = subprocess.run([KEV, "score", str(source), str(tmp_path / "out"), "--dry-run"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.returncode == 1
    assert "line 2: invalid: " in run.stderr and "line 3: invalid: " in run.stderr and "line 1:" not in run.stderr
    assert json.loads(run.stderr.strip().splitlines()[-1]) == {"lines": 3, "invalid": 2}
    assert not (tmp_path / "out").exists()
    source.write_text(json.dumps(make_request(1)) + "\n")
    assert subprocess.run([KEV, "score", str(source), str(tmp_path / "out"), "--dry-run"], capture_output=True,
                          timeout=60).returncode == 0  # fmt: skip


def test_kev_score_usage_errors_exit_2_and_every_command_has_a_version(tmp_path: Path) -> None:
    missing = subprocess.run([KEV, "score", str(tmp_path / "none.jsonl"), str(tmp_path / "out")], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    assert missing.returncode == 2 and "no such input file" in missing.stderr
    for command in ("kev", "kev-serve", "kev-gateway", "kev-fill"):
        shown = subprocess.run([str(Path(sys.prefix) / "bin" / command), "--version"], capture_output=True,
                               text=True, timeout=60)  # fmt: skip
        assert shown.returncode == 0 and shown.stdout.strip() == f"{command} (kev-backend) {version()}", shown


# Every character str.splitlines() breaks at. JSON allows the last three raw inside a string; the others are control
# characters JSON never allows raw, so a line holding one is refused, alone.
SEPARATORS = ["\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


def test_kev_score_splits_lines_at_newlines_only(triton: TritonServer, engine: Engine, tmp_path: Path) -> None:
    """Input holding every other line separator inside its JSON: one output line per input line, each naming it,
    answers equal the engine's, and output lines stay single lines for readers that split at any separator."""
    bodies, raw = [], []
    for i, separator in enumerate(SEPARATORS):
        options = {f"yes{separator}now": None, "later": f"a{separator}b"}
        question = {"type": "choice", "instructions": f"route{separator}it", "criteria": options}
        bodies.append({"state": f"ticket {i}{separator}charged twice", "questions": {"q": question}})
        # Raw in the line, as a producer that does not escape them writes it (json.dumps escapes control characters).
        marked = {"state": f"ticket {i}@charged twice", "questions": {"q": {**question, "instructions": "route@it"}}}
        raw.append(json.dumps(marked, ensure_ascii=False).replace("@", separator))
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(raw) + "\n", encoding="utf-8")
    assert len(source.read_text(encoding="utf-8").splitlines()) > len(raw)  # what splitlines would have read
    kev_score(source, target, triton, "--quiet", code=1)  # the lines with raw control characters fail
    out = target.read_text(encoding="utf-8").splitlines()
    assert len(out) == len(raw)
    for i, (line, body, separator) in enumerate(zip(out, bodies, SEPARATORS)):
        answer = json.loads(line)
        assert answer.pop("line") == i + 1
        if separator in ("\x85", "\u2028", "\u2029"):
            assert_same_answer(answer, engine.answer([body])[0])
        else:
            assert answer["error"]["kind"] == "invalid" and "JSON decode error" in answer["error"]["message"], answer


def test_http_without_its_client_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """The serve set holds Triton's gRPC client only: asking for HTTP without tritonclient[http] says what to add."""
    monkeypatch.setitem(sys.modules, "tritonclient.http", None)  # an import of it now fails, as where it is missing
    with pytest.raises(ImportError, match=r"pip install 'tritonclient\[http\]'"):
        KevClient("127.0.0.1:8000", protocol="http")
