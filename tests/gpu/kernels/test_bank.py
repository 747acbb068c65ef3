"""kernels.bank.bank_kv against its torch reference (index_copy_): in Triton's interpreter on a CPU, compiled on a
GPU (tests/conftest.py)."""

from __future__ import annotations

import torch

from kev_backend.gpu.kernels.bank import bank_kv, reference_bank_kv


def test_bank_kv_copies_exactly_v_in_place(kernel_run) -> None:
    """New states' K and V into the bank's rows, V read in place from a wider projection: exactly index_copy_ into
    each; the other rows untouched."""
    kv_proj = torch.randn(9, 4 * 2 * 32 + 3)
    k_new, v_new = kv_proj[:, : 4 * 32].reshape(9, 4, 32).contiguous(), kv_proj[:, 4 * 32 : 8 * 32].view(9, 4, 32)
    keys, values = torch.randn(20, 4, 32), torch.randn(20, 4, 32)
    ref_keys, ref_values = keys.clone(), values.clone()
    dst = torch.tensor([19, 3, 4, 5, 11, 0, 7, 8, 2])
    bank_kv(keys, values, dst, k_new, v_new)
    reference_bank_kv(ref_keys, ref_values, dst, k_new, v_new)
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)
