"""Reference scorer: the PyTorch model run eagerly (fp32 on CPU by default), with the state bank.

Each distinct state of a batch runs once (or comes from the bank); every question is a row continuing from its
state's cache, with positions after the state. Rows of a state are right-padded into passes bounded by a token
budget that counts the state once per row, as Kev's eager path does. It is the oracle the fast paths are held to.

Memory is linear in the state, never quadratic: every pass (a state, a row pass, a row-form row) runs through the
model in chunks of `chunk_tokens` tokens across its rows (qwen35.Qwen35TextModel.forward_in_chunks), and attention
never materialises an L×T tensor (qwen35.causal_attention). A state of N tokens needs, beyond the weights and its
cache, about one layer's share of the cache (the previous chunk's, released layer by layer), activations of one
chunk, and 2 × ATTENTION_CHUNK_ELEMENTS attention scores; in fp32 with s = 4 bytes:

    cache(N)   = N · n_attention_layers · 2 · Hkv · Dh · s  +  n_deltanet_layers · (conv_dim · (W-1) + Hv · Dk · Dv) · s
    peak extra ≈ cache(N) + cache(N) / n_attention_layers + chunk_tokens · a · s + 2 · ATTENTION_CHUNK_ELEMENTS · s

where a ≈ 3 · intermediate_size + 4 · hidden_size + 3 · max(2 · H · Dh, conv_dim + Hv · Dv) floats of live
activations per token (MLP gate, up and product; residual stream; a mixer's projections). A row pass adds its rows'
copies of the state's K/V (bounded by the row-pass budget, or one row of at most max_row_tokens). For the tiny model
(kev_backend.dev.synthetic) at Kev's 65,536-token limit: 32 MiB cache + 32 MiB + 22 MiB + 32 MiB ≈ 118 MiB.

A state that continues a banked one is computed from that state's point (scoring/growth.py: growing states, the same
bits as computing it whole). A state long enough to keep a point of its own is computed up to it, then on from it, the
cache at the point held meanwhile: up to cache(point) more at the peak.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch

from ..model.qwen35 import PASS_CHUNK_TOKENS, Qwen35TextModel, SequenceCache, chunk_width
from ..protocol.encoding import Encoded, EncodedQuestion
from .contract import ScorerStats
from .growth import Banked, Point, PrefixBank, point_length
from .head import PendingProbabilities, Picked, launch_batch_probabilities, pointer_probabilities, warm_pointer_head
from .units import Units, run_units


class ReferenceScorer:
    def __init__(
        self,
        model: Qwen35TextModel,
        head: dict[str, torch.Tensor],
        temperature: float,
        pad_id: int,
        bank: PrefixBank,
        row_pass_tokens: int,
        chunk_tokens: int = PASS_CHUNK_TOKENS,
    ) -> None:
        self.model = model
        self.head = head
        self.temperature = temperature
        self.pad_id = pad_id
        self.bank = bank
        self.row_pass_tokens = row_pass_tokens
        self.chunk_tokens = chunk_tokens  # tokens a pass runs at a time, across its rows (activations scale with it)
        self.device = next(model.parameters()).device

    @property
    def on_progress(self) -> Callable[[], None] | None:
        """Called after each layer the model runs (Engine.on_progress)."""
        return self.model.layer_done

    @on_progress.setter
    def on_progress(self, beat: Callable[[], None] | None) -> None:
        self.model.layer_done = beat

    def state_cache(self, state: tuple[int, ...]) -> Generator[None, None, SequenceCache]:
        """The state's cache, from the bank or computed a chunk at a time (yielding between chunks): from the point of
        the banked state it continues furthest, if any (scoring/growth.py), its own point kept on the way."""
        banked = self.bank.get(state)
        if banked is not None:
            return banked.cache
        width = chunk_width(self.chunk_tokens)
        stats = self.bank.stats
        cache, start, point = None, 0, None
        found = self.bank.longest_prefix(state, width)
        if found is not None:
            _, entry, point = found
            cache, start = point.cache(entry.cache), point.length
            stats.prefix_hits += 1
            stats.tokens_reused += start
        stats.tokens_computed += len(state) - start
        ids = torch.tensor([state], device=self.device)
        keep = point_length(len(state), width)
        if keep > start:  # this state's own point, further than the one it continues
            _, cache = yield from self.model.chunks(ids[:, start:keep], cache, self.chunk_tokens, keep_hidden=False)
            point, start = Point.of(state, cache, width), keep
        _, cache = yield from self.model.chunks(ids[:, start:], cache, self.chunk_tokens, keep_hidden=False)
        self.bank.put(state, Banked(cache, point))
        return cache

    def work(self, encoded: Encoded) -> int:
        """The request's tokens of model work if it ran now, read on any thread (an estimate: the bank may change
        before it runs): its state's tokens after the point it would continue (all of them unless banked) and its
        rows'."""
        state = encoded.state
        start = 0
        if state not in self.bank:
            start = self.bank.continued_length(state, chunk_width(self.chunk_tokens))
        return len(state) - start + sum(len(q.tokens) for q in encoded.questions)

    def warm_head(self) -> None:
        warm_pointer_head(self.head)

    def bank_summary(self) -> str:
        """Nothing for the start-up line: the reference path's bank is an LRU of `bank_bytes`, preallocating nothing."""
        return ""

    def warm_graphs(self) -> None:
        """Nothing: the reference path replays no graphs."""

    def wide_states(self) -> int:
        """None: the reference path has no kernel configuration for many long states to compile."""
        return 0

    def stats(self) -> ScorerStats:
        """No graphs, no retries, no pre-tuned GEMMs: eager fp32 throughout."""
        return ScorerStats()

    def probabilities(self, batch: Sequence[Encoded]) -> list[list[list[float]]]:
        """Per request, per question, the option probabilities."""
        return self.launch(batch).result()

    def launch(self, batch: Sequence[Encoded]) -> PendingProbabilities:
        """The model runs eagerly here; only the head's copy to the host is left to wait for (none on a CPU)."""
        return run_units(self.units(batch))

    def units(self, batch: Sequence[Encoded]) -> Units:
        """`launch` a unit of work at a time: it yields after each chunk of a state or of a row pass (at most
        chunk_tokens tokens) and returns the pending probabilities, so a scheduler can serve other batches between
        the units of a long one. Each state's cache is held here while its rows run, whatever the bank evicts."""
        by_state: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for r, encoded in enumerate(batch):
            for q in range(len(encoded.questions)):
                by_state.setdefault(encoded.state, []).append((r, q))
        picked: dict[tuple[int, int], Picked] = {}
        for state, items in by_state.items():
            cache = yield from self.state_cache(state)
            rows = [batch[r].questions[q] for r, q in items]
            for chunk in self.row_passes(len(state), rows):
                yield
                hidden = yield from self.row_pass(cache, [rows[i] for i in chunk])
                for j, i in enumerate(chunk):
                    row = rows[i]
                    picked[items[i]] = (hidden[j, row.decide], hidden[j, list(row.option_ends)])
        return launch_batch_probabilities(self.head, self.temperature, batch, picked)

    def row_passes(self, state_len: int, rows: Sequence[EncodedQuestion]) -> list[list[int]]:
        """Row indices per pass: as many rows as fit the budget counting the state once per row."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].tokens))
        passes: list[list[int]] = []
        current: list[int] = []
        for i in order:
            longest = len(rows[i].tokens)  # rows are sorted, so the newest is the longest
            if current and (len(current) + 1) * (state_len + longest) > self.row_pass_tokens:
                passes.append(current)
                current = []
            current.append(i)
        if current:
            passes.append(current)
        return passes

    def row_pass(self, cache: SequenceCache, rows: Sequence[EncodedQuestion]) -> Generator[None, None, torch.Tensor]:
        """Final-norm hidden states [R, L, d] of right-padded rows continuing `cache`, in fp32 (yielding between
        chunks)."""
        width = max(len(row.tokens) for row in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for j, row in enumerate(rows):
            ids[j, : len(row.tokens)] = torch.tensor(row.tokens)
        hidden, _ = yield from self.model.chunks(ids.to(self.device), cache, self.chunk_tokens)
        assert hidden is not None
        return hidden.float()

    def row_form_probabilities(self, encoded: Encoded) -> list[list[float]]:
        """Kev's row form, the oracle: each question as one causal row state + branch from an empty cache."""
        decide, options, counts = [], [], []
        for row in encoded.questions:
            ids = torch.tensor([encoded.state + row.tokens], device=self.device)
            hidden = self.model.forward_in_chunks(ids, chunk_tokens=self.chunk_tokens)[0][0].float()
            offset = len(encoded.state)
            decide.append(hidden[offset + row.decide])
            options.append(hidden[[offset + i for i in row.option_ends]])
            counts.append(len(row.option_ends))
        return pointer_probabilities(self.head, self.temperature, torch.stack(decide), torch.cat(options), counts)
