"""Where a question's numbers first depend on the batch it rides in: the fused pass traced op by op.

Each request is scored alone and inside batch mixes, on an emptied bank each time (so its state is computed with its
rows either way). Every op of every pass that has question rows (the GEMMs, the norms, the SiLU·mul, the per-head
norm and RoPE, the delta rule's and the attention's outputs, the last layer's picked attention) is recorded at the
tokens the head reads (<decide> and each </opt>), which are token-local after each op: an op whose output at those
tokens differs, bit for bit, between the two runs while every op before it agreed is where the batch got in. Passes
run eagerly (no CUDA graphs): replay is compared with eager elsewhere.

    python -m bench.diag batchtrace          (Kev-4B shapes on the GPU)
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..gpu.scorer import FusedScorer
from ..protocol.encoding import Encoded

Key = tuple[int, int]  # (request, question): the request's index in the traced list
# The FusedQwen35 kernel attributes traced, by the name a report gives them; `record` is what is read of each call:
# "out" its output, "in" its first argument (the delta rule's output enters the gated norm, the attention's the gate).
TRACED = {
    "_linear": ("linear", "out"),
    "_rms_norm": ("norm", "out"),
    "_silu_mul": ("silu_mul", "out"),
    "_norm_rope": ("norm_rope", "out"),
    "_gated_norm": ("delta_rule", "in"),
    "_sigmoid_gate": ("attention", "in"),
}


@dataclass
class PassTrace:
    """One pass's ops at its picked tokens, in call order: (label, each pick's digest of the op's values)."""

    tokens: int
    picks: torch.Tensor
    ops: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    norms: int = 0  # norm calls so far: a layer has two (before its mixer, before its MLP)
    per_layer: Counter = field(default_factory=Counter)
    # Where the pass is: "tokens" (the layers: every traced value has a row per token, or per token and head), "last"
    # (the last layer's attention, whose values have a row per token, per row token or per pick: read through its
    # output alone), "picked" (the head's inputs: a row per pick, then padding).
    mode: str = "tokens"

    def label(self, name: str) -> str:
        layer = max(self.norms - 1, 0) // 2
        self.per_layer[(layer, name)] += 1
        return f"L{layer:02d} {name}.{self.per_layer[(layer, name)]}"

    def add(self, name: str, value: torch.Tensor, picked: bool = False) -> None:
        """`value` at the picked tokens: a row per token (or per token and head) of the pass, or (`picked`, or in
        the head's inputs) a row per pick."""
        if picked or self.mode == "picked":
            at = value[: self.picks.numel()]
        elif self.mode == "last":
            return  # inside the last layer's attention: read through its output
        elif value.shape[0] % self.tokens == 0:
            at = value.reshape(self.tokens, -1)[self.picks.to(value.device)]
        else:
            raise ValueError(f"{name}: {tuple(value.shape)} has no row per token of a {self.tokens}-token pass")
        self.ops.append((self.label(name), digest(at.reshape(at.shape[0], -1))))


def digest(rows: torch.Tensor) -> torch.Tensor:
    """Two integer checksums of each row's bits [rows, 2], computed where the rows are: copying every op's rows to
    the host would move gigabytes a pass. Rows that differ in any bit differ here but for a 2^-64-ish chance."""
    bits = rows.float().contiguous().view(torch.int32).to(torch.int64)
    weights = torch.arange(1, bits.shape[1] + 1, device=bits.device, dtype=torch.int64)
    return torch.stack((bits.sum(1), (bits * weights).sum(1)), 1).cpu()


class Tracer:
    """Installs itself on a FusedScorer's pass (instance attributes, taken back by `close`) and keeps, per
    (request, question) of the current call, the ops of the pass that scored its row at that row's picked tokens."""

    def __init__(self, scorer: FusedScorer) -> None:
        self.scorer = scorer
        self.model = scorer.model
        self.current: PassTrace | None = None
        self.rows: dict[Key, list[tuple[str, torch.Tensor]]] = {}
        self.ids: Sequence[int] = ()
        self._saved: dict[str, Any] = {}
        for attribute, (name, read) in TRACED.items():
            self._wrap(attribute, name, read)
        self._install(self.model, "forward", self._forward(self.model.forward))
        self._install(self.model, "last_attention", self._in_mode("last", self.model.last_attention))
        self._install(self.model, "head_inputs", self._in_mode("picked", self.model.head_inputs))
        self._install(scorer, "run_group", self._run_group(scorer.run_group))

    def _install(self, owner: Any, attribute: str, value: Any) -> None:
        self._saved[f"{id(owner)}.{attribute}"] = (owner, attribute, owner.__dict__.get(attribute))
        setattr(owner, attribute, value)

    def close(self) -> None:
        for owner, attribute, old in self._saved.values():
            if old is None:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, old)

    def _wrap(self, attribute: str, name: str, read: str) -> None:
        original = getattr(self.model, attribute)

        def traced(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if self.current is not None:
                if name == "norm":
                    self.current.norms += 1
                seen = args[0] if read == "in" else out
                for value in seen if isinstance(seen, tuple) else (seen,):
                    if value is not None:  # a norm without the residual stream's output
                        self.current.add(name, value)
            return out

        self._install(self.model, attribute, traced)

    def _forward(self, original: Callable) -> Callable:
        def forward(p: Any) -> torch.Tensor:
            self.current = PassTrace(tokens=p.ids.shape[0], picks=p.picks) if p.picks.numel() else None
            return original(p)

        return forward

    def _in_mode(self, mode: str, original: Callable) -> Callable:
        """`original` run with the trace in `mode`; its output recorded as one op (the last layer's attention, the
        head's inputs)."""

        def run(*args: Any, **kwargs: Any) -> Any:
            if self.current is None:
                return original(*args, **kwargs)
            self.current.mode = mode
            out = original(*args, **kwargs)
            self.current.mode = "tokens"
            if out is not None:
                self.current.add("last_attention" if mode == "last" else "head_inputs", out, picked=True)
            return out

        return run

    def _run_group(self, original: Callable) -> Callable:
        def run_group(rows: list, found: Any = None) -> Any:
            picked, decides = original(rows, found)
            trace, self.current = self.current, None
            if trace is not None:
                widths = {(row.request, row.question): 1 + len(row.tokens.option_ends) for row in rows}
                for (request, question), at in decides.items():
                    key = (self.ids[request], question)
                    span = slice(at, at + widths[(request, question)])
                    self.rows[key] = [(label, value[span]) for label, value in trace.ops]
            return picked, decides

        return run_group

    def score(self, encoded: Sequence[Encoded], ids: Sequence[int]) -> dict[Key, list[float]]:
        """One call of the scorer on an emptied bank: each (request, question)'s probabilities; its ops in `rows`."""
        self.scorer.bank.clear()
        self.ids = ids
        probabilities = self.scorer.probabilities(encoded)
        return {(ids[r], q): p for r, per_request in enumerate(probabilities) for q, p in enumerate(per_request)}


def first_difference(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> str | None:
    """The label of the first op whose values differ in any bit (their digests; ops in the same order on both
    sides)."""
    for (label, x), (other, y) in zip(a, b, strict=True):
        if label != other:
            raise ValueError(f"the passes ran other ops: {label} against {other}")
        if not torch.equal(x, y):
            return label
    return None


def trace(
    scorer: FusedScorer, encoded: Sequence[Encoded], mixes: int = 4, batch: int = 16, seed: int = 0
) -> dict[str, Any]:
    """Every request alone, then `mixes` shuffles of them cut into batches of `batch`: how many questions' answers
    differ in any bit from alone, and for each the op where its numbers first differed, counted by op and by
    label."""
    tracer = Tracer(scorer)
    try:
        alone_p: dict[Key, list[float]] = {}
        alone_ops: dict[Key, list[tuple[str, torch.Tensor]]] = {}
        for i, e in enumerate(encoded):
            alone_p |= tracer.score([e], [i])
            alone_ops |= tracer.rows
            tracer.rows = {}
        rng = random.Random(seed)
        differing, by_op, by_label, agreed_inside = 0, Counter(), Counter(), 0
        compared = 0
        for _ in range(mixes):
            order = list(range(len(encoded)))
            rng.shuffle(order)
            for start in range(0, len(order), batch):
                ids = order[start : start + batch]
                probabilities = tracer.score([encoded[i] for i in ids], ids)
                for key, p in probabilities.items():
                    compared += 1
                    first = first_difference(alone_ops[key], tracer.rows[key])
                    if p != alone_p[key]:
                        differing += 1
                        # Every traced op agreed: the pointer head (its softmax over a question's options) differed.
                        first = first or "L-- pointer_head.1"
                    if first is not None:
                        by_label[first] += 1
                        by_op[first.split(" ", 1)[1].rsplit(".", 1)[0]] += 1
                        agreed_inside += p == alone_p[key]
                tracer.rows = {}
    finally:
        tracer.close()
    return {
        "questions": compared,
        "differing": differing,
        "first_difference_by_op": dict(by_op.most_common()),
        "first_difference_by_label": dict(by_label.most_common(12)),
        "inside_only": agreed_inside,  # ops differed but the answer's bits did not
    }
