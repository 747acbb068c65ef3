"""What the test modules share besides fixtures (tests/conftest.py): request bodies, calls to a server and to the
gateway, comparisons of answers, a Qwen-style tokenizer and README's examples."""

from __future__ import annotations

import ast
import asyncio
import json
import queue
import random
import re
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tritonclient.utils import InferenceServerException

from kev_backend.protocol import encoding
from kev_backend.protocol.encoding import KevTokenizer
from tests.conftest import REPO, Gateway, TritonServer

# --- requests -----------------------------------------------------------------------------------------------------

TICKET = "my card was charged twice for the same order , please refund one payment today"
QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "is this urgent ?", "criteria": {"true": "needs a reply today"}},
    "team": {
        "type": "choice",
        "instructions": {"task": "route the ticket", "note": "pick one team"},
        "criteria": {"billing": "payments and refunds", "technical": None, "sales": {"covers": ["plans", "upgrade"]}},
    },
    "tone": {"type": "score", "instructions": "customer sentiment", "criteria": ["angry", "neutral", "happy"]},
    "lang": {"type": "choice", "instructions": "language", "criteria": {"english": "", "french": None}},
}


def request(state: object = TICKET, questions: dict | None = None, **extra: object) -> dict:
    return {"state": state, "questions": QUESTIONS if questions is None else questions, **extra}


TEAMS = {"billing": "payments and refunds", "technical": None, "sales": {"covers": ["plans", "upgrade"]}}
STATES = [
    "my card was charged twice for the same order , please refund one payment",
    {"log": "timeout on login page", "status": 504, "retries": [1, 2.5, None]},
    ["password reset email never arrived", {"customer": "pro plan", "months": 14}],
    "the app crash after the last update , data lost",
    " ".join(["the invoice total was wrong and the refund is late"] * 40),  # ~400 tokens
]


def make_request(i: int) -> dict:
    questions = {
        "urgent": {"type": "noul", "instructions": "is this urgent ?", "criteria": {"true": "reply today"}},
        "team": {"type": "choice", "instructions": f"route ticket {i}", "criteria": TEAMS},
        "tone": {"type": "score", "instructions": "sentiment", "criteria": ["angry", "neutral", "happy"]},
    }
    keep = list(questions)[: 1 + i % 3]  # 1 to 3 questions, states shared between requests
    return {"state": STATES[i % len(STATES)], "model": f"kev-{i}", "questions": {k: questions[k] for k in keep}}


# --- answers ------------------------------------------------------------------------------------------------------


def max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True))


def assert_same_answer(actual: dict, expected: dict) -> None:
    """Equal to the in-process engine: the same fields, keys, choices and usage; probabilities may differ only by
    one unit of the 4th decimal (a different batch shape can move fp32 sums across a rounding boundary)."""
    assert actual["model"] == expected["model"] and actual["usage"] == expected["usage"]
    assert set(actual) == {"model", "answers", "usage", "latency_ms"}
    for qid, want in expected["answers"].items():
        got = actual["answers"][qid]
        assert list(got) == list(want)
        for key, value in want.items():
            if isinstance(value, float):
                assert abs(got[key] - value) <= 1.00001e-4, (qid, key)
            elif key == "probabilities":
                assert list(got[key]) == list(value)
                assert all(abs(got[key][k] - v) <= 1.00001e-4 for k, v in value.items()), qid
            else:
                assert got[key] == value, (qid, key)


# --- calls --------------------------------------------------------------------------------------------------------


def request_array(body: dict | bytes) -> np.ndarray:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return np.array([[raw]], dtype=np.object_)


def http_all(server: TritonServer, bodies: list) -> list:
    """All bodies in flight at once over HTTP (asyncio client); each result is a response dict or the exception."""

    async def run() -> list:
        client = httpaio.InferenceServerClient(server.http_url)

        async def one(body: dict | bytes) -> dict | InferenceServerException:
            inp = httpclient.InferInput("REQUEST", [1, 1], "BYTES")
            inp.set_data_from_numpy(request_array(body))
            try:
                result = await client.infer("kev", [inp])
            except InferenceServerException as error:
                return error
            return json.loads(result.as_numpy("RESPONSE")[0, 0])

        try:
            return await asyncio.gather(*(one(body) for body in bodies))
        finally:
            await client.close()

    return asyncio.run(run())


def grpc_all(server: TritonServer, bodies: list) -> list:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    done: queue.Queue = queue.Queue()
    try:
        for i, body in enumerate(bodies):
            inp = grpcclient.InferInput("REQUEST", [1, 1], "BYTES")
            inp.set_data_from_numpy(request_array(body))
            client.async_infer("kev", [inp], callback=lambda result, error, i=i: done.put((i, result, error)))
        results: list = [None] * len(bodies)
        for _ in bodies:
            i, result, error = done.get(timeout=120)
            results[i] = error if error is not None else json.loads(result.as_numpy("RESPONSE")[0, 0])
        return results
    finally:
        client.close()


def post(gateway: Gateway, path: str, body: bytes | dict, key: str | None = None, **headers: str):
    """(status, headers, parsed body) of a plain HTTP POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        gateway.url + path, data=data, method="POST", headers={"content-type": "application/json", **headers}
    )
    if key:
        request.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


# --- a Qwen-style tokenizer ---------------------------------------------------------------------------------------

# Qwen2/3's pre-tokenizer: this split, then byte-level without its own regex.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "My card was charged twice for the same order. Please refund one payment!",
    "Timeout on login page: status 504, retries [1, 2.5, None] -- see logs at 12:30.",
    "Das Passwort-Zurücksetzen kam nie an; 你好，世界。 Ça marche très bien, naïve café.",
    "    indented code = {'a': 1}\n\n\tdef f(x):\n        return x ** 2\r\n",
]


def qwen_bpe() -> Tokenizer:
    """A byte-level BPE with Qwen2/3's pre-tokenizer, trained on CORPUS (a 600-token vocabulary: quick to train)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 50, trainer)
    return tokenizer


def random_text(rng: random.Random, n: int) -> str:
    pieces = [
        *" ".join(CORPUS).split(" "),
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "!!",
        "42",
        "x" * 40,
        "é",
        "你好",
    ]
    return "".join(rng.choice(pieces) + rng.choice(["", " "]) for _ in range(n))


def kev_tokenizer(bpe: Tokenizer, tmp_path: Path) -> KevTokenizer:
    bpe.add_special_tokens(list(encoding.DELIMITER_TOKENS.values()))
    bpe.save(str(tmp_path / "tokenizer.json"))
    return KevTokenizer(tmp_path)


# --- README's examples --------------------------------------------------------------------------------------------


def readme_examples() -> tuple[dict, dict, dict]:
    """README's examples, read from it so that what it shows is what is tested: the curl request to Triton's HTTP
    port, the answers it prints (the embedded toy checkpoint's), and the tritonclient (gRPC) example's request."""
    text = (REPO / "README.md").read_text()
    curl = re.search(r"curl -s localhost:8000/v2/models/kev/infer -d '(.*?)'\n```", text, re.DOTALL)
    shown = re.search(r"```json\n(.*?)\n```", text, re.DOTALL)
    grpc = re.search(r"\nrequest = (\{.*?\n\})\nclient = grpcclient", text, re.DOTALL)
    assert curl and shown and grpc, "README's Triton examples were not found"
    request = json.loads(json.loads(curl.group(1))["inputs"][0]["data"][0])
    answers = json.loads(json.loads(shown.group(1))["outputs"][0]["data"][0])["answers"]
    return request, answers, ast.literal_eval(grpc.group(1))


README_REQUEST, README_ANSWERS, README_GRPC_REQUEST = readme_examples()

TRITON_HTTP = """
import json, sys, urllib.request
body = {"inputs": [{"name": "REQUEST", "shape": [1, 1], "datatype": "BYTES", "data": [sys.argv[1]]}]}
request = urllib.request.Request("http://127.0.0.1:8000/v2/models/kev/infer", json.dumps(body).encode())
print(urllib.request.urlopen(request, timeout=30).read().decode())
"""


def error_detail(reply: dict) -> dict:
    """A gateway error body without its `request_id` (every JSON error names the request id it answered, as the
    x-typesafe-request-id header does), which it must have."""
    assert isinstance(reply.get("request_id"), str) and reply["request_id"], reply
    return {key: value for key, value in reply.items() if key != "request_id"}
