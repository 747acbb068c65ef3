"""The pre-tuned cuBLASLt tables (kev_backend/gpu/cublaslt.py) on the CPU: every committed table reads back, covers only
the fused path's projections at graph-bucket token counts, and is never used off CUDA. Their GEMMs against F.linear:
tests/gpu/test_fused_gpu.py (GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kev_backend.dev import gemm_tuner, sizes
from kev_backend.gpu import cublaslt
from kev_backend.gpu.graphs import all_buckets

TABLES = sorted(cublaslt.TABLES.glob("*.json"))


def kev4b_projections() -> set[tuple[int, int]]:
    """(out features, in features) of Kev-4B's fused projections, from its config."""
    c = sizes.KEV4B_CONFIG
    hidden, heads, dim = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value_dim = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    gdn_in = 2 * key_dim + 2 * value_dim + 2 * c["linear_num_value_heads"]
    attn_in = 2 * heads * dim + 2 * c["num_key_value_heads"] * dim
    mlp = c["intermediate_size"]
    return {
        (gdn_in, hidden),
        (attn_in, hidden),
        (hidden, value_dim),
        (hidden, heads * dim),
        (2 * mlp, hidden),
        (hidden, mlp),
    }


@pytest.mark.parametrize("path", TABLES, ids=[p.name for p in TABLES])
def test_committed_tables_hold_bucket_shapes_of_the_projections(path: Path) -> None:
    tuned_on, shapes = cublaslt.read_table(path)
    assert tuned_on["gpu"] and tuned_on["cublaslt_version"] > 0
    tokens = {bucket.tokens for bucket in all_buckets(4096)}
    projections = set().union(*(gemm_tuner.size_projections(size) for size in sizes.SIZES))
    assert shapes and all(m in tokens and (n, k) in projections for m, n, k in shapes)


def test_a_table_is_packaged() -> None:
    """The tests over each packaged table run only if one is found: an empty gemm_algos/ fails here, not silently."""
    assert TABLES, f"no GEMM table in {cublaslt.TABLES}"


def test_the_tuner_knows_kev4b_projections() -> None:
    assert gemm_tuner.size_projections("4b") == kev4b_projections()


def test_a_malformed_table_is_refused(tmp_path: Path) -> None:
    entry = {"m": 192, "n": 18432, "k": 2560, "algo": ["1"] * 8}
    table = {"gpu": "NVIDIA H200", "cublaslt_version": 130100, "shapes": [entry]}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    assert cublaslt.read_table(path)[1] == {(192, 18432, 2560): [1] * 8}
    for bad in ([entry, entry], [entry | {"algo": ["1"] * 7}], [entry | {"algo": ["1" * 17] * 8}]):
        path.write_text(json.dumps(table | {"shapes": bad}))
        with pytest.raises(ValueError):
            cublaslt.read_table(path)


def test_no_table_off_cuda() -> None:
    assert cublaslt.pretuned(torch.device("cpu")) is None


def test_a_table_names_what_it_was_tuned_on() -> None:
    """The start-up line names a table passed over by its GPU and cuBLASLt version as people read them."""
    for path in TABLES:
        tuned_on, _ = cublaslt.read_table(path)
        said = cublaslt.describe(tuned_on)
        assert said.startswith(f"{tuned_on['gpu']}, cuBLASLt 13.") and said.count(".") == 2, said
    assert cublaslt.describe({"gpu": "NVIDIA H100 80GB HBM3", "cublaslt_version": 130100}) == (
        "NVIDIA H100 80GB HBM3, cuBLASLt 13.1.0"
    )
