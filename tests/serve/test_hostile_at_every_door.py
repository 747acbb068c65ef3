"""Hostile and odd input at every door: Triton's gRPC and HTTP endpoints and the System One gateway, on the real
tritonserver with the tiny checkpoint. Each case is sent beside good requests that share its batch; the bad one
gets its own clear error, its batch-mates their answers, and the server answers normally afterwards."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from kev_backend.protocol.request import MAX_QUESTIONS, MAX_REQUEST_BYTES, RequestError
from kev_backend.serve.client import prometheus
from tests.conftest import Gateway, TritonServer, metric_values, settled, start_gateway, stop_gateway


def errors_by_reason(server: TritonServer) -> dict[str, float]:
    """kev_request_errors_total per reason label, summed over instances."""
    with urllib.request.urlopen(f"http://{server.metrics_url}/metrics", timeout=10) as response:
        samples = prometheus.parse(response.read().decode())
    counts: dict[str, float] = {}
    for name, labels, value in samples:
        if name == "kev_request_errors_total":
            counts[labels["reason"]] = counts.get(labels["reason"], 0.0) + value
    return counts


NOUL = {"type": "noul", "instructions": "is this urgent ?"}
CHOICE = {"type": "choice", "instructions": "which team ?", "criteria": {"billing": None, "technical": "bugs"}}
SCORE = {"type": "score", "instructions": "sentiment", "criteria": ["angry", "neutral", "happy"]}


def body(state: object = "the refund is late", questions: dict | None = None, **extra: object) -> bytes:
    return json.dumps({"state": state, "questions": questions or {"q": NOUL}, **extra}).encode()


def nested(depth: int, kind: str = "list", leaves: int = 1) -> bytes:
    """A state nested `depth` levels deep (the body itself is one more) around `leaves` leaves, written as bytes so no
    recursion builds it."""
    opening, closing = ("[", "]") if kind == "list" else ('{"k":', "}")
    inner = opening * depth + ",".join(['"leaf"'] * leaves) + closing * depth
    return b'{"state": ' + inner.encode() + b', "questions": {"q": {"type": "noul"}}}'


def raw(text: str) -> bytes:
    """A body whose JSON escapes are written by hand (e.g. lone surrogates, which json.dumps cannot write)."""
    return text.encode()


OK = "ok"
PARSE_ERROR = "There was an error parsing the body"  # Kev's (FastAPI's) message for a body that is not JSON text
NOT_AN_OBJECT = "Input should be a valid dictionary"
WORDS = "the refund is late please help "

# (case, body, expected): OK, or (reason, text in the error message). Reasons: "invalid" (Kev's 422; the gateway may
# answer 400 for a body it cannot parse) and "too_large" (refused for its size before parsing).
CASES: list[tuple[str, bytes, object]] = [
    # nesting
    ("deep list 65", nested(64), ("invalid", "nested more than 64 levels")),
    ("deep list 400", nested(400), ("invalid", "nested more than 64 levels")),
    ("deep dict 400", nested(400, "dict"), ("invalid", "nested more than 64 levels")),
    ("deep list 150000", nested(150_000), ("invalid", "nested more than 64 levels")),
    ("deep list at limit", nested(62), OK),
    # Kev renders each of these 150,000 leaves on a line indented 124 spaces: 20 MB of text from a 1 MB body, refused
    # for its tokens once counted past the limit, without copying the text again at each of the 62 levels.
    ("deep and wide", nested(62, leaves=150_000), ("invalid", "over the 65,536-token limit")),
    ("deep dict at limit", nested(62, "dict"), OK),
    (
        "deep instructions",
        body(questions={"q": {"type": "noul", "instructions": json.loads(nested(70))["state"]}}),
        ("invalid", "nested more than 64 levels"),
    ),
    # text that is not valid Unicode, or odd but valid
    (
        "surrogate in state",
        raw('{"state": "a \\ud800 b", "questions": {"q": {"type": "noul"}}}'),
        ("invalid", "lone surrogate"),
    ),
    (
        "low surrogate in state",
        raw('{"state": "\\udc00", "questions": {"q": {"type": "noul"}}}'),
        ("invalid", "lone surrogate"),
    ),
    (
        "surrogate in question name",
        raw('{"state": "x", "questions": {"q\\ud800": {"type": "noul"}}}'),
        ("invalid", "lone surrogate"),
    ),
    (
        "surrogate in model",
        raw('{"state": "x", "model": "\\ud800", "questions": {"q": {"type": "noul"}}}'),
        ("invalid", "lone surrogate"),
    ),
    (
        "surrogate in instructions",
        raw('{"state": "x", "questions": {"q": {"type": "noul", "instructions": "\\udbff"}}}'),
        ("invalid", "lone surrogate"),
    ),
    (
        "surrogate in option name",
        raw('{"state": "x", "questions": {"q": {"type": "choice", "criteria": {"a\\ud800": null, "b": null}}}}'),
        ("invalid", "lone surrogate"),
    ),
    (
        "surrogate in option text",
        raw('{"state": "x", "questions": {"q": {"type": "choice", "criteria": {"a": "\\ud800", "b": null}}}}'),
        ("invalid", "lone surrogate"),
    ),
    (
        "surrogate in score level",
        raw('{"state": "x", "questions": {"q": {"type": "score", "criteria": ["\\ud800"]}}}'),
        ("invalid", "lone surrogate"),
    ),
    (
        "surrogate in state key",
        raw('{"state": {"\\ud800": 1}, "questions": {"q": {"type": "noul"}}}'),
        ("invalid", "lone surrogate"),
    ),
    ("surrogate pair", raw('{"state": "smile \\ud83d\\ude00", "questions": {"q": {"type": "noul"}}}'), OK),
    ("NUL in state", body("a\x00b"), OK),
    ("NUL in question name", body(questions={"q\x00": NOUL}), OK),
    ("NUL in option", body(questions={"q": {"type": "choice", "criteria": {"a\x00": None, "b": None}}}), OK),
    ("control characters", body("".join(chr(c) for c in range(1, 32))), OK),
    ("emoji and scripts", body("😀 مرحبا 你好 e\u0301 \u202e"), OK),
    ("delimiter text", body("<|fim_prefix|> <|box_end|> <|fim_suffix|>"), OK),
    ("escaped unicode", raw('{"state": "caf\\u00e9 \\/ \\"q\\"", "questions": {"q": {"type": "noul"}}}'), OK),
    ("invalid UTF-8", b'{"state": "\xff\xfe", "questions": {"q": {"type": "noul"}}}', ("invalid", PARSE_ERROR)),
    ("UTF-8 BOM", b"\xef\xbb\xbf" + body(), OK),
    # numbers
    (
        "5000-digit int",
        raw('{"state": ' + "9" * 5000 + ', "questions": {"q": {"type": "noul"}}}'),
        ("invalid", PARSE_ERROR),
    ),
    ("NaN", raw('{"state": NaN, "questions": {"q": {"type": "noul"}}}'), OK),
    ("Infinity", raw('{"state": [Infinity, -Infinity], "questions": {"q": {"type": "noul"}}}'), OK),
    ("1e400", raw('{"state": 1e400, "questions": {"q": {"type": "noul"}}}'), OK),
    ("negative zero", raw('{"state": -0.0, "questions": {"q": {"type": "noul"}}}'), OK),
    ("largest float", raw('{"state": 1.7976931348623157e308, "questions": {"q": {"type": "noul"}}}'), OK),
    ("tiny float", raw('{"state": 5e-324, "questions": {"q": {"type": "noul"}}}'), OK),
    ("score level numbers", body(questions={"q": {"type": "score", "criteria": [0, -1.5, 1e300, True]}}), OK),
    # shapes
    ("empty body", b"", ("invalid", "Field required")),
    ("not JSON", b"hello", ("invalid", "JSON decode error")),
    ("truncated JSON", body()[:-3], ("invalid", "JSON decode error")),
    ("trailing garbage", body() + b" ]", ("invalid", "JSON decode error")),
    ("single quotes", b"{'state': 'x'}", ("invalid", "JSON decode error")),
    ("top-level list", b"[1, 2]", ("invalid", NOT_AN_OBJECT)),
    ("top-level string", b'"state"', ("invalid", NOT_AN_OBJECT)),
    ("state null", body(None), OK),
    ("state true", body(True), OK),
    ("state whitespace", body("   \n\t "), OK),
    ("questions empty", raw('{"state": "x", "questions": {}}'), ("invalid", "at least 1 item")),
    ("questions a list", raw('{"state": "x", "questions": [{"type": "noul"}]}'), ("invalid", "questions")),
    ("question null", raw('{"state": "x", "questions": {"q": null}}'), ("invalid", "questions.q")),
    ("question a string", raw('{"state": "x", "questions": {"q": "noul"}}'), ("invalid", "questions.q")),
    ("question without type", body(questions={"q": {"instructions": "x"}}), ("invalid", "questions.q")),
    ("unknown type", body(questions={"q": {"type": "rank"}}), ("invalid", "questions.q")),
    ("model a number", body(model=123), ("invalid", "model")),
    ("unknown fields", body(temperature=2, stream=True), OK),
    ("duplicate keys", raw('{"state": "a", "state": "b", "questions": {"q": {"type": "noul"}}}'), OK),
    ("choice null criteria", body(questions={"q": {"type": "choice", "criteria": None}}), ("invalid", "criteria")),
    (
        "choice 256 options",
        body(questions={"q": {"type": "choice", "criteria": {str(i): None for i in range(256)}}}),
        ("invalid", "1..255 options"),
    ),
    (
        "choice 255 options",
        body(questions={"q": {"type": "choice", "criteria": {str(i): None for i in range(255)}}}),
        OK,
    ),
    ("score 255 levels", body(questions={"q": {"type": "score", "criteria": list(range(255))}}), OK),
    ("score no levels", body(questions={"q": {"type": "score", "criteria": []}}), ("invalid", "at least 1 item")),
    ("noul odd criteria", body(questions={"q": {"type": "noul", "criteria": {"true": {"a": [1]}, "maybe": 1}}}), OK),
    ("nested instructions", body(questions={"q": {"type": "noul", "instructions": {"a": [1, {"b": None}]}}}), OK),
    ("long question name", body(questions={"q" * 10_000: NOUL}), OK),
    (f"{MAX_QUESTIONS} questions", body(questions={f"q{i}": NOUL for i in range(MAX_QUESTIONS)}), OK),
    (
        f"{MAX_QUESTIONS + 1} questions",
        body(questions={f"q{i}": NOUL for i in range(MAX_QUESTIONS + 1)}),
        ("invalid", f"over the limit of {MAX_QUESTIONS}"),
    ),
    # sizes
    ("state over the token limit", body(WORDS * 20_000), ("invalid", "over the 65,536-token limit")),
    ("list state over the token limit", body(["refund"] * 70_000), ("invalid", "over the 65,536-token limit")),
    (
        "instructions over the row limit",
        body(questions={"q": {"type": "noul", "instructions": WORDS * 20_000}}),
        ("invalid", "branch too long"),
    ),
    (
        "option over the row limit",
        body(questions={"q": {"type": "choice", "criteria": {"a": WORDS * 20_000, "b": None}}}),
        ("invalid", "branch too long"),
    ),
    ("one huge word", body("x" * 1_000_000), OK),  # one word: one token of the tiny word-level tokenizer
    ("body over the byte limit", body(WORDS * (MAX_REQUEST_BYTES // len(WORDS) + 1)), ("too_large", "byte limit")),
]


def good(i: int) -> bytes:
    return body(f"good request {i} : my card was charged twice", {"urgent": NOUL, "team": CHOICE, "tone": SCORE})


def check_answer(reply: dict, sent: bytes) -> None:
    request = json.loads(sent.decode("utf-8-sig"))
    assert set(reply["answers"]) == set(request["questions"])
    for answer in reply["answers"].values():
        if answer["type"] != "noul":
            assert abs(sum(answer["probabilities"].values()) - 1) < 1e-3
    assert reply["usage"]["input_tokens"] > 0


def grpc_call(client: grpcclient.InferenceServerClient, payloads: list[bytes]) -> list[tuple[dict | None, str]]:
    """All payloads at once (so they share batches); per payload the reply or the error's status and message."""
    done: queue.Queue = queue.Queue()
    for i, payload in enumerate(payloads):
        inp = grpcclient.InferInput("REQUEST", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[payload]], dtype=np.object_))
        client.async_infer("kev", [inp], callback=lambda result, error, i=i: done.put((i, result, error)))
    out: list = [None] * len(payloads)
    for _ in payloads:
        i, result, error = done.get(timeout=120)
        if error is not None:
            out[i] = (None, f"{error.status()} {error.message()}")
        else:
            out[i] = (json.loads(result.as_numpy("RESPONSE")[0, 0]), "")
    return out


def http_call(client: httpclient.InferenceServerClient, payloads: list[bytes]) -> list[tuple[dict | None, str]]:
    handles = []
    for payload in payloads:
        inp = httpclient.InferInput("REQUEST", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[payload]], dtype=np.object_), binary_data=True)
        handles.append(client.async_infer("kev", [inp]))
    out = []
    for handle in handles:
        try:
            result = handle.get_result(timeout=120)
        except Exception as error:  # noqa: BLE001 - InferenceServerException carries the status
            out.append((None, f"{getattr(error, 'status', lambda: '')()} {error}"))
        else:
            out.append((json.loads(result.as_numpy("RESPONSE")[0, 0]), ""))
    return out


def gateway_call(gateway: Gateway, payloads: list[bytes]) -> list[tuple[dict | None, str]]:
    def post(payload: bytes) -> tuple[dict | None, str]:
        request = urllib.request.Request(
            f"{gateway.url}/v1/systemone", data=payload, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read()), ""
        except urllib.error.HTTPError as error:
            detail = json.loads(error.read())["detail"]  # every refusal is JSON
            if isinstance(detail, list):  # FastAPI's form: one line per error, as Triton's message has them
                detail = RequestError(detail).message
            return None, f"{error.code} {detail}"

    with ThreadPoolExecutor(len(payloads)) as pool:
        return list(pool.map(post, payloads))


EXPECTED_STATUS = {
    "grpc": {"invalid": ("StatusCode.INVALID_ARGUMENT",), "too_large": ("StatusCode.INVALID_ARGUMENT",)},
    "http": {"invalid": ("400",), "too_large": ("400",)},
    "gateway": {"invalid": ("422", "400"), "too_large": ("413",)},
}


@pytest.fixture(scope="module")
def gateway(triton: TritonServer, tmp_path_factory: pytest.TempPathFactory):
    gateway = start_gateway(triton, tmp_path_factory.mktemp("gateway") / "gateway.log")
    yield gateway
    stop_gateway(gateway)


@pytest.fixture(scope="module")
def doors(triton: TritonServer, gateway: Gateway):
    grpc = grpcclient.InferenceServerClient(triton.grpc_url)
    http = httpclient.InferenceServerClient(triton.http_url, concurrency=4, network_timeout=120)
    yield {
        "grpc": lambda payloads: grpc_call(grpc, payloads),
        "http": lambda payloads: http_call(http, payloads),
        "gateway": lambda payloads: gateway_call(gateway, payloads),
    }
    grpc.close()
    http.close()


def test_cases_cover_the_findings() -> None:
    assert len(CASES) >= 60 and len({name for name, _, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("door", ["grpc", "http", "gateway"])
def test_hostile_input_fails_alone(door: str, doors, triton: TritonServer) -> None:
    """Every case beside two good requests: the case gets its answer or its own clear error, the good ones their
    answers; afterwards a good request is answered and every refusal was counted by reason."""
    call = doors[door]
    before = errors_by_reason(triton)
    failures = []
    refused = {"invalid": 0, "too_large": 0}
    for i, (name, payload, expected) in enumerate(CASES):
        mates = [good(3 * i), good(3 * i + 1)]
        results = call([mates[0], payload, mates[1]])
        for mate, (reply, error) in zip(mates, (results[0], results[2])):
            if reply is None:
                failures.append(f"{name}: a batch-mate failed: {error}")
            else:
                check_answer(reply, mate)
        reply, error = results[1]
        if expected == OK:
            if reply is None:
                failures.append(f"{name}: expected an answer, got {error}")
            else:
                check_answer(reply, payload)
            continue
        reason, text = expected
        refused[reason] += 1
        if reply is not None:
            failures.append(f"{name}: expected {reason}, got an answer")
        elif not error.startswith(EXPECTED_STATUS[door][reason]) or text not in error:
            failures.append(f"{name}: expected {reason} with {text!r}, got {error[:300]}")
    assert not failures, "\n".join(failures)
    assert call([good(10_000)])[0][0] is not None
    after = errors_by_reason(triton)
    if door != "gateway":  # the gateway refuses them itself, before Triton
        for reason, n in refused.items():
            assert after[reason] - before[reason] == n, reason
    assert after["internal"] == after["engine_error"] == 0


def test_oversized_state_refused_before_tokenizing(doors, triton: TritonServer) -> None:
    """A state of ~3.9 MB (under the byte limit, ~780,000 tokens) is refused having tokenized a small part of it,
    and one over the byte limit (100 MB) without tokenizing or parsing anything; the server then answers."""
    state = WORDS * (3_900_000 // len(WORDS))
    before = metric_values(triton)
    ((reply, error),) = doors["grpc"]([body(state)])
    middle = settled(
        lambda: metric_values(triton),
        lambda v: v["kev_tokenized_chars_total"] > before["kev_tokenized_chars_total"],
        "the refused request's tokenizing counted",
    )
    assert reply is None and "over the 65,536-token limit" in error and "at least" in error
    tokenized = middle["kev_tokenized_chars_total"] - before["kev_tokenized_chars_total"]
    assert 0 < tokenized < len(state) / 5
    ((reply, error),) = doors["grpc"]([b'{"state": "' + b"a " * (50 << 20) + b'", "questions": {}}'])
    after = settled(lambda: metric_values(triton), lambda v: True, "the model's metrics")
    assert reply is None and "byte limit" in error
    assert after["kev_tokenized_chars_total"] == middle["kev_tokenized_chars_total"]
    assert after["kev_tokenizer_cache_bytes"] < 64 << 20
    assert doors["grpc"]([good(1)])[0][0] is not None


def test_multi_element_request_with_a_bad_element(triton: TritonServer) -> None:
    """A request carrying several JSON strings fails as a whole, naming the element; a separate request beside it
    is answered."""
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        inp = grpcclient.InferInput("REQUEST", [2, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[good(1)], [nested(400)]], dtype=np.object_))
        with pytest.raises(Exception, match=r"REQUEST\[1\]: request JSON is nested"):
            client.infer("kev", [inp])
        assert grpc_call(client, [good(2)])[0][0] is not None
    finally:
        client.close()
