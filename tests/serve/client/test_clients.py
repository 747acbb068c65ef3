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
from tests.conftest import TritonServer
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
        "line": 8,
        "error": {"kind": "invalid", "message": "questions: Field required"},
    }
    for i, line in enumerate(out):
        if i != 7:
            answer = json.loads(line)
            assert answer.pop("line") == i + 1
            assert_same_answer(answer, engine.answer([make_request(i)])[0])
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
            a_body, b_body = json.loads(a), json.loads(b)
            assert a_body.pop("line") == b_body.pop("line")
            assert_same_answer(a_body, b_body | {"latency_ms": a_body["latency_ms"]})


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
    kev_score(source, target, triton, "--quiet")
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
