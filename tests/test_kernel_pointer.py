"""kernels.pointer.pointer_softmax against its torch reference: in Triton's interpreter on a CPU, compiled on a GPU
(tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kev_backend.gpu.kernels.pointer import pointer_softmax, reference_pointer_softmax  # noqa: E402


def test_pointer_softmax(kernel_run) -> None:
    """Questions of 1 to 40 options (several of the kernel's 16-option steps), a head width that is no power of two,
    a temperature; each row zero past its question's options."""
    dp, widths, n_cols = 24, [2, 1, 40, 5, 17], 40
    decides = [sum(1 + n for n in widths[:i]) for i in range(len(widths))]
    projected = torch.randn(sum(1 + n for n in widths), 2 * dp)
    got = pointer_softmax(projected, torch.tensor(decides), torch.tensor(widths), n_cols, 2.0)
    ref = reference_pointer_softmax(projected, torch.tensor(decides), torch.tensor(widths), n_cols, 2.0)
    for i, (d, n) in enumerate(zip(decides, widths)):
        z = projected[d + 1 : d + 1 + n, dp:] @ projected[d, :dp] / dp**0.5 / 2.0
        assert torch.allclose(ref[i, :n], torch.softmax(z, 0)), i  # the reference is the formula
        assert (got[i, :n] - ref[i, :n]).abs().max() < 1e-6, i
        assert torch.equal(got[i, n:], torch.zeros(n_cols - n)), i
