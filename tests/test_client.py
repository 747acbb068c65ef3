"""kev_backend.serve.client (sync and async, gRPC and HTTP) and `kev score` against the real tritonserver."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kev_backend.engine.engine import Engine
from kev_backend.serve.client import AsyncKevClient, KevClient, KevError

from .conftest import TritonServer
from .helpers import assert_same_answer, make_request


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


def kev_score(source: Path, target: Path, triton: TritonServer, *extra: str) -> subprocess.CompletedProcess:
    command = [
        str(Path(sys.prefix) / "bin" / "kev"),
        "score",
        str(source),
        str(target),
        "--url",
        triton.grpc_url,
        "--concurrency",
        "8",
        *extra,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)


def test_kev_score_cli_orders_reports_and_resumes(triton: TritonServer, engine: Engine, tmp_path: Path) -> None:
    lines = [json.dumps(make_request(i)) for i in range(24)]
    lines[7] = '{"state": "no questions"}'
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    run = kev_score(source, target, triton)
    assert "line 8: invalid: questions: Field required" in run.stderr
    assert json.loads(run.stderr.strip().splitlines()[-1]) == {"lines": 24, "skipped": 0, "scored": 24, "failed": 1}
    out = target.read_text().splitlines()
    assert len(out) == 24 and json.loads(out[7]) == {
        "error": {"kind": "invalid", "message": "questions: Field required"}
    }
    for i, line in enumerate(out):
        if i != 7:
            assert_same_answer(json.loads(line), engine.answer([make_request(i)])[0])
    # Interrupted after 10 lines, half-way through the 11th: a rerun redoes only the rest.
    target.write_text("\n".join(out[:10]) + "\n" + out[10][:15])
    run = kev_score(source, target, triton, "--protocol", "grpc", "--quiet")
    assert json.loads(run.stderr.strip().splitlines()[-1])["skipped"] == 10
    resumed = target.read_text().splitlines()
    assert len(resumed) == 24 and resumed[:10] == out[:10]
    for a, b in zip(resumed, out):
        if "error" in a:
            assert a == b
        else:
            assert_same_answer(json.loads(a), json.loads(b) | {"latency_ms": json.loads(a)["latency_ms"]})


def test_http_without_its_client_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """The serve set holds Triton's gRPC client only: asking for HTTP without tritonclient[http] says what to add."""
    monkeypatch.setitem(sys.modules, "tritonclient.http", None)  # an import of it now fails, as where it is missing
    with pytest.raises(ImportError, match=r"pip install 'tritonclient\[http\]'"):
        KevClient("127.0.0.1:8000", protocol="http")
