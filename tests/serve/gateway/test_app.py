"""The System One gateway on the real stack (tritonserver + kev-gateway, tiny checkpoint): the official
TypeSafe SDK (sync and async, every route it offers) and plain HTTP for auth, 422s, /separate, /permute and
overload."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from backports.zstd import compress
from typesafe_sdk import (
    AsyncTypeSafeClient,
    Choice,
    Noul,
    RetryPolicy,
    Score,
    TypeSafeClient,
    TypeSafeUnprocessableEntityError,
)

from kev_backend.engine.engine import Engine
from kev_backend.serve.gateway.service import MODELS_FRESH_S
from kev_backend.serve.stub import provenance
from kev_backend.serve.version import version
from tests.conftest import (
    REPO,
    Gateway,
    TritonServer,
    metric_values,
    start_gateway,
    start_triton,
    stop_gateway,
    stop_triton,
    wait_until,
)
from tests.helpers import assert_same_answer
from tests.helpers import post as post_as

KEY = "test-key-123"
post = functools.partial(post_as, key=KEY)  # this module's gateway has a key
STATE = {"ticket": "my card was charged twice for the same order , please refund", "customer": {"months": 14}}
QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "is this urgent ?", "criteria": {"true": "reply today"}},
    "team": {
        "type": "choice",
        "instructions": "route it",
        "criteria": {"billing": "refunds", "technical": None, "sales": "plans"},
    },
    "tone": {"type": "score", "instructions": "sentiment", "criteria": ["angry", "neutral", "happy"]},
}
SDK_QUESTIONS = {
    "urgent": Noul(instructions="is this urgent ?", criteria={"true": "reply today"}),
    "team": Choice(instructions="route it", criteria={"billing": "refunds", "technical": None, "sales": "plans"}),
    "tone": Score(instructions="sentiment", criteria=["angry", "neutral", "happy"]),
}


@pytest.fixture(scope="module")
def gateway(triton: TritonServer, tmp_path_factory: pytest.TempPathFactory):
    server = start_gateway(triton, tmp_path_factory.mktemp("gateway") / "gateway.log", KEV_API_KEY=KEY)
    yield server
    stop_gateway(server)


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:
    return Engine.from_checkpoint(tiny_dir / "kev")


def expected(engine: Engine, state=STATE, questions=QUESTIONS, model: str = "kev-latest") -> dict:
    return engine.answer([{"state": state, "questions": questions, "model": model}])[0]


def serving(gateway: Gateway) -> dict:
    request = urllib.request.Request(gateway.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        cards = json.loads(response.read())["models"]
    assert cards[0]["serving"] == cards[1]["serving"]
    return cards[0]["serving"]


def test_models_carry_the_serving_statistics(gateway: Gateway) -> None:
    """GET /v1/models reports Kev's serving statistics, read from Triton's metrics: a state sent twice is one bank
    miss and one hit, and the batches and inferences count."""
    before = serving(gateway)
    assert set(before) >= {"bank_hits", "bank_misses", "bank_states", "graphs", "oom_retries", "batches", "queued_now"}
    body = {"state": f"serving statistics {time.time()}", "questions": QUESTIONS}
    for _ in range(2):
        assert post(gateway, "/v1/systemone", body)[0] == 200
    time.sleep(MODELS_FRESH_S + 0.1)  # the statistics are read at most once a MODELS_FRESH_S
    after = serving(gateway)
    assert (after["bank_misses"] - before["bank_misses"], after["bank_hits"] - before["bank_hits"]) == (1, 1)
    assert after["inferences"] - before["inferences"] == 2 and after["batches"] > before["batches"]
    assert after["bank_states"] >= 1 and after["oom_retries"] == 0


def test_models_name_what_answers(gateway: Gateway, triton: TritonServer, engine: Engine, tiny_dir: Path) -> None:
    """GET /v1/models names what answers: the checkpoint by the hash of its files' content (computed in the
    background once the model is up), its base, LoRA rank, device and torch, tritonserver's version and this
    gateway's; the start-up line says the same, and logs the hash when it is known."""
    import torch

    want = provenance.content_hash(tiny_dir / "kev", Path(engine.checkpoint.tokenizer_dir)).sha256
    deadline = time.monotonic() + 60
    while True:
        request = urllib.request.Request(gateway.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            said = json.loads(response.read())["models"][0]["provenance"]
        if any(i["checkpoint_sha256"] != "pending" for i in said["instances"]) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    meta = engine.checkpoint.meta
    (instance,) = [i for i in said["instances"] if i["checkpoint_sha256"] != "pending"]
    assert instance["checkpoint_sha256"] == want
    assert instance["base"].startswith(meta.base) and instance["lora_rank"] == str(meta.lora)
    assert instance["device"] == "cpu" and instance["torch"] == torch.__version__ and instance["version"] == version()
    assert said["tritonserver"] == "2.51.0" and said["gateway"] == version()
    log = triton.log.read_text(errors="replace")
    assert f"checkpoint sha256 {want} (" in log and "what answers: version " in log


def sdk_response_as_body(result) -> dict:
    return json.loads(result.model_dump_json())


def test_sdk_sync_all_question_types_and_models(gateway: Gateway, engine: Engine) -> None:
    with TypeSafeClient(api_key=KEY, base_url=gateway.url, retry=RetryPolicy(max_retries=0)) as client:
        result = client.system_one(state=STATE, questions=SDK_QUESTIONS, model="kev-latest")
        want = expected(engine)
        assert result.model == "kev-latest"
        assert result.usage.input_tokens == want["usage"]["input_tokens"]
        assert abs(result.nouls["urgent"].noul - want["answers"]["urgent"]["noul"]) <= 1e-4
        assert result.choices["team"].choice == want["answers"]["team"]["choice"]
        assert abs(result.scores["tone"].score - want["answers"]["tone"]["score"]) <= 1e-4
        assert set(result.scores["tone"].probabilities) == {0, 1, 2}
        names = [m.name for m in client.models.list().models]
        assert names == ["kev-latest", "jev-latest"]
        # A body over 1 KiB: the SDK sends it zstd-compressed.
        long_state = " ".join(["refund the late order"] * 120)
        result = client.system_one(state=long_state, questions={"tone": SDK_QUESTIONS["tone"]})
        want = expected(engine, long_state, {"tone": QUESTIONS["tone"]}, model=result.model)
        assert abs(result.scores["tone"].score - want["answers"]["tone"]["score"]) <= 1e-4
        # Kev's 422s reach SDK users as its UnprocessableEntity error.
        too_many = Choice(instructions="x", criteria={f"o{i}": None for i in range(256)})
        with pytest.raises(TypeSafeUnprocessableEntityError):
            client.system_one(state="x", questions={"c": too_many})


def test_sdk_async(gateway: Gateway, engine: Engine) -> None:
    async def run():
        async with AsyncTypeSafeClient(api_key=KEY, base_url=gateway.url, retry=RetryPolicy(max_retries=0)) as client:
            results = await asyncio.gather(
                *(client.system_one(state=f"order {i} refund", questions=SDK_QUESTIONS) for i in range(8))
            )
            models = await client.models.list()
        return results, models

    results, models = asyncio.run(run())
    assert [m.name for m in models.models] == ["kev-latest", "jev-latest"]
    for i, result in enumerate(results):
        want = expected(engine, f"order {i} refund", model=result.model)
        got = sdk_response_as_body(result)
        # The SDK's models order the answer fields their own way: compare field by field.
        ordered = {qid: {key: got["answers"][qid][key] for key in answer} for qid, answer in want["answers"].items()}
        assert_same_answer({**want, "answers": ordered}, want)


def test_plain_http_body_headers_and_auth(gateway: Gateway, engine: Engine) -> None:
    body = {"state": STATE, "questions": QUESTIONS, "model": "anything-goes"}
    status, headers, reply = post(gateway, "/v1/systemone", body, **{"x-typesafe-request-id": "abc123"})
    assert status == 200 and headers["x-typesafe-request-id"] == "abc123"
    assert headers["server-timing"].startswith("app;dur=")
    assert list(reply) == ["model", "answers", "usage", "latency_ms"] and reply["model"] == "anything-goes"
    assert_same_answer(reply, expected(engine, model="anything-goes"))
    status, headers, _ = post(gateway, "/v1/systemone", body)
    assert len(headers["x-typesafe-request-id"]) == 32  # a fresh uuid4 hex
    # zstd and gzip bodies
    status, _, reply = post(
        gateway, "/v1/systemone", compress(json.dumps(body).encode()), **{"content-encoding": "zstd"}
    )
    assert status == 200 and reply["model"] == "anything-goes"
    # The bearer key guards /v1/* only.
    status, headers, reply = post(gateway, "/v1/systemone", body, key=None)
    assert status == 401 and headers["www-authenticate"] == "Bearer" and "detail" in reply
    assert post(gateway, "/v1/systemone", body, key="wrong")[0] == 401
    with urllib.request.urlopen(gateway.url + "/health", timeout=10) as response:
        assert response.status == 200


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"questions": QUESTIONS}, "Field required"),
        ({"state": "x", "questions": {}}, "Dictionary should have at least 1 item"),
        ({"state": "x", "questions": {"q": {"type": "box"}}}, "Input should be 'noul'"),
        ({"state": "x", "questions": {"q": {"type": "choice", "criteria": {}}}}, "criteria must have 1..255 options"),
        (
            {"state": "x", "questions": {"q": {"type": "choice", "criteria": {f"o{i}": None for i in range(256)}}}},
            "criteria must have 1..255 options",
        ),
        ({"state": "x", "questions": {"q": {"type": "score", "criteria": []}}}, "at least 1 item"),
        ({"state": "x", "questions": {"q": {"type": "score", "criteria": list(range(256))}}}, "at most 255 items"),
        ({"state": "x", "questions": {"q": {"type": "noul", "criteria": "yes"}}}, "valid dictionary"),
        (b'{"state": "x", ', "JSON decode error"),
    ],
)
def test_validation_422s(gateway: Gateway, body, message: str) -> None:
    status, _, reply = post(gateway, "/v1/systemone", body)
    assert status == 422
    assert isinstance(reply["detail"], list) and reply["detail"][0]["loc"][0] == "body"
    assert any(message in e["msg"] or message in json.dumps(e) for e in reply["detail"]), reply


def test_context_overflow_422_comes_from_the_model(gateway: Gateway) -> None:
    state = " ".join(["refund"] * 65_536)  # 65,537 tokens with <state>
    status, _, reply = post(gateway, "/v1/systemone", {"state": state, "questions": {"q": QUESTIONS["urgent"]}})
    assert status == 422
    # The model may refuse before tokenizing the whole state: "state is at least 65,537 tokens (counted in ...)".
    detail = reply["detail"]
    assert detail.startswith("state is ") and "65,537 tokens" in detail
    assert "over the 65,536-token limit (the <state> token included)" in detail


def test_separate_agrees_with_packed(gateway: Gateway, engine: Engine) -> None:
    body = {"state": STATE, "questions": QUESTIONS}
    _, _, packed = post(gateway, "/v1/systemone", body)
    status, _, separate = post(gateway, "/v1/systemone/separate", body)
    assert status == 200 and list(separate["answers"]) == list(QUESTIONS)
    for qid, answer in packed["answers"].items():
        for key, value in answer.items():
            if isinstance(value, float):
                assert abs(separate["answers"][qid][key] - value) <= 1e-4
            elif key == "probabilities":
                assert all(abs(separate["answers"][qid][key][k] - v) <= 1e-4 for k, v in value.items())
            else:
                assert separate["answers"][qid][key] == value
    # Each question alone carries the state again.
    state_tokens = len(engine.prepare(body)[1].state)
    assert separate["usage"]["input_tokens"] == packed["usage"]["input_tokens"] + (len(QUESTIONS) - 1) * state_tokens


def test_permute(gateway: Gateway) -> None:
    body = {"request": {"state": STATE, "questions": QUESTIONS}, "question": "team", "n_perm": 5, "seed": 7}
    status, _, reply = post(gateway, "/v1/systemone/permute", body)
    assert status == 200 and len(reply["runs"]) == 5
    assert reply["runs"][0]["order"] == ["billing", "technical", "sales"]
    assert all(sorted(run["order"]) == ["billing", "sales", "technical"] for run in reply["runs"])
    assert reply["argmax_stable"] == (len({run["choice"] for run in reply["runs"]}) == 1)
    assert list(reply["spread"]) == ["billing", "technical", "sales"]
    for key, spread in reply["spread"].items():
        values = [run["probabilities"][key] for run in reply["runs"]]
        assert abs(spread - (max(values) - min(values))) <= 1e-4
    # Seeded: the same orders again.
    assert [r["order"] for r in post(gateway, "/v1/systemone/permute", body)[2]["runs"]] == [
        r["order"] for r in reply["runs"]
    ]
    status, _, reply = post(gateway, "/v1/systemone/permute", {**body, "question": "urgent"})
    assert status == 422 and reply["detail"] == "question must be an existing choice question"
    assert post(gateway, "/v1/systemone/permute", {**body, "question": "nope"})[0] == 422
    for n_perm in (0, 65):
        status, _, reply = post(gateway, "/v1/systemone/permute", {**body, "n_perm": n_perm})
        assert status == 422 and reply["detail"][0]["loc"] == ["body", "n_perm"]
    status, _, reply = post(gateway, "/v1/systemone/permute", {**body, "request": {"state": "x", "questions": {}}})
    assert status == 422 and reply["detail"][0]["loc"][:3] == ["body", "request", "questions"]


def test_overload_is_refused_fast(triton: TritonServer, tmp_path: Path) -> None:
    """A gateway that holds one request at a time answers the rest 429 with retry-after, at once."""
    small = start_gateway(triton, tmp_path / "gateway.log", KEV_GATEWAY_MAX_IN_FLIGHT="1")
    try:
        long_state = " ".join(["the invoice total was wrong and the refund is late"] * 150)
        body = {"state": long_state, "questions": QUESTIONS}
        results: list[tuple[int, dict, float]] = []

        def call() -> None:
            started = time.perf_counter()
            status, headers, _ = post(small, "/v1/systemone", body, key=None)
            results.append((status, headers, time.perf_counter() - started))

        threads = [threading.Thread(target=call) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        statuses = [status for status, _, _ in results]
        assert 200 in statuses and 429 in statuses, statuses
        refused = [(headers, elapsed) for status, headers, elapsed in results if status == 429]
        assert all(headers["retry-after"] == "1" for headers, _ in refused)
        slowest_ok = max(elapsed for status, _, elapsed in results if status == 200)
        assert min(elapsed for _, elapsed in refused) < slowest_ok
    finally:
        stop_gateway(small)


def test_triton_queue_full_is_529(tiny_dir: Path, tmp_path: Path) -> None:
    """Triton's bounded queue refuses at once; the gateway passes that on as 529 with retry-after."""
    repository = tmp_path / "repository"
    (repository / "kev" / "1").mkdir(parents=True)
    config = (REPO / "model_repository" / "kev" / "config.pbtxt").read_text()
    assert "max_queue_size: 512" in config
    (repository / "kev" / "config.pbtxt").write_text(config.replace("max_queue_size: 512", "max_queue_size: 1"))
    (repository / "kev" / "1" / "model.py").write_text(
        (REPO / "model_repository" / "kev" / "1" / "model.py").read_text()
    )
    triton = start_triton(tiny_dir / "kev", tmp_path / "triton.log", repository=repository)
    gateway = start_gateway(triton, tmp_path / "gateway.log")
    try:
        long_body = {"state": " ".join(["the refund is late"] * 3000), "questions": {"q": QUESTIONS["urgent"]}}
        results: list[tuple[int, dict]] = []

        def call(body: dict) -> None:
            status, headers, _ = post(gateway, "/v1/systemone", body, key=None)
            results.append((status, headers))

        executions = metric_values(triton).get("nv_inference_exec_count", 0.0)
        first = threading.Thread(target=call, args=(long_body,))
        first.start()
        # Triton counts a batch once the model's execute has taken it: the long request is running, the queue empty.
        wait_until(lambda: metric_values(triton).get("nv_inference_exec_count", 0.0) > executions, "the long batch")
        threads = [
            threading.Thread(target=call, args=({"state": f"order {i}", "questions": QUESTIONS},)) for i in range(10)
        ]
        for t in threads:
            t.start()
        for t in [first, *threads]:
            t.join()
        statuses = sorted(status for status, _ in results)
        assert statuses.count(529) >= 5 and 200 in statuses, statuses
        assert all(headers["retry-after"] == "1" for status, headers in results if status == 529)
    finally:
        stop_gateway(gateway)
        stop_triton(triton)
