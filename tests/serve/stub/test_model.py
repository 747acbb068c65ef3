"""End to end on the real tritonserver: concurrent tritonclient calls over HTTP and gRPC, answers equal to the
in-process engine's, real dynamic batches, and bad requests failing alone inside a batch."""

from __future__ import annotations

import json
import queue
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kev_backend.engine.engine import Engine, EngineOptions
from kev_backend.protocol.encoding import PIECE_CHARS
from kev_backend.protocol.request import STATE_KEY_HEADER, state_key_of
from kev_backend.serve.client import prometheus
from tests.conftest import REPO, TritonServer, metric_values, settled, wait_until
from tests.helpers import assert_same_answer, grpc_all, http_all, make_request, request, request_array

BAD = {
    "missing state": ({"questions": {"q": {"type": "noul"}}}, "state: Field required"),
    "no questions": ({"state": "x", "questions": {}}, "Dictionary should have at least 1 item"),
    "empty choice": (
        {"state": "x", "questions": {"c": {"type": "choice", "criteria": {}}}},
        "criteria must have 1..255 options",
    ),
    "256 levels": (
        {"state": "x", "questions": {"s": {"type": "score", "criteria": list(range(256))}}},
        "List should have at most 255 items",
    ),
}


@pytest.fixture(scope="module")
def expected(tiny_dir: Path) -> list[dict]:
    engine = Engine.from_checkpoint(tiny_dir / "kev")
    return [engine.answer([make_request(i)])[0] for i in range(48)]


def batch_sizes(server: TritonServer) -> dict[int, int]:
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        stats = client.get_inference_statistics("kev")["model_stats"][0]
    finally:
        client.close()
    return {s["batch_size"]: int(s["compute_infer"]["count"]) for s in stats["batch_stats"]}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_concurrent_answers_equal_the_engine(triton: TritonServer, expected: list[dict], protocol: str) -> None:
    send = http_all if protocol == "http" else grpc_all
    before = batch_sizes(triton)
    results = send(triton, [make_request(i) for i in range(len(expected))])
    for result, want in zip(results, expected, strict=True):
        assert isinstance(result, dict), result
        assert_same_answer(result, want)
    ran = {size: n - before.get(size, 0) for size, n in batch_sizes(triton).items() if n > before.get(size, 0)}
    print(protocol, "batch sizes", ran)
    assert any(size > 1 for size in ran), f"no batch larger than 1 ran: {ran}"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_requests_fail_alone_inside_batches(triton: TritonServer, expected: list[dict], protocol: str) -> None:
    send = http_all if protocol == "http" else grpc_all
    bad = list(BAD.values()) + [(b'{"state": "x", "questions": ', "JSON decode error")]
    bodies: list = [make_request(i) for i in range(32)]
    positions = [3, 9, 15, 21, 27]
    for position, (body, _) in zip(positions, bad):
        bodies.insert(position, body)
    results = send(triton, bodies)
    for position, (_, message) in zip(positions, bad):
        error = results[position]
        assert isinstance(error, InferenceServerException), error
        assert message in error.message()
        assert str(error.status()) in ("400", "StatusCode.INVALID_ARGUMENT")
    good = [r for i, r in enumerate(results) if i not in positions]
    for result, want in zip(good, expected[:32], strict=True):
        assert_same_answer(result, want)
    # The server keeps serving.
    assert_same_answer(send(triton, [make_request(40)])[0], expected[40])


def test_several_requests_in_one_call(triton: TritonServer, expected: list[dict]) -> None:
    client = httpclient.InferenceServerClient(triton.http_url)
    try:
        array = np.array([[json.dumps(make_request(i)).encode()] for i in range(3)], dtype=np.object_)
        inp = httpclient.InferInput("REQUEST", list(array.shape), "BYTES")
        inp.set_data_from_numpy(array)
        out = client.infer("kev", [inp]).as_numpy("RESPONSE")
        assert out.shape == (3, 1)
        for i in range(3):
            assert_same_answer(json.loads(out[i, 0]), expected[i])
        # One bad element fails that call, and says which element.
        array[1, 0] = b'{"state": "x"}'
        inp.set_data_from_numpy(array)
        with pytest.raises(InferenceServerException, match=r"REQUEST\[1\]: questions: Field required"):
            client.infer("kev", [inp])
    finally:
        client.close()


def test_admin_apis_are_restricted(triton: TritonServer) -> None:
    client = httpclient.InferenceServerClient(triton.http_url)
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_model_repository_index()
        with pytest.raises(InferenceServerException):
            client.unload_model("kev")
        assert client.is_model_ready("kev")
    finally:
        client.close()


def test_prometheus_metrics_from_the_backend(triton: TritonServer) -> None:
    before = metric_values(triton)
    bodies = [make_request(100 + i) for i in range(20)] + [{"state": "x", "questions": {}}]
    grpc_all(triton, bodies)
    grpc_all(triton, [make_request(100)])  # a later batch on a state the bank holds
    bodies.append(make_request(100))
    after = settled(
        lambda: metric_values(triton),
        lambda v: v.get("kev_batch_requests_sum", 0.0) - before.get("kev_batch_requests_sum", 0.0) >= len(bodies),
        "the batches' metrics",
    )

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("kev_batch_requests_sum") == len(bodies)
    assert delta("kev_request_errors_total") == 1
    assert delta("kev_bank_misses_total") + delta("kev_bank_hits_total") >= len(
        set(json.dumps(b.get("state")) for b in bodies[:-1])
    )
    assert delta("kev_bank_hits_total") >= 1
    assert after["kev_bank_bytes"] > 0 and after["kev_bank_entries"] >= 1
    assert delta("kev_batch_row_tokens_count") == delta("kev_engine_ms_count") >= 1
    assert delta("kev_batch_state_tokens_sum") > 0 and delta("kev_engine_ms_sum") > 0
    assert "kev_graph_replays_total" in after and "kev_graph_captures_total" in after
    assert after["kev_graph_capture_failures_total"] == 0
    assert after["kev_graphs"] == 0 and after["kev_graph_bytes"] == 0  # no graphs on a CPU


def test_a_growing_state_reuses_its_banked_prefix(triton: TritonServer, tiny_dir: Path) -> None:
    """A state that continues a banked one (past the reference path's first 4,096-token chunk) is computed from that
    state's point: the backend's growth counters say so, and the answers are those of states computed whole. Its
    text is tokenized in pieces, cached: the second turn reads its new text and at most two pieces before it."""
    first = " ".join(f"message {i} about the late refund" for i in range(900))
    added = " and one more message about the invoice"
    bodies = [request(state=state) for state in (first, first + added)]
    before = metric_values(triton)
    answers = [grpc_all(triton, bodies[:1])[0]]
    middle = settled(
        lambda: metric_values(triton),
        lambda v: v["kev_tokenized_chars_total"] >= before["kev_tokenized_chars_total"] + len(first),
        "the first turn's tokenizing",
    )
    answers += grpc_all(triton, bodies[1:])
    after = settled(
        lambda: metric_values(triton),
        lambda v: v.get("kev_bank_prefix_hits_total", 0.0) > before.get("kev_bank_prefix_hits_total", 0.0),
        "the growth counters",
    )
    questions = sum(len(json.dumps(q)) for q in bodies[1]["questions"].values())  # (more than their texts)
    read = after["kev_tokenized_chars_total"] - middle["kev_tokenized_chars_total"]
    assert len(first) > 6 * PIECE_CHARS and 0 < read <= len(added) + 2 * PIECE_CHARS + questions

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    whole = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(bank_bytes=0))
    for answer, body in zip(answers, bodies, strict=True):
        want = whole.answer([body])[0]
        assert (answer["answers"], answer["usage"]) == (want["answers"], want["usage"])
    state_tokens = [answer["usage"]["input_tokens"] for answer in answers]  # the state and the questions' rows
    assert state_tokens[0] > 4096 + 16
    assert delta("kev_bank_prefix_hits_total") == 1 and delta("kev_bank_tokens_reused_total") == 4096
    assert 0 < delta("kev_bank_tokens_computed_total") < sum(state_tokens) - 4096


def test_cancelled_while_queued_costs_no_model_work(triton: TritonServer) -> None:
    """A request cancelled before its batch starts never reaches the engine."""
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    done: queue.Queue = queue.Queue()
    try:
        before = metric_values(triton)
        # Occupy the model with a long request, then queue one and cancel it at once.
        long_body = {"state": " ".join(["the refund is late"] * 3000), "questions": make_request(0)["questions"]}
        client.async_infer("kev", [grpc_input(long_body)], callback=lambda result, error: done.put(("long", error)))
        # Triton counts a batch once the model's execute has taken it: from then on the long request is not queued.
        executions = before.get("nv_inference_exec_count", 0.0)
        wait_until(lambda: metric_values(triton).get("nv_inference_exec_count", 0.0) > executions, "the long batch")
        context = client.async_infer(
            "kev", [grpc_input(make_request(7))], callback=lambda result, error: done.put(("cut", error))
        )
        context.cancel()
        outcomes = dict(done.get(timeout=120) for _ in range(2))
        after = settled(
            lambda: metric_values(triton),
            lambda v: v["kev_batch_requests_sum"] > before["kev_batch_requests_sum"],
            "the long batch's metrics",
        )
    finally:
        client.close()
    assert outcomes["long"] is None
    assert outcomes["cut"] is not None and "CANCELLED" in str(outcomes["cut"].status())
    assert after["kev_batch_requests_sum"] - before["kev_batch_requests_sum"] == 1  # only the long request ran


def grpc_input(body: dict) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("REQUEST", [1, 1], "BYTES")
    inp.set_data_from_numpy(request_array(body))
    return inp


def test_warmup_requests_run_before_ready(tiny_dir, tmp_path) -> None:
    """Requests named by `warmup_requests` (here KEV_WARMUP_REQUESTS) are answered at load, before ready."""
    from tests.conftest import start_triton, stop_triton

    lines = [json.dumps(make_request(i)) for i in range(9)] + ['{"state": "x"}']
    (tmp_path / "warmup.jsonl").write_text("\n".join(lines) + "\n")
    server = start_triton(tiny_dir / "kev", tmp_path / "triton.log", KEV_WARMUP_REQUESTS=str(tmp_path / "warmup.jsonl"))
    try:
        values = metric_values(server)
        assert values["kev_batch_requests_sum"] == 10 and values["kev_request_errors_total"] == 1
        assert values["kev_bank_entries"] >= 1
        log = server.log.read_text()
        assert "10 warm-up requests" in log
        # Where the time to ready went, phase by phase.
        phases = re.search(r"start-up seconds load ([\d.]+), build ([\d.]+), warmup_requests ([\d.]+)", log)
        assert phases is not None and float(phases[3]) > 0, log[-2000:]  # the ten requests took time
    finally:
        stop_triton(server)


def test_large_batches_are_scored_in_parts(tiny_dir, tmp_path, expected: list[dict]) -> None:
    """A batch holding more than KEV_PART_TOKENS of model work is scored and answered in parts (pipeline.part_ends):
    here a budget of one request and a half, so Triton's batches of several requests run as several engine batches,
    and every answer is still the engine's."""
    from tests.conftest import start_triton, stop_triton

    engine = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(bank_bytes=1 << 24))
    budget = min(engine.prepare(make_request(i))[1].input_tokens for i in range(24)) * 3 // 2
    server = start_triton(tiny_dir / "kev", tmp_path / "triton.log", KEV_PART_TOKENS=str(budget))
    try:
        before_values, before_sizes = metric_values(server), batch_sizes(server)
        results = http_all(server, [make_request(i) for i in range(24)])
        for result, want in zip(results, expected[:24], strict=True):
            assert isinstance(result, dict), result
            assert_same_answer(result, want)
        counted = before_values.get("kev_engine_ms_count", 0.0) + 24
        values = settled(lambda: metric_values(server), lambda v: v["kev_engine_ms_count"] >= counted, "24 batches")
        sizes = batch_sizes(server)
    finally:
        stop_triton(server)
    ran = {size: n - before_sizes.get(size, 0) for size, n in sizes.items() if n > before_sizes.get(size, 0)}
    assert any(size > 1 for size in ran), f"no batch larger than 1 ran: {ran}"
    engine_batches = values["kev_engine_ms_count"] - before_values.get("kev_engine_ms_count", 0.0)
    # Each Triton batch of n requests ran as n engine batches of one.
    assert engine_batches == sum(size * n for size, n in ran.items()) == 24
    assert values["kev_batch_requests_sum"] - before_values.get("kev_batch_requests_sum", 0.0) == 24


def test_gpu_config_differs_only_in_its_gpu_settings() -> None:
    """configs/gpu.pbtxt (`--model-config-name=gpu`) is config.pbtxt plus its header and the lines marked
    `# GPU setting`: a change to one that misses the other fails here."""
    model = Path(__file__).resolve().parents[3] / "model_repository" / "kev"
    base = (model / "config.pbtxt").read_text().splitlines()
    gpu = (model / "configs" / "gpu.pbtxt").read_text().splitlines()
    header = [line for line in gpu[: len(gpu) - len(base)] if line.startswith("#")]
    assert len(header) == len(gpu) - len(base) and header
    marked = [i for i, line in enumerate(gpu[len(header) :]) if line.endswith("# GPU setting")]
    for i, (ours, theirs) in enumerate(zip(base, gpu[len(header) :], strict=True)):
        if i not in marked:
            assert ours == theirs, (i, ours, theirs)
    settings = [gpu[len(header) + i].split("#")[0].strip() for i in marked]
    assert settings == [
        "max_queue_delay_microseconds: 0",
        "{ kind: KIND_GPU, count: 1 }",
    ]


def test_batcher_config_rewrites_for_the_sweep() -> None:
    """bench/gpu.sh batcher rewrites the GPU config's batcher delay and instance count: exactly those lines change."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("batcher_config", REPO / "bench" / "batcher_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = (REPO / "model_repository" / "kev" / "configs" / "gpu.pbtxt").read_text()
    updated = module.set_instance_count(module.set_queue_delay(text, 1500), 2)
    changed = [(a, b) for a, b in zip(text.splitlines(), updated.splitlines(), strict=True) if a != b]
    assert [b.strip() for _, b in changed] == [
        "max_queue_delay_microseconds: 1500  # GPU setting",
        "{ kind: KIND_GPU, count: 2 }  # GPU setting",
    ]
    with pytest.raises(ValueError):
        module.set_queue_delay("dynamic_batching { }", 500)
    with pytest.raises(ValueError):
        module.set_instance_count("instance_group [ { kind: KIND_CPU, count: 1 } ]", 2)


def state_key_counts(server: TritonServer) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{server.metrics_url}/metrics", timeout=10) as response:
        samples = prometheus.parse(response.read().decode())
    return {m: prometheus.total(samples, "kev_state_keys_total", matches=m) for m in ("yes", "no")}


def test_the_routing_key_arrives_as_header_or_parameter_and_is_checked(triton: TritonServer) -> None:
    """x-kev-state-key as gRPC metadata (Triton forwards the header as a request parameter) or as a request parameter
    over HTTP: the backend counts whether it is the state's key; a key of the wrong type fails that request alone."""
    body = make_request(300)
    key = state_key_of(body)
    before = state_key_counts(triton)
    grpc = grpcclient.InferenceServerClient(triton.grpc_url)
    http = httpclient.InferenceServerClient(triton.http_url)
    try:
        for header in (key, "0" * 16):
            grpc.infer("kev", [grpc_input(body)], headers={STATE_KEY_HEADER: header})
        inp = httpclient.InferInput("REQUEST", [1, 1], "BYTES")
        inp.set_data_from_numpy(request_array(body))
        http.infer("kev", [inp], parameters={STATE_KEY_HEADER: key})
        http.infer("kev", [inp], headers={STATE_KEY_HEADER: key})
        with pytest.raises(InferenceServerException, match=STATE_KEY_HEADER):
            http.infer("kev", [inp], parameters={STATE_KEY_HEADER: 7})
        assert grpc.infer("kev", [grpc_input(body)]).as_numpy("RESPONSE") is not None  # no key: not counted
    finally:
        grpc.close()
        http.close()
    counted = before["yes"] + before["no"] + 4
    after = settled(lambda: state_key_counts(triton), lambda v: v["yes"] + v["no"] >= counted, "the keys counted")
    assert (after["yes"] - before["yes"], after["no"] - before["no"]) == (3, 1)
