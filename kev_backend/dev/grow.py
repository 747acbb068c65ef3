"""The bench's `grow` record: conversations that ask for decisions at every turn of a state that keeps growing
(workloads.grow: a ~2,000-token opening, ~200 tokens and six questions a turn).

    points  for each length, a conversation banked near it and its next turn: the next turn's model time computed from
            the banked turn (extend_ms), from nothing (scratch_ms, the bank emptied first) and asked again (same_ms);
            the state tokens the turn computed from the banked turn (computed_tokens), and the floor under extend_ms:
            a new state of that many tokens with the turn's questions (floor_ms)
    rps_64  turns answered per second by 64 closed-loop clients, each growing its own conversation near 8k tokens
    batched for k conversations near 8k tokens, their next turns in one batch: model time per turn (turn_ms), and the
            floor under it, the same tokens and questions as k new states (floor_ms, per turn): what bounds rps_64 on
            the GPU, the prefix's attention being the difference
    differing  answers of turns computed from the turn before that differ in any bit from the same turns computed
            from nothing (`turns` of them)

with the bank's prefix hits and tokens reused over the record, so a path that computes every state whole (the
reference path extends them: scoring/growth.py) says so.
"""

from __future__ import annotations

import itertools
import statistics
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from ..engine.engine import Engine
from .bench import model_time
from .bench import throughput as closed_loop
from .workloads import GROW_MAX_TOKENS, grow, sized, state_counter

CONVERSATION = itertools.count(10**9)  # conversations no other part of the run sends


def last_turn_within(tokens: int, count: Callable[[dict[str, Any]], int], conversation: int) -> int:
    """The last turn of a conversation whose state has at most `tokens` tokens (0 when even its opening has more)."""
    low, high = 0, GROW_MAX_TOKENS // 150
    while low < high:
        middle = (low + high + 1) // 2
        if count(grow(conversation, middle)) <= tokens:
            low = middle
        else:
            high = middle - 1
    return low


def point(engine: Engine, tokens: int, repeat: int) -> dict[str, Any]:
    """A conversation banked at its last turn within `tokens` (or the one before, where the next would pass Kev's
    state limit), then its next turn: median model times over `repeat` conversations, after one untimed."""
    count = state_counter(engine.tokenizer)
    times: dict[str, list[float]] = {"extend_ms": [], "scratch_ms": [], "same_ms": [], "floor_ms": []}
    stats = engine.bank.stats
    for run in range(repeat + 1):
        conversation = next(CONVERSATION)
        turn = last_turn_within(tokens, count, conversation)
        if count(grow(conversation, turn + 1)) > GROW_MAX_TOKENS:
            turn -= 1
        banked, grown = grow(conversation, turn), grow(conversation, turn + 1)
        model_time(engine, banked)
        before = stats.tokens_computed
        extend = model_time(engine, grown)
        computed = stats.tokens_computed - before
        same = model_time(engine, grown)
        engine.bank.clear()
        scratch = model_time(engine, grown)
        floor = model_time(engine, sized(computed, count, next(CONVERSATION), grown["questions"]))
        if run:  # the first: kernels at this length
            for name, value in zip(times, (extend, scratch, same, floor), strict=True):
                times[name].append(value)
    return {
        "tokens": count(banked),
        "added_tokens": count(grown) - count(banked),
        "computed_tokens": computed,
        **{name: statistics.median(values) for name, values in times.items()},
    }


def differing(engine: Engine, turns: int, per_conversation: int = 25, together: int = 8) -> dict[str, int]:
    """Turns computed from the turn before against the same turns computed from nothing: answers that differ in
    any bit (every probability compared as the fp32 value the head returned). Conversations go `together` at a time:
    every turn alone on an emptied bank, then turn by turn from the turn before, one conversation after another in
    every other group, and in the others each turn of all of them in one batch."""
    answers = differ = group = 0
    while answers < turns:
        left = turns - answers
        length = min(per_conversation, -(-left // together))
        conversations = [next(CONVERSATION) for _ in range(min(together, -(-left // length)))]
        encoded = [[engine.prepare(grow(c, turn))[1] for turn in range(length)] for c in conversations]
        whole = []
        for requests in encoded:
            whole.append([])
            for request in requests:
                engine.bank.clear()
                whole[-1].append(engine.scorer.probabilities([request])[0])
        engine.bank.clear()
        if group % 2 == 0:  # alone
            for requests, expected in zip(encoded, whole, strict=True):
                differ += sum(engine.scorer.probabilities([r])[0] != e for r, e in zip(requests, expected, strict=True))
        else:  # each turn of every conversation in one batch
            for turn in range(length):
                got = engine.scorer.probabilities([requests[turn] for requests in encoded])
                differ += sum(g != expected[turn] for g, expected in zip(got, whole, strict=True))
        answers += len(conversations) * length
        group += 1
    return {"turns": answers, "differing": differ}


class GrowingClients:
    """The turns closed-loop clients send (bench.throughput's `make`), of `clients` conversations near `near` tokens.
    As a user does, a conversation's next turn is sent only once its last one is answered: a client hands its
    conversation back when it sends its next request (its last one answered by then) and takes the longest-waiting
    one. One that has grown by ~2,000 tokens starts over as a new one."""

    def __init__(self, engine: Engine, clients: int, near: int = 8192) -> None:
        self.first = last_turn_within(near - 1_000, state_counter(engine.tokenizer), next(CONVERSATION))
        self.lock = threading.Lock()
        self.conversations = [[next(CONVERSATION), self.first] for _ in range(clients)]
        self.waiting = deque(self.conversations)
        self.held = threading.local()  # the conversation this client thread sent its last turn of

    def __call__(self, _: int | None) -> dict[str, Any]:
        with self.lock:
            if (last := getattr(self.held, "conversation", None)) is not None:
                self.waiting.append(last)
            conversation = self.held.conversation = self.waiting.popleft()
            conversation[1] += 1
            if conversation[1] > self.first + 10:
                conversation[:] = [next(CONVERSATION), self.first]
            return grow(*conversation)

    def warm(self, engine: Engine, seconds: float = 2.0) -> None:
        """Every conversation's first turn, computed whole, in a closed loop of its own for `seconds`. Every turn is
        answered after it: the next loop's client threads take the conversations afresh."""
        closed_loop(engine, self, len(self.conversations), seconds)
        self.waiting.clear()
        self.waiting.extend(self.conversations)


def throughput(engine: Engine, clients: int, seconds: float, near: int = 8192) -> dict[str, float]:
    """`clients` closed-loop clients (bench.throughput) growing their conversations near `near` tokens
    (GrowingClients), once each conversation's first turn is banked."""
    turns = GrowingClients(engine, clients, near)
    turns.warm(engine, min(seconds, 2.0))
    return closed_loop(engine, turns, clients, seconds)


def batched(engine: Engine, sizes: tuple[int, ...], near: int = 8192, repeat: int = 2) -> list[dict[str, Any]]:
    """For each k of `sizes`, k conversations banked at their last turn within `near` tokens, then their next turns
    in one batch: its model time per turn, and per turn that of k new states of the tokens each turn computed with its
    questions (the floor); medians over `repeat` batches, each after a batch of the next turns untimed."""
    count = state_counter(engine.tokenizer)
    stats = engine.bank.stats
    questions = grow(0, 0)["questions"]
    out = []
    for k in sizes:
        times: dict[str, list[float]] = {"turn_ms": [], "floor_ms": []}
        computed = 0
        conversations = [next(CONVERSATION) for _ in range(k)]
        turn = last_turn_within(near - 500, count, conversations[0])
        engine.answer([grow(c, turn) for c in conversations])
        for run in range(repeat + 1):
            turn += 1
            before = stats.tokens_computed
            engine.answer([grow(c, turn) for c in conversations])
            extend = engine.last_batch.model_ms
            computed = (stats.tokens_computed - before) // k
            engine.answer([sized(computed, count, next(CONVERSATION), questions) for _ in range(k)])
            floor = engine.last_batch.model_ms
            if run:  # the first: kernels at these sizes
                times["turn_ms"].append(extend / k)
                times["floor_ms"].append(floor / k)
        out.append({"turns": k, "computed_tokens": computed, **{n: statistics.median(v) for n, v in times.items()}})
    return out


def grow_record(
    engine: Engine,
    lengths: tuple[int, ...] = (2048, 8192, 32768, 65536),
    repeat: int = 3,
    clients: int = 64,
    seconds: float = 6.0,
    turns: int = 1000,
    batch_sizes: tuple[int, ...] = (6, 16, 32),
    near: int = 8192,
) -> dict[str, Any]:
    """The `grow` record (the module's docstring); `near`: the conversations' length for rps and batched."""
    stats = engine.bank.stats
    hits, reused = stats.prefix_hits, stats.tokens_reused
    record: dict[str, Any] = {"points": [point(engine, tokens, repeat) for tokens in lengths]}
    record[f"rps_{clients}"] = throughput(engine, clients, seconds, near)["rps"]
    record["batched"] = batched(engine, batch_sizes, near)
    record.update(differing(engine, turns))
    record["prefix_hits"], record["tokens_reused"] = stats.prefix_hits - hits, stats.tokens_reused - reused
    return record
