"""Deterministic answers on the GPU: on random weights of Kev-4B shapes, every question of >= 1,000 realistic ones
gets the same probabilities, bit for bit, alone and inside random batch mixes of 1 to 64 requests (new and banked
states, states evicted between batches), through CUDA graphs and eagerly (kev_backend/dev/determinism.py); and a
request's response body is the same alone as in a batch, `latency_ms` aside. A pre-tuned GEMM table tuned on another
GPU or cuBLASLt version is passed over, says so, and changes no bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kev_backend.dev import determinism, grow, sizes, synthetic
from kev_backend.dev.workloads import realistic
from kev_backend.engine.engine import Engine, EngineOptions
from kev_backend.gpu import cublaslt

pytestmark = pytest.mark.gpu


def test_every_answer_has_the_same_bits_in_any_batch(tiny_dir: Path, parity_questions: int) -> None:
    checkpoint = synthetic.synthetic_checkpoint({**sizes.KEV4B_CONFIG}, tiny_dir / "base", "cuda", seed=0)
    engine = Engine(checkpoint, EngineOptions(backend="fused", bank_bytes=16 << 30))
    requests = realistic(parity_questions, seed=5, max_words=2300)
    encoded = [engine.prepare(body)[1] for body in requests]
    report = determinism.check(engine.scorer, encoded, mixes=3)
    print("determinism", json.dumps(report))
    assert report["questions"] >= parity_questions and report["compared"] == 6 * report["questions"]
    assert report["differing"] == 0 and report["graphs_vs_eager_differing"] == 0, report

    def body(result: dict) -> str:
        return json.dumps({key: value for key, value in result.items() if key != "latency_ms"}, sort_keys=True)

    some = requests[:48]
    engine.bank.clear()
    alone = [body(engine.answer([request])[0]) for request in some]
    engine.bank.clear()
    assert [body(result) for result in engine.answer(some)] == alone
    del engine, checkpoint
    torch.cuda.empty_cache()


def test_growing_conversations_answer_as_computed_whole(tiny_dir: Path, parity_questions: int) -> None:
    """Kev-4B shapes: >= 1,000 turns of growing conversations (the `grow` workload, ~2,000 to ~7,000 tokens), each
    computed from the turn before's point, alone (a turn and its rows: an extensions' graph) and with the same turn of
    seven other conversations in one batch (eagerly), give the same bits as the same turn computed from nothing
    (kev_backend/dev/grow.py's `differing`)."""
    checkpoint = synthetic.synthetic_checkpoint({**sizes.KEV4B_CONFIG}, tiny_dir / "base", "cuda", seed=0)
    engine = Engine(checkpoint, EngineOptions(backend="fused", bank_bytes=16 << 30))
    hits = engine.bank.stats.prefix_hits
    report = grow.differing(engine, parity_questions)
    print("growing", json.dumps(report), "prefix hits", engine.bank.stats.prefix_hits - hits)
    assert report["turns"] >= parity_questions and report["differing"] == 0, report
    assert engine.bank.stats.prefix_hits - hits >= report["turns"] * 0.9
    del engine, checkpoint
    torch.cuda.empty_cache()


def test_a_table_tuned_elsewhere_is_passed_over_and_changes_no_bit(tiny_dir: Path, tmp_path: Path) -> None:
    """The packaged table for this GPU, relabelled as tuned on the next cuBLASLt version: the engine given it uses no
    table and its start-up line says which it passed over and why; its answers are those of the engine on the
    matching table, bit for bit, alone and in batch mixes."""
    checkpoint = synthetic.synthetic_checkpoint({**sizes.KEV4B_CONFIG}, tiny_dir / "base", "cuda", seed=0)
    requests = realistic(200, seed=7, max_words=2300)

    def bodies(engine: Engine) -> list[str]:
        engine.bank.clear()
        results = [engine.answer([request])[0] for request in requests[:64]]
        return [json.dumps({k: v for k, v in r.items() if k != "latency_ms"}, sort_keys=True) for r in results]

    matching = Engine(checkpoint, EngineOptions(backend="fused", bank_bytes=4 << 30))
    used = matching.gemm_algos
    assert used is not None
    if not used["shapes"]:
        pytest.skip(f"no packaged GEMM table for {torch.cuda.get_device_name()}")
    expected = bodies(matching)
    table = json.loads((cublaslt.TABLES / str(used["table"])).read_text())
    del matching
    torch.cuda.empty_cache()
    elsewhere = tmp_path / "tuned-elsewhere.json"
    elsewhere.write_text(json.dumps(table | {"cublaslt_version": int(table["cublaslt_version"]) + 1}))
    engine = Engine(checkpoint, EngineOptions(backend="fused", bank_bytes=4 << 30, gemm_algos=str(elsewhere)))
    said = engine.gemm_algos
    assert said is not None and said["shapes"] == 0 and said["table"] == ""
    line = engine.summary()
    assert "no pre-tuned table used: this is " in line and "tuned-elsewhere.json: " in line, line
    assert bodies(engine) == expected
    encoded = [engine.prepare(body)[1] for body in requests]
    report = determinism.check(engine.scorer, encoded, mixes=2)
    print("determinism, a table passed over", json.dumps(report))
    assert report["differing"] == 0 and report["graphs_vs_eager_differing"] == 0, report
    del engine, checkpoint
    torch.cuda.empty_cache()
