"""bench/small_gemm.py, the small-M GEMM that bench/diag.py times against cuBLASLt, computes x wᵀ: in Triton's
interpreter (fp32: numpy has no bf16), whole and split along K, with rows short of a tile, and swapped (yᵀ = w xᵀ)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHECK = """
import sys
import torch
sys.path.insert(0, "bench")
import small_gemm
torch.manual_seed(0)
for m in (7, 70):
    x, w = torch.randn(m, 256), torch.randn(128, 256) * 0.05
    reference = x @ w.T
    configs = ((64, 64, 64, 1, 4, 2), (64, 32, 32, 4, 4, 2), (128, 64, 64, 2, 4, 2), (64, 64, 64, 1, 4, 2, 1))
    for config in configs + ((128, 64, 32, 2, 4, 2, 1),):
        assert (small_gemm.small_m_linear(x, w, config) - reference).abs().max() < 1e-4, (m, config)
print("ok")
"""


def test_small_m_gemm_in_the_interpreter() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHECK],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
