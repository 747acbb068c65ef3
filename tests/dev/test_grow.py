"""The bench's `grow` record (kev_backend/dev/grow.py) and the `grow` traffic shape (dev/workloads.py), run on the
reference path with the tiny checkpoint: each turn's state is the one before plus a message, every turn computed from
the turn before answers as computed from nothing, and the record says how much it reused."""

from __future__ import annotations

from pathlib import Path

from kev_backend.dev import grow
from kev_backend.dev.workloads import Traffic, state_counter
from kev_backend.engine.engine import Engine, EngineOptions


def test_each_turn_continues_the_turn_before() -> None:
    turns = [grow.grow(7, turn)["state"] for turn in range(4)]
    assert all(later.startswith(earlier) for earlier, later in zip(turns, turns[1:]))
    assert grow.grow(8, 0)["state"] != turns[0]
    traffic = Traffic("grow", seed=3)
    sent: dict[str, list[str]] = {}
    for _ in range(60):
        state = traffic.next()["state"]
        sent.setdefault(state.split(".", 1)[0], []).append(state)
    assert len(sent) == Traffic.CONVERSATIONS
    for states in sent.values():  # each conversation's turns in order, each the one before plus a message
        assert all(later.startswith(earlier) and later != earlier for earlier, later in zip(states, states[1:]))


def test_the_grow_record_on_the_reference_path(tiny_dir: Path) -> None:
    engine = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(device="cpu", backend="reference"))
    engine.scorer.chunk_tokens = 256  # points every 256 tokens: the tiny model's turns continue one
    record = grow.grow_record(
        engine, lengths=(2048, 3072), repeat=1, clients=4, seconds=0.5, turns=12, batch_sizes=(2,), near=2048
    )
    count = state_counter(engine.tokenizer)
    opening = count(grow.grow(0, 0))
    for point, length in zip(record["points"], (2048, 3072), strict=True):
        assert point["tokens"] <= max(length, opening + 32)  # the banked turn: the last within the length, or none
        assert point["tokens"] + point["added_tokens"] > length  # and the next passes it
    for point in record["points"]:
        assert 0 < point["added_tokens"] <= 256
        # from the banked turn's point (a 256-token boundary at least 16 tokens before its end): its new tokens and
        # the banked turn's after that point
        assert point["added_tokens"] + 16 <= point["computed_tokens"] < point["added_tokens"] + 256 + 16
        assert min(point["extend_ms"], point["scratch_ms"], point["same_ms"], point["floor_ms"]) > 0
    assert record["rps_4"] > 0
    (batch,) = record["batched"]  # two conversations' next turns together, and as two new states
    assert batch["turns"] == 2 and 0 < batch["computed_tokens"] < 2048
    assert batch["turn_ms"] > 0 and batch["floor_ms"] > 0
    assert (record["turns"], record["differing"]) == (12, 0)
    # every timed and untimed point's next turn, and the compared turns but each conversation's first (6 of 2)
    assert record["prefix_hits"] >= 2 * 2 + 6 and record["tokens_reused"] > 0
    # Conversations together, two at a time, each turn continuing the one before (the reference path's batches are
    # not bit for bit its requests alone, so the batched groups are the GPU test's: tests/gpu/test_determinism.py).
    hits = engine.bank.stats.prefix_hits
    assert grow.differing(engine, 8, per_conversation=4, together=2) == {"turns": 8, "differing": 0}
    assert engine.bank.stats.prefix_hits - hits == 2 * 3


def test_a_conversations_next_turn_waits_for_its_last(tiny_dir: Path) -> None:
    """The record's clients send a conversation's next turn only once its last one is answered, so every turn but a
    conversation's first (and its first after starting over, every 10 turns) continues the turn before."""
    engine = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(device="cpu", backend="reference"))
    engine.scorer.chunk_tokens = 256
    stats = engine.bank.stats
    assert grow.throughput(engine, 3, 1.0, near=2048)["rps"] > 0
    whole = stats.misses - stats.prefix_hits
    assert stats.prefix_hits > 0 and whole <= 3 * (1 + stats.misses // 10), stats
