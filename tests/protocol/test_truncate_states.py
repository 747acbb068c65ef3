"""Kev's state truncation (`truncate_states`, KEV_TRUNCATE_STATES) and date facts (`date_facts`, KEV_DATE_FACTS) on
real components: the encoder against a byte-level BPE with Qwen's pre-tokenizer, the engine and its bank on the tiny
checkpoint, and one tritonserver with both options on (the first as a config.pbtxt parameter, the second from the
environment) behind the real gateway, through tritonclient, plain HTTP and the TypeSafe SDK."""

from __future__ import annotations

import json
import random
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from typesafe_sdk import Noul, RetryPolicy, TypeSafeClient

from kev_backend.engine.engine import Engine, EngineOptions
from kev_backend.protocol import encoding
from kev_backend.protocol.answers import response_body
from kev_backend.protocol.encoding import KevTokenizer
from kev_backend.protocol.request import (
    MAX_JSON_DEPTH,
    Limits,
    Record,
    RequestError,
    parse_request,
    row_too_long_message,
    state_too_long_message,
)
from kev_backend.settings import GatewaySettings, ModelSettings
from tests.conftest import REPO, TritonServer, start_gateway, start_triton, stop_gateway, stop_triton
from tests.helpers import CORPUS, http_all, kev_tokenizer, post, random_text

NOUL = {"type": "noul", "instructions": "is this urgent ?"}


def record(state: str, questions: dict | None = None) -> Record:
    return parse_request({"state": state, "questions": questions or {"q": NOUL}}, Limits(max_request_bytes=8 << 20))


@pytest.fixture
def tokenizer(qwen_bpe: Tokenizer, tmp_path: Path) -> KevTokenizer:
    return kev_tokenizer(qwen_bpe, tmp_path)


# --- the encoder ---------------------------------------------------------------------------------------------------


def test_a_state_over_the_limit_keeps_its_first_tokens(qwen_bpe: Tokenizer, tokenizer: KevTokenizer) -> None:
    """<state> plus the first max_state_tokens - 1 tokens of the whole text's tokenization: the model reads exactly
    max_state_tokens; the whole count is the one the 422 reports with the option off."""
    text = " ".join(CORPUS * 3)
    whole = qwen_bpe.encode(text).ids
    limits = Limits(max_state_tokens=40, truncate_states=True)
    encoded = encoding.encode(record(text), tokenizer, limits)
    assert encoded.state[0] == tokenizer.delimiters.state and list(encoded.state[1:]) == whole[:39]
    assert len(encoded.state) == 40 and encoded.state_tokens == 1 + len(whole) and encoded.dropped == len(whole) - 39
    assert encoded.input_tokens == 40 + len(encoded.questions[0].tokens)
    with pytest.raises(RequestError) as refused:
        encoding.encode(record(text), tokenizer, Limits(max_state_tokens=40))
    assert refused.value.detail == state_too_long_message(encoded.state_tokens, 40)
    assert tokenizer.cache.get(text) is None  # a cut state is never cached as its text's tokens


@pytest.mark.parametrize("extra", [0, 1])
def test_at_the_limit_nothing_is_cut(qwen_bpe: Tokenizer, tokenizer: KevTokenizer, extra: int) -> None:
    text = CORPUS[0]
    n = 1 + len(qwen_bpe.encode(text).ids)  # with <state>
    limits = Limits(max_state_tokens=n - extra, truncate_states=True)
    encoded = encoding.encode(record(text), tokenizer, limits)
    assert (len(encoded.state), encoded.state_tokens, encoded.dropped) == (n - extra, n, extra)
    # Read whole, the text is cached as any text is; cut, it is not.
    assert (tokenizer.cache.get(text) is not None) == (extra == 0)


def test_a_long_state_is_cut_in_bounded_pieces(qwen_bpe: Tokenizer, tokenizer: KevTokenizer) -> None:
    """A state far over LAZY_CHARS: the kept tokens are the whole text's first ones, the count is the whole text's,
    and the text is tokenized whole only as far as the cut and one piece more."""
    text = random_text(random.Random(5), 60_000)
    whole = qwen_bpe.encode(text).ids
    assert len(text) > 4 * encoding.LAZY_CHARS
    keep = 3_000
    encoded = encoding.encode(record(text), tokenizer, Limits(max_state_tokens=keep + 1, truncate_states=True))
    assert list(encoded.state[1:]) == whole[:keep] and encoded.state_tokens == 1 + len(whole)
    # Every piece counted once, and the head (up to one piece past the cut) tokenized whole: two pieces here.
    assert tokenizer.tokenized_chars - len(text) <= 2 * encoding.LAZY_CHARS + len("is this urgent ? no yes")
    # Under the limit the state is read whole, as with the option off.
    loose = Limits(max_state_tokens=len(whole) + 1, max_row_tokens=len(whole) + 99, max_request_tokens=len(whole) + 99)
    on = encoding.encode(record(text), tokenizer, replace(loose, truncate_states=True))
    assert on.state == encoding.encode(record(text), tokenizer, loose).state and on.dropped == 0


def test_the_row_limit_holds_after_the_cut(tokenizer: KevTokenizer) -> None:
    text = " ".join(CORPUS * 3)
    question = {"q": {"type": "noul", "instructions": "refund"}}  # [<q>] refund [<opt>] no [</opt>] ... [<decide>]
    limits = Limits(max_state_tokens=20, max_row_tokens=40, truncate_states=True)
    branch = len(encoding.encode(record(text, question), tokenizer, limits).questions[0].tokens)
    tight = Limits(max_state_tokens=20, max_row_tokens=20 + branch - 1, truncate_states=True)
    with pytest.raises(RequestError) as refused:
        encoding.encode(record(text, question), tokenizer, tight)
    assert refused.value.detail == row_too_long_message(branch, 20, 20 + branch - 1)


def test_the_body_marks_truncation_only_when_the_server_may() -> None:
    answers = {"q": {"type": "noul", "noul": 0.5}}
    plain = response_body("kev", answers, 12, 5, 1.0)
    assert list(plain) == ["model", "answers", "usage", "latency_ms"] and list(plain["usage"]) == [
        "input_tokens",
        "output_tokens",
    ]
    marked = response_body("kev", answers, 12, 5, 1.0, state_tokens=(90, 8))
    assert list(marked) == ["model", "answers", "usage", "latency_ms", "truncated"] and marked["truncated"] is True
    assert marked["usage"] == {"input_tokens": 12, "output_tokens": 5, "state_tokens": 90, "state_tokens_used": 8}
    assert list(marked["usage"]) == ["input_tokens", "output_tokens", "state_tokens", "state_tokens_used"]
    assert response_body("kev", answers, 12, 5, 1.0, state_tokens=(8, 8))["truncated"] is False


def test_the_setting_is_a_request_limit_for_the_model_and_the_gateway() -> None:
    def read(params: dict[str, str], **env: str) -> Limits:
        return ModelSettings.read({"checkpoint": "kev", **params}, Path("/models/kev"), env).limits

    assert read({}) == Limits() and not Limits().truncate_states
    assert read({"truncate_states": "on"}).truncate_states is True
    assert read({"truncate_states": "true"}, KEV_TRUNCATE_STATES="off").truncate_states is False
    assert read({}, KEV_TRUNCATE_STATES="1") == Limits(truncate_states=True)
    gateway = GatewaySettings.read({"KEV_TRUNCATE_STATES": ""})
    assert gateway.limits({"truncate_states": "yes"}).truncate_states is True


# --- the engine ------------------------------------------------------------------------------------------------------

LONG = " ".join(["the invoice total was wrong and the refund is late"] * 12)  # 121 tokens with <state>


def test_cut_states_share_a_bank_entry(tiny_dir: Path) -> None:
    """Two states that differ only past the cut are one state to the model: one bank entry, the same answers."""
    limits = Limits(max_state_tokens=32, max_row_tokens=64, truncate_states=True)
    engine = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(limits=limits))
    (first,) = engine.answer([{"state": LONG, "questions": {"q": NOUL}}])
    (second,) = engine.answer([{"state": f"{LONG} and more", "questions": {"q": NOUL}}])
    assert (engine.bank_stats.misses, engine.bank_stats.hits, len(engine.bank)) == (1, 1, 1)
    assert first["answers"] == second["answers"] and first["truncated"] and second["truncated"]
    assert first["usage"]["state_tokens_used"] == second["usage"]["state_tokens_used"] == 32
    assert second["usage"]["state_tokens"] == first["usage"]["state_tokens"] + 2 == 123
    short = engine.answer([{"state": "a short state", "questions": {"q": NOUL}}])[0]
    assert short["truncated"] is False and short["usage"]["state_tokens"] == short["usage"]["state_tokens_used"]


# --- end to end: one server with both options on ------------------------------------------------------------------

MAX_STATE = 64
MAX_BYTES = 300_000
OPTIONS = {
    "truncate_states": "on",
    "max_state_tokens": str(MAX_STATE),
    "max_row_tokens": "96",
    "max_questions": "40",
    "max_request_bytes": str(MAX_BYTES),
}
DATED = "the order was placed on 2026-01-05 and the refund came on 2026-02-14"
UNDATED = "the refund is late and the customer is angry"


def repository_with(parameters: dict[str, str], root: Path) -> Path:
    """A copy of the model repository whose config.pbtxt sets `parameters`."""
    (root / "kev" / "1").mkdir(parents=True)
    config = (REPO / "model_repository" / "kev" / "config.pbtxt").read_text()
    entries = "".join(f'  {{ key: "{k}", value: {{ string_value: "{v}" }} }},\n' for k, v in parameters.items())
    anchor = "parameters [\n"
    assert config.count(anchor) == 1
    (root / "kev" / "config.pbtxt").write_text(config.replace(anchor, anchor + entries))
    (root / "kev" / "1" / "model.py").write_text((REPO / "model_repository" / "kev" / "1" / "model.py").read_text())
    return root


@pytest.fixture(scope="module")
def served(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """tritonserver with truncate_states (config.pbtxt) and date_facts (KEV_DATE_FACTS) on, and a gateway before it;
    both given KEV_DTYPE and a body limit, as kev-serve gives its children one environment."""
    root = tmp_path_factory.mktemp("options")
    repository = repository_with(OPTIONS, root / "repository")
    env = {"KEV_DATE_FACTS": "1", "KEV_DTYPE": "fp32", "KEV_GATEWAY_MAX_DECODED_BYTES": str(MAX_BYTES)}
    server = start_triton(tiny_dir / "kev", root / "triton.log", repository=repository, **env)
    gateway = start_gateway(server, root / "gateway.log", **env)
    yield server, gateway
    stop_gateway(gateway)
    stop_triton(server)


@pytest.fixture(scope="module")
def engine_with_options(tiny_dir: Path) -> Engine:
    limits = Limits(max_state_tokens=MAX_STATE, max_row_tokens=96, truncate_states=True)
    return Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(limits=limits, date_facts=True))


def close(actual: dict, expected: dict) -> None:
    """The same body as the in-process engine's, probabilities within one unit of the 4th decimal."""
    assert list(actual) == list(expected) and actual["usage"] == expected["usage"]
    assert actual.get("truncated") == expected.get("truncated")
    for qid, want in expected["answers"].items():
        assert abs(actual["answers"][qid]["noul"] - want["noul"]) <= 1.00001e-4


def test_truncating_server_marks_every_response(served, engine_with_options: Engine) -> None:
    server, _ = served
    bodies = [{"state": state, "questions": {"q": NOUL}} for state in (LONG, UNDATED)]
    long, short = http_all(server, bodies)
    assert long["truncated"] is True and short["truncated"] is False
    assert list(long) == ["model", "answers", "usage", "latency_ms", "truncated"]
    assert (long["usage"]["state_tokens"], long["usage"]["state_tokens_used"]) == (121, MAX_STATE)
    assert short["usage"]["state_tokens"] == short["usage"]["state_tokens_used"]
    for actual, body in zip((long, short), bodies):
        close(actual, engine_with_options.answer([body])[0])


def test_through_the_gateway_and_the_sdk(served, engine_with_options: Engine) -> None:
    _, gateway = served
    status, _, reply = post(gateway, "/v1/systemone", {"state": LONG, "questions": {"q": NOUL}}, key=None)
    assert status == 200 and reply["truncated"] is True and reply["usage"]["state_tokens"] == 121
    close(reply, engine_with_options.answer([{"state": LONG, "questions": {"q": NOUL}}])[0])
    with urllib.request.urlopen(f"{gateway.url}/v1/models", timeout=30) as response:
        cards = json.loads(response.read())["models"]
    # The limits in force: the model config's, the gateway's decoded-body limit, the defaults for the rest.
    limits = {
        "max_request_bytes": MAX_BYTES,
        "max_json_depth": MAX_JSON_DEPTH,
        "max_questions": 40,
        "max_state_tokens": MAX_STATE,
        "max_row_tokens": 96,
        "truncate_states": True,
        "dtype": "fp32",
    }
    assert [{key: card[key] for key in limits} for card in cards] == [limits, limits]
    with TypeSafeClient(api_key="any", base_url=gateway.url, retry=RetryPolicy(max_retries=0)) as client:
        result = client.system_one(state=LONG, questions={"q": Noul(instructions=NOUL["instructions"])})
    assert result.usage.input_tokens == reply["usage"]["input_tokens"]
    assert abs(result.nouls["q"].noul - reply["answers"]["q"]["noul"]) <= 1e-4


def test_separate_and_permute_carry_the_marks(served) -> None:
    """As Kev's server: /separate takes the marks of its parts (one state), /permute adds them after `spread`."""
    _, gateway = served
    choice = {"type": "choice", "instructions": "route", "criteria": {"billing": None, "tech": None, "other": None}}
    body = {"state": LONG, "questions": {"q": NOUL, "c": choice}}
    status, _, separate = post(gateway, "/v1/systemone/separate", body, key=None)
    assert status == 200 and list(separate) == ["model", "answers", "usage", "latency_ms", "truncated"]
    assert separate["truncated"] is True
    assert (separate["usage"]["state_tokens"], separate["usage"]["state_tokens_used"]) == (121, MAX_STATE)
    status, _, permute = post(
        gateway, "/v1/systemone/permute", {"request": body, "question": "c", "n_perm": 3}, key=None
    )
    assert status == 200 and list(permute) == ["runs", "argmax_stable", "spread", "truncated", "usage"]
    assert permute["truncated"] is True and permute["usage"] == {"state_tokens": 121, "state_tokens_used": MAX_STATE}
    status, _, short = post(gateway, "/v1/systemone/separate", {"state": UNDATED, "questions": {"q": NOUL}}, key=None)
    assert status == 200 and short["truncated"] is False


def test_the_parts_of_a_request_within_the_byte_limit_stay_within_it(served) -> None:
    """/separate sends the state again with each question. Written as compact UTF-8 JSON a part is no larger than
    the request, so non-ASCII text (six bytes a character once escaped) does not take it past the model's limit."""
    _, gateway = served
    body = {"state": "déjà été " * 20_000, "questions": {"q": NOUL, "r": NOUL}}
    sent = json.dumps(body, ensure_ascii=False).encode()
    assert len(sent) < MAX_BYTES < len(json.dumps(body).encode())
    status, _, reply = post(gateway, "/v1/systemone/separate", sent, key=None)
    assert status == 200 and reply["truncated"] is True and list(reply["answers"]) == ["q", "r"], reply


def test_date_facts_change_only_dated_states(served, triton: TritonServer) -> None:
    """Against a server with the option off: a state with two dates reads more tokens and gets another answer; one
    without dates gets the same answer."""
    server, _ = served
    bodies = [{"state": state, "questions": {"q": NOUL}} for state in (DATED, UNDATED)]
    (dated_on, undated_on), (dated_off, undated_off) = http_all(server, bodies), http_all(triton, bodies)
    assert dated_on["truncated"] is False  # the facts fit: only they make the difference
    assert dated_on["usage"]["input_tokens"] > dated_off["usage"]["input_tokens"]
    assert dated_on["answers"] != dated_off["answers"]
    assert undated_on["usage"]["input_tokens"] == undated_off["usage"]["input_tokens"]
    assert abs(undated_on["answers"]["q"]["noul"] - undated_off["answers"]["q"]["noul"]) <= 1.00001e-4
