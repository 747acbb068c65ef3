"""The batch tracer (kev_backend/dev/invariance.py) and the determinism check (kev_backend/dev/determinism.py) on the
fused pass with torch stand-ins (tests/gpu/fused_cpu_ops.py): with row-invariant GEMMs the pass gives every question the
same bits alone as in any batch, padded or not (a CPU runs the graphs' padded passes eagerly), and a batch
dependence put into one op is found at that op and counted."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from kev_backend.dev import determinism
from kev_backend.dev.invariance import trace
from kev_backend.dev.workloads import realistic, short6
from kev_backend.gpu.scorer import FusedScorer
from tests.gpu.fused_cpu_ops import engines


def row_by_row(gemm):
    """`gemm` a row at a time: a CPU BLAS picks its kernel, and so its sums' order, by the row count, so a row of a
    GEMM can change with the rows beside it; one row at a time it cannot."""

    def invariant(x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return gemm(x, *args)
        return torch.cat([gemm(x[i : i + 1], *args) for i in range(x.shape[0])])

    return invariant


def traced_engine(tiny_dir: Path) -> tuple[FusedScorer, list]:
    """A fused scorer on the stand-ins with its GEMMs (the layers' and the head's projection) made row-invariant."""
    reference, fused = engines(tiny_dir, pass_tokens=600, graphs=False)
    fused.model._linear = row_by_row(F.linear)
    fused.pointer.project = row_by_row(fused.pointer.project)
    requests = realistic(10, seed=3, min_words=5, max_words=120) + [short6(1), short6(2)]
    return fused, [reference.prepare(r)[1] for r in requests]


def test_with_row_invariant_gemms_every_question_gets_the_same_bits(tiny_dir: Path) -> None:
    fused, encoded = traced_engine(tiny_dir)
    report = trace(fused, encoded, mixes=2, batch=5)
    assert report["questions"] == 2 * sum(len(e.questions) for e in encoded)
    assert report["differing"] == 0 and report["first_difference_by_op"] == {}, report


def test_a_batch_dependence_is_found_where_it_enters(tiny_dir: Path) -> None:
    fused, encoded = traced_engine(tiny_dir)
    rms_norm = fused.model._rms_norm

    def leaky(x: torch.Tensor, *args, **kwargs):  # the first layer's norm, shifted by the pass's token count
        normed, residual = rms_norm(x, *args, **kwargs)
        return normed + 1e-3 * x.shape[0], residual

    fused.model._rms_norm = leaky
    report = trace(fused, encoded, mixes=1, batch=6)
    assert report["differing"] == report["questions"] > 0
    assert report["first_difference_by_label"] == {"L00 norm.1": report["questions"]}, report


def test_the_determinism_check_finds_no_difference_and_counts_a_batch_dependence(tiny_dir: Path) -> None:
    fused, encoded = traced_engine(tiny_dir)
    report = determinism.check(fused, encoded, mixes=1, max_batch=6)
    questions = sum(len(e.questions) for e in encoded)
    assert report["questions"] == questions and report["compared"] == 2 * questions  # a mix padded, one eager
    assert report["differing"] == 0 and report["graphs_vs_eager_differing"] == 0, report
    rms_norm = fused.model._rms_norm

    def leaky(x: torch.Tensor, *args, **kwargs):  # the norms shifted by the pass's token count
        normed, residual = rms_norm(x, *args, **kwargs)
        return normed + 1e-3 * x.shape[0], residual

    fused.model._rms_norm = leaky
    few = encoded[:4]
    report = determinism.check(fused, few, mixes=1, max_batch=4)
    questions = sum(len(e.questions) for e in few)
    assert 0 < report["differing"] <= 2 * questions, report  # a question in a batch of one may agree
