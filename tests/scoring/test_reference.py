"""The reference path's memory is linear in the state: attention in query chunks, passes in token chunks, and the same
numbers as the one-shot formulas up to fp32 rounding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kev_backend.engine.engine import Engine, EngineOptions
from kev_backend.model import qwen35
from kev_backend.model.qwen35 import SequenceCache, causal_attention
from tests.helpers import QUESTIONS, max_gap, request

REPO = Path(__file__).resolve().parents[2]


def one_shot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The plain formula: K/V repeated per query head, full L×T scores, mask and softmax."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    L, T = q.shape[2], k.shape[2]
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    blocked = torch.ones(L, T, dtype=torch.bool).triu(T - L + 1)
    scores = scores.masked_fill(blocked, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


SHAPES = {  # B, H, Hkv, L, T
    "square-gqa2": (1, 4, 2, 300, 300),
    "rows-after-state-gqa4": (2, 4, 1, 50, 333),
    "one-query": (3, 2, 2, 1, 40),
    "mha-batched": (2, 3, 3, 97, 97),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("queries_per_chunk", [1, 7, None])  # None: the default budget (one chunk at these sizes)
def test_chunked_attention_is_the_one_shot_formula(
    name: str, queries_per_chunk: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    B, H, n_kv, L, T = SHAPES[name]
    if queries_per_chunk is not None:
        monkeypatch.setattr(qwen35, "ATTENTION_CHUNK_ELEMENTS", B * H * T * queries_per_chunk)
    generator = torch.Generator().manual_seed(L * T + H)
    q = torch.randn(B, H, L, 32, generator=generator) * 2
    k = torch.randn(B, n_kv, T, 32, generator=generator) * 2
    v = torch.randn(B, n_kv, T, 32, generator=generator)
    assert (causal_attention(q, k, v, 32**-0.5) - one_shot_attention(q, k, v, 32**-0.5)).abs().max() <= 1e-5
    # Non-contiguous inputs, as callers pass views: [1, H, L, D] from a [L, H, D] tensor.
    qt, kt, vt = (t[0].transpose(0, 1).contiguous().transpose(0, 1)[None] for t in (q, k, v))
    assert torch.equal(causal_attention(qt, kt, vt, 32**-0.5)[0], causal_attention(q[:1], k[:1], v[:1], 32**-0.5)[0])


class LargestTensor(TorchFunctionMode):
    """The most elements of any tensor a torch call returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.largest = max(self.largest, out.numel())
        return out


def test_attention_never_materialises_l_by_t() -> None:
    B, H, n_kv, L, D = 1, 4, 2, 2048, 32
    q, k, v = torch.randn(B, H, L, D), torch.randn(B, n_kv, L, D), torch.randn(B, n_kv, L, D)
    assert B * H * L * L >= 4 * qwen35.ATTENTION_CHUNK_ELEMENTS  # the one-shot scores would be 4x the budget
    with LargestTensor() as seen:
        causal_attention(q, k, v, D**-0.5)
    assert seen.largest <= qwen35.ATTENTION_CHUNK_ELEMENTS


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> qwen35.Qwen35TextModel:
    return Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(device="cpu", backend="reference")).scorer.model


def cache_entries(cache: SequenceCache) -> list[torch.Tensor | None]:
    return [*cache.keys, *cache.values, *cache.conv, *cache.recurrent]


def assert_caches_close(a: SequenceCache, b: SequenceCache, atol: float = 1e-5) -> None:
    assert a.length == b.length
    for x, y in zip(cache_entries(a), cache_entries(b), strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.shape == y.shape and (x - y).abs().max() <= atol


@pytest.mark.parametrize("chunk_tokens", [128, 200, 4096])  # 200 runs 192-token chunks (a multiple of 64)
def test_a_state_in_chunks_is_the_one_pass(model: qwen35.Qwen35TextModel, chunk_tokens: int) -> None:
    ids = torch.randint(7, 400, (1, 700), generator=torch.Generator().manual_seed(3))
    hidden, cache = model(ids)
    chunked, chunked_cache = model.forward_in_chunks(ids, chunk_tokens=chunk_tokens)
    assert (chunked - hidden).abs().max() <= 1e-5
    assert_caches_close(chunked_cache, cache)
    dropped, same_cache = model.forward_in_chunks(ids, chunk_tokens=chunk_tokens, keep_hidden=False)
    assert dropped is None
    assert_caches_close(same_cache, chunked_cache, atol=0.0)


def test_rows_continue_a_cache_in_chunks(model: qwen35.Qwen35TextModel) -> None:
    """A batch of right-padded rows continuing a batch-1 state cache, in 64-token chunks (192 tokens over 3 rows):
    the one-pass hidden states, and the state's cache is left as it was (the bank shares it)."""
    generator = torch.Generator().manual_seed(4)
    _, state = model(torch.randint(7, 400, (1, 257), generator=generator))
    before = [None if t is None else t.clone() for t in cache_entries(state)]
    rows = torch.randint(7, 400, (3, 150), generator=generator)
    hidden, continued = model(rows, state)
    chunked, chunked_continued = model.forward_in_chunks(rows, state, chunk_tokens=192)
    assert (chunked - hidden).abs().max() <= 1e-5
    assert_caches_close(chunked_continued, continued)
    for kept, old in zip(cache_entries(state), before, strict=True):
        assert (kept is None and old is None) or torch.equal(kept, old)


def test_forward_release_spends_only_the_cache_it_is_given(model: qwen35.Qwen35TextModel) -> None:
    ids = torch.randint(7, 400, (1, 80), generator=torch.Generator().manual_seed(5))
    _, cache = model(ids[:, :40])
    kept_hidden, _ = model(ids[:, 40:], cache)
    hidden, _ = model(ids[:, 40:], cache, release=True)
    assert torch.equal(hidden, kept_hidden)
    assert all(t is None for t in cache_entries(cache))


def test_a_cache_owns_exactly_its_bytes(model: qwen35.Qwen35TextModel) -> None:
    """The bank counts `nbytes`: no entry may be a view keeping a larger activation alive (the conv window was one)."""
    ids = torch.randint(7, 400, (1, 1000), generator=torch.Generator().manual_seed(6))
    for _, cache in (model(ids), model.forward_in_chunks(ids, chunk_tokens=256)):
        assert sum(t.untyped_storage().nbytes() for t in cache.tensors()) == cache.nbytes


def test_scorer_answers_the_same_in_chunks(tiny_dir: Path) -> None:
    """Requests through the scorer with 64-token chunks (states, row passes, the row form) against one pass each."""
    whole = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(device="cpu", backend="reference", bank_bytes=0))
    chunked = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(device="cpu", backend="reference", bank_bytes=0))
    chunked.scorer.chunk_tokens = 64
    long_question = {"type": "noul", "instructions": " ".join(["refund the order today"] * 40)}
    state = " ".join(["my card was charged twice for the same order"] * 60)
    _, encoded = whole.prepare(request(state=state, questions={**QUESTIONS, "long": long_question}))
    assert len(encoded.state) > 500 and max(len(q.tokens) for q in encoded.questions) > 150
    expected = whole.scorer.probabilities([encoded])[0]
    assert max_gap(chunked.scorer.probabilities([encoded])[0], expected) <= 1e-5
    assert max_gap(chunked.scorer.row_form_probabilities(encoded), whole.scorer.row_form_probabilities(encoded)) <= 1e-5
    assert max_gap(whole.scorer.row_form_probabilities(encoded), expected) <= 1e-5


# Peak memory of answering requests on the reference path, measured in a fresh interpreter. glibc's mmap threshold is
# pinned at 1 MiB, so every tensor's pages go back to the system when it is freed and the peak RSS follows live
# tensors (by default glibc raises the threshold after a free, keeps freed blocks of up to 32 MiB, and the peak then
# carries up to ~100 MiB of its retention, and what is retained depends on what ran before).
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
PROBE = r"""
import json, sys, time
from kev_backend.engine.engine import Engine, EngineOptions
from kev_backend.dev.synthetic import vocabulary

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

checkpoint, cases = sys.argv[1], json.loads(sys.argv[2])
words = [w for w in vocabulary() if w.isalpha()]
text = lambda n: " ".join(words[i % len(words)] for i in range(n))
choice = {"type": "choice", "instructions": "route the ticket", "criteria": {"billing": None, "sales": None}}
engine = Engine.from_checkpoint(checkpoint, EngineOptions(device="cpu", backend="reference", bank_bytes=0))
engine.answer([{"state": "a short warm up state", "questions": {"q": choice}}])
for state_tokens, branch_words in cases:
    questions = {"q": choice}
    if branch_words:
        questions["long"] = {"type": "noul", "instructions": text(branch_words)}
    body = {"state": text(state_tokens - 1), "questions": questions}  # the <state> token makes up the count
    _, encoded = engine.prepare(body)
    assert len(encoded.state) == state_tokens, len(encoded.state)
    branch = max(len(q.tokens) for q in encoded.questions)
    del encoded
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (the peak RSS) to the current RSS
    before, started = status("VmRSS"), time.perf_counter()
    answer = engine.answer([body])[0]
    print(json.dumps({
        "state_tokens": state_tokens,
        "branch_tokens": branch,
        "growth": status("VmHWM") - before,
        "seconds": time.perf_counter() - started,
        "answers": answer["answers"],
    }), flush=True)
"""


def peak_growth(checkpoint: Path, cases: list[tuple[int, int]], timeout: float) -> list[dict]:
    env = {**os.environ, **PINNED_MALLOC}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(checkpoint), json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def bound(config: qwen35.Qwen35Config, tokens: int) -> int:
    """Bytes a request with `tokens` tokens (state and its longest branch) may add, fp32:
    - the state's cache, the previous chunk's attention layer while the next is made (the tiny model has one
      attention layer: a whole cache), and a row's copy of the state's K/V (rows continue the state): 3 caches;
    - one chunk's activations: PASS_CHUNK_TOKENS · (3 · intermediate + 4 · hidden + 3 · mixer width) floats;
    - the scores and probabilities of one attention chunk: 2 · ATTENTION_CHUNK_ELEMENTS floats;
    - 64 MiB for the rest (the request's text and tokens, the interpreter, the allocator's small blocks).
    The one-shot attention it replaces needed H · L · T floats several times over: 4 GiB a copy at 16,384 tokens."""
    n_attention = config.layer_types.count(qwen35.FULL_ATTENTION)
    cache = tokens * n_attention * 2 * config.num_key_value_heads * config.head_dim * 4
    mixer = max(
        2 * config.num_attention_heads * config.head_dim,
        config.conv_dim + config.linear_num_value_heads * config.linear_value_head_dim,
    )
    per_token = 3 * config.intermediate_size + 4 * config.hidden_size + 3 * mixer
    return 3 * cache + qwen35.PASS_CHUNK_TOKENS * per_token * 4 + 2 * qwen35.ATTENTION_CHUNK_ELEMENTS * 4 + (64 << 20)


def check(results: list[dict], config: qwen35.Qwen35Config) -> None:
    for r in results:
        tokens = r["state_tokens"] + r["branch_tokens"]
        assert r["growth"] <= bound(config, tokens), (r["growth"] >> 20, bound(config, tokens) >> 20, tokens)
        assert set(r["answers"]) >= {"q"} and r["answers"]["q"]["choice"] in ("billing", "sales")


def test_memory_is_linear_in_the_state(tiny_dir: Path, model: qwen35.Qwen35TextModel) -> None:
    """States of 8,192 and 16,384 tokens, and a 8,192-token branch on an 8,192-token state: each under its bound,
    and doubling the state at most doubles the growth (one-shot attention quadruples it)."""
    small, large, long_row = peak_growth(tiny_dir / "kev", [(8192, 0), (16_384, 0), (8192, 8190)], timeout=240)
    check([small, large, long_row], model.config)
    assert large["growth"] <= 2 * small["growth"], (small["growth"] >> 20, large["growth"] >> 20)
    assert long_row["branch_tokens"] > 8000 and set(long_row["answers"]) == {"q", "long"}


def test_a_state_at_kevs_limit(tiny_dir: Path, model: qwen35.Qwen35TextModel, request: pytest.FixtureRequest) -> None:
    """A 65,536-token state (Kev's limit) answers within the same bound."""
    if not request.config.getoption("--full-state"):
        pytest.skip("1-2 minutes on 2 cores: pytest --full-state")
    (result,) = peak_growth(tiny_dir / "kev", [(65_536, 0)], timeout=600)
    check([result], model.config)
