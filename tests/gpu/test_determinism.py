"""Deterministic answers on the GPU: on random weights of Kev-4B shapes, every question of >= 1,000 realistic ones
gets the same probabilities, bit for bit, alone and inside random batch mixes of 1 to 64 requests (new and banked
states, states evicted between batches), through CUDA graphs and eagerly (kev_backend/dev/determinism.py); and a
request's response body is the same alone as in a batch, `latency_ms` aside."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kev_backend.dev import determinism, sizes, synthetic
from kev_backend.dev.workloads import realistic
from kev_backend.engine.engine import Engine, EngineOptions

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
