"""Torch stand-ins, with the same signatures, for every kernel of a fused pass.

They let the fused pass (pool writes, rows reading the bank by slot, picks, norms) run on a CPU against the
reference engine: the kernels' own plain torch references (PassKernels.references, kept beside each kernel in
kev_backend/gpu/kernels/*.py and checked against them in tests/gpu/kernels/test_*.py), with the delta-rule
launches counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from kev_backend.engine.engine import Engine, EngineOptions
from kev_backend.gpu.kernels.delta_rule import reference_rows
from kev_backend.gpu.pass_kernels import PassKernels
from kev_backend.gpu.scorer import FusedScorer
from kev_backend.model.checkpoint import KevCheckpoint
from kev_backend.model.qwen35 import gated_delta_rule, l2_normalize


def segment_delta_rule(q, k, v, g, beta, h0):
    """One segment's gated delta rule as the kernels compute it, in the reference engine's own chunked fp32 form
    (model.qwen35; the kernels' reference, reference_segment_delta_rule, walks it token by token): q, k [L, H, K];
    v [L, HV, V]; g, beta [L, HV]; h0 [HV, K, V] or None. Returns (o [L, HV, V] fp32, final state [HV, K, V])."""
    rep = v.shape[1] // q.shape[1]
    qq = l2_normalize(q.float().repeat_interleave(rep, 1).transpose(0, 1)[None]) * q.shape[-1] ** -0.5
    kk = l2_normalize(k.float().repeat_interleave(rep, 1).transpose(0, 1)[None])
    vv = v.float().transpose(0, 1)[None]
    o, state = gated_delta_rule(qq, kk, vv, g.T[None], beta.float().T[None], None if h0 is None else h0[None])
    return o[0].transpose(0, 1), state[0]


# Our kernels' stand-ins take padded passes too (a captured pass's layout): the region may hold tokens after the last
# segment (outputs left as zeros here) and empty segments (a new one writes an empty state into its slot).


CALLS: Counter[str] = Counter()  # delta-rule launches, for routing checks


def chunked_rows(
    q,
    k,
    v,
    a,
    b,
    a_log,
    dt_bias,
    pool,
    slots,
    cu,
    new_states=False,
    out=None,
    padded=False,
    lead_apart=False,
    lead=0,
    extend=False,
    save_at=None,
    save_slots=None,
):
    """The gated delta rule segment by segment (`padded`, `lead_apart` and `lead`, how the GPU kernel launches,
    change nothing here)."""
    CALLS["chunked_rows"] += 1
    CALLS[f"chunked_rows padded={padded}"] += 1  # True: a captured pass's group
    CALLS[f"chunked_rows lead_apart={lead_apart}"] += 1  # True: a captured pass's long new states
    CALLS[f"chunked_rows lead={lead > 0}"] += 1  # True: a captured pass's short and long new states in one group
    CALLS[f"chunked_rows extend={extend}"] += 1  # True: new states continuing a point
    CALLS[f"chunked_rows save={save_at is not None}"] += 1  # True: new states keeping a point
    args = (q, k, v, a, b, a_log, dt_bias, pool, slots, cu, new_states, out, segment_delta_rule)
    return reference_rows(*args, extend=extend, save_at=save_at, save_slots=save_slots)


# The kernels' references, with the launches these tests count and the delta rule in the reference engine's own
# chunked fp32 form (its answers are what the fused pass is compared with).
TORCH_KERNELS = replace(PassKernels.references(), chunked_rows=chunked_rows)


def engines(
    tiny_dir: Path,
    bank_bytes: int = 1 << 26,
    checkpoint: KevCheckpoint | None = None,
    kernels: PassKernels = TORCH_KERNELS,
    **options,
) -> tuple[Engine, FusedScorer]:
    """The reference engine on the tiny checkpoint (or `checkpoint`) and a fused scorer (fp32, `kernels`: the torch
    stand-ins) on the same model, with the engine's default options (the shipped configuration: graphs), graph buckets
    up to 1,024 tokens, unless `options` (FusedOptions' fields) say otherwise."""
    if checkpoint is None:
        reference = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(bank_bytes=0))
    else:
        reference = Engine(checkpoint, EngineOptions(bank_bytes=0))
    ck = reference.checkpoint
    fused_options = replace(EngineOptions(bank_bytes=bank_bytes, graph_max_tokens=1024).fused(), **options)
    pad = reference.tokenizer.delimiters.pad
    fused = FusedScorer(ck.model, ck.head, ck.temperature, pad, fused_options, torch.float32, kernels)
    return reference, fused
