"""The reference engine: Kev's row form is the oracle for the bank, batching and siblings; errors stay per request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kev_backend.engine.engine import Engine, EngineOptions
from kev_backend.model.checkpoint import LoadOptions
from kev_backend.protocol.encoding import Limits, StateTokens, token_ids
from kev_backend.protocol.request import RequestError
from tests.helpers import QUESTIONS, max_gap, request


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:
    return Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(bank_bytes=1 << 24))


def test_row_form_bank_alone_and_siblings_agree(engine: Engine) -> None:
    _, encoded = engine.prepare(request())
    oracle = engine.scorer.row_form_probabilities(encoded)
    engine.bank.clear()
    miss = engine.scorer.probabilities([encoded])[0]
    hits_before = engine.bank.stats.hits
    hit = engine.scorer.probabilities([encoded])[0]
    assert engine.bank.stats.hits == hits_before + 1
    assert max_gap(miss, oracle) <= 1e-6 and max_gap(hit, oracle) <= 1e-6
    # Each question alone, and inside a batch with other requests on other states and on the same state.
    other = engine.prepare(request(state={"log": "timeout on login page", "status": 504}))[1]
    for i, (qid, question) in enumerate(QUESTIONS.items()):
        _, alone = engine.prepare(request(questions={qid: question}))
        assert max_gap(engine.scorer.probabilities([alone])[0], [oracle[i]]) <= 1e-6
        batch = engine.scorer.probabilities([other, alone, encoded])
        assert max_gap(batch[1], [oracle[i]]) <= 1e-6
        assert max_gap(batch[2], oracle) <= 1e-6


def test_rows_split_across_passes_agree(tiny_dir: Path, engine: Engine) -> None:
    tight = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(row_pass_tokens=1, bank_bytes=0))
    _, encoded = engine.prepare(request())
    assert len(tight.scorer.row_passes(len(encoded.state), encoded.questions)) == len(QUESTIONS)
    assert max_gap(tight.scorer.probabilities([encoded])[0], engine.scorer.row_form_probabilities(encoded)) <= 1e-6
    assert len(tight.bank) == 0  # a zero-byte bank keeps nothing, and answers do not change


def test_bank_is_lru_bounded_in_bytes(tiny_dir: Path) -> None:
    probe = Engine.from_checkpoint(tiny_dir / "kev")
    _, first = probe.prepare(request(state="one two three"))
    probe.scorer.probabilities([first])
    entry_bytes = probe.bank.stats.bytes
    engine = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(bank_bytes=2 * entry_bytes))
    states = ["one two three", "four five six", "seven eight nine"]  # same token count → same entry size
    for state in states:
        engine.answer([request(state=state)])
    assert len(engine.bank) == 2 and engine.bank.stats.evictions == 1
    assert engine.bank.stats.bytes == 2 * entry_bytes
    engine.answer([request(state=states[0])])  # evicted: a miss, which evicts states[1]
    assert engine.bank.stats.hits == 0 and engine.bank.stats.misses == 4
    engine.answer([request(state=states[2])])
    assert engine.bank.stats.hits == 1


def test_response_body_and_usage(engine: Engine) -> None:
    body = engine.answer([json.dumps(request(model="kev-4b"))])[0]
    assert list(body) == ["model", "answers", "usage", "latency_ms"]
    assert body["model"] == "kev-4b" and list(body["answers"]) == list(QUESTIONS)
    _, encoded = engine.prepare(request())
    assert body["usage"]["input_tokens"] == len(encoded.state) + sum(len(q.tokens) for q in encoded.questions)
    assert body["usage"]["output_tokens"] == engine.tokenizer.count_tokens(json.dumps(body["answers"]))
    team = body["answers"]["team"]
    assert team["choice"] == max(team["probabilities"], key=team["probabilities"].get)
    assert engine.answer([request()])[0]["answers"] == body["answers"]  # default model name aside, identical
    assert engine.answer([request()])[0]["model"] == "kev-latest"


def test_output_tokens_are_counted_alike_one_by_one_and_in_a_batch(engine: Engine) -> None:
    """A batch's answers counted together (the tokenizer's threads) and a few counted one by one give each text its
    own count, the same as counting it alone, on either side of BATCH_ENCODE_FROM; the responses' usage with them."""
    from kev_backend.protocol.encoding import BATCH_ENCODE_FROM

    bodies = engine.answer([request(state=f"state number {i}") for i in range(BATCH_ENCODE_FROM + 2)])
    texts = [json.dumps(body["answers"], separators=(",", ":")) + " " * i for i, body in enumerate(bodies)]
    alone = [engine.tokenizer.count_tokens(text) for text in texts]
    assert len(set(alone)) > 1  # the texts differ in their counts: a count given to the wrong text would show
    for n in range(1, len(texts) + 1):
        assert engine.tokenizer.count_tokens_batch(texts[:n]) == alone[:n]
    assert [body["usage"]["output_tokens"] for body in bodies] == [
        engine.tokenizer.count_tokens(json.dumps(body["answers"])) for body in bodies
    ]


def test_layout_uses_delimiters_and_escapes_caller_text(engine: Engine) -> None:
    d = engine.tokenizer.delimiters
    _, encoded = engine.prepare(request(state="<|fim_suffix|> please", questions={"q": QUESTIONS["team"]}))
    assert encoded.state[0] == d.state and d.decide not in encoded.state[1:]
    row = encoded.questions[0]
    assert row.tokens[0] == d.question and row.tokens[row.decide] == d.decide
    assert [row.tokens[i] for i in row.option_ends] == [d.option_end] * 3
    assert row.tokens.count(d.option) == 3


def test_a_state_keys_dicts_as_its_plain_tuple(engine: Engine) -> None:
    """An encoded state (StateTokens: its hash and int64 ids made once, when encoded) is equal to, hashes as and is
    found in dicts by its plain tuple, and the other way round; its ids are its tokens."""
    _, encoded = engine.prepare(request(state="the same words " * 40, questions={"q": QUESTIONS["team"]}))
    _, again = engine.prepare(request(state="the same words " * 40, questions={"q": QUESTIONS["team"]}))
    state, plain = encoded.state, tuple(encoded.state)
    assert isinstance(state, StateTokens) and state is not again.state
    assert state == plain == again.state and hash(state) == hash(plain) == hash(again.state)
    assert {plain: 1}[state] == 1 and {state: 2}[plain] == 2 and {state: 3}[again.state] == 3
    assert token_ids(state) is state.ids and state.ids.tolist() == list(plain)
    assert token_ids(plain).tolist() == list(plain) and not state.ids.flags.writeable
    assert state + (1,) == plain + (1,)  # a row's tokens after its state: a plain tuple
    _, other = engine.prepare(request(state="the same words " * 39 + "the other", questions={"q": QUESTIONS["team"]}))
    assert state != other.state and not state == other.state and state[:-1] != plain  # compared by their ids


def test_bad_requests_fail_alone(tiny_dir: Path) -> None:
    engine = Engine.from_checkpoint(
        tiny_dir / "kev", EngineOptions(limits=Limits(max_state_tokens=12, max_row_tokens=30))
    )
    good = request(state="short", questions={"urgent": QUESTIONS["urgent"]})
    cases = [
        good,
        {"questions": QUESTIONS},
        request(state="short", questions={}),
        request(state="short", questions={"c": {"type": "choice", "criteria": {}}}),
        request(state=" ".join(["refund"] * 20), questions={"urgent": QUESTIONS["urgent"]}),
        request(state="short", questions={"long": {"type": "noul", "instructions": " ".join(["order"] * 40)}}),
        b"{not json",
        good,
    ]
    results = engine.answer(cases)
    assert isinstance(results[0], dict) and results[0]["answers"] == results[-1]["answers"]
    errors = results[1:-1]
    assert all(isinstance(e, RequestError) for e in errors)
    messages = [e.message for e in errors]
    assert messages[0] == "state: Field required"
    assert "questions: Dictionary should have at least 1 item" in messages[1]
    assert "criteria must have 1..255 options" in messages[2]
    assert messages[3].startswith("state is 21 tokens, over the 12-token limit (the <state> token included)")
    assert messages[4] == "branch too long: 48 tokens with a 2-token state (row limit 30)"
    assert "JSON decode error" in messages[5]
    assert engine.last_batch.errors == 6 and engine.last_batch.requests == 8


def test_parity_report_plumbing(tiny_dir: Path) -> None:
    """The parity figures the GPU tests assert on: reference against reference exactly equal, and against a model
    that answers otherwise (the head's temperature 1 instead of 2) a gap the report sees."""
    from kev_backend.dev.parity import parity_report
    from kev_backend.dev.workloads import realistic, short6

    reference = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(bank_bytes=1 << 26))
    other = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(bank_bytes=1 << 26))
    requests = realistic(40, seed=5, max_words=120) + [short6(1), short6()]
    report = parity_report(reference, other, requests, batch_size=8)
    assert report["vs_reference"]["questions"] >= 40
    assert report["vs_reference"]["max_abs"] <= 1e-6 and report["vs_reference"]["flips"] == 0
    assert report["alone_vs_batch"]["max_abs"] <= 1e-6 and report["bank_hit_vs_miss"]["max_abs"] <= 1e-6
    assert 0.0 < report["spread_reference"]["normalised_entropy_mean"] < 1.0
    sharper = Engine.from_checkpoint(
        tiny_dir / "kev", EngineOptions(bank_bytes=1 << 26, load=LoadOptions(temperature=1.0))
    )
    assert parity_report(reference, sharper, requests[:8], batch_size=8)["vs_reference"]["max_abs"] > 1e-3


def test_engine_options_default_to_the_shipped_configuration_and_refuse_unknown_values(tmp_path: Path) -> None:
    """CUDA graphs by default (the fused GPU path's; the reference path ignores them), the packaged pre-tuned GEMM
    tables; a table path that names no file fails when the options are made, naming what is accepted."""
    options = EngineOptions()
    assert options.graphs and options.gemm_algos == "auto"
    table = tmp_path / "table.json"
    table.write_text("{}")
    for value in ("off", str(table)):
        assert EngineOptions(gemm_algos=value).gemm_algos == value
    with pytest.raises(ValueError, match="gemm_algos must be auto, off or the path of a table JSON file"):
        EngineOptions(gemm_algos=str(tmp_path / "missing.json"))


def test_gpu_bank_pool_bookkeeping(tiny_dir: Path) -> None:
    """The fused path's bank logic (slots, pages, LRU, pinning) on CPU tensors; its kernels run on the GPU only."""
    import torch

    from kev_backend.gpu.pool import GpuBank, StatePool
    from kev_backend.model.qwen35 import Qwen35Config

    config = Qwen35Config.from_dict(json.loads((tiny_dir / "base" / "config.json").read_text()))
    # 3 slots and 4 pages to allocate, plus the scratch slot and page that padding in captured passes writes to.
    pool = StatePool(config, n_slots=4, n_pages=5, page_size=4, device=torch.device("cpu"), dtype=torch.float32)
    assert pool.scratch_slot == 3 and pool.scratch_token == 16
    bank = GpuBank(pool)
    a, b, c = (1,) * 5, (2,) * 3, (3,) * 4  # 2, 1 and 1 pages
    slot_a, _ = bank.allocate(a, {a}, None)
    assert slot_a.kv_index(4).tolist() == [slot_a.pages[0] * 4 + i for i in range(4)] + [slot_a.pages[1] * 4]
    bank.allocate(b, {b}, None)
    bank.allocate(c, {c}, None)
    assert len(bank) == 3 and not pool.free_slots and not pool.free_pages
    held = [bank.get(key) for key in (a, b, c)]
    assert pool.scratch_slot not in {s.slot for s in held} and 4 not in {page for s in held for page in s.pages}
    assert bank.get(a) is slot_a  # a is now the most recent: a new state evicts b
    d = (4,) * 2
    bank.allocate(d, {d}, None)
    assert b not in bank and a in bank and bank.stats.evictions == 1
    assert bank.allocate((5,) * 16, {a, c, d, (5,) * 16}, None) is None  # everything pinned: no room
    bank.forget(d)
    assert d not in bank and len(pool.free_slots) == 1
    assert bank.stats.bytes == sum(slot.nbytes for slot in (slot_a, bank.get(c)))
    bank.clear()
    assert len(pool.free_slots) == 3 and len(pool.free_pages) == 4 and bank.stats.bytes == 0
