"""The fused path's process-wide GPU settings, made in one start-up step (`configure`) by whatever builds a fused
pass (FusedQwen35) or loads cuBLASLt (cublaslt.library), before its first GEMM. torch keeps each for
the whole process, and importing this package changes none of them.

- bf16 GEMMs never reduce split-K partial sums in bf16: cuBLAS otherwise may, with a split chosen by the row count,
  and a row's answer would then move with the batch it rides in.
- cuBLASLt is torch's BLAS library: its results are the same for every row count from 52 rows up, cuBLAS's only from
  257 (passes.MIN_GEMM_ROWS), and the pre-tuned algorithms are cuBLASLt's (cublaslt.py).

Not here: the CUDA allocator's configuration, which torch reads at the process's first CUDA allocation, before any
weights are loaded (settings.use_cuda_allocator, the first step of every process that runs the engine).
"""

from __future__ import annotations

import torch


def configure(device: torch.device) -> None:
    """Makes the settings above for a pass on `device` (on a CPU only the first: the others are CUDA's). Idempotent."""
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    if device.type == "cuda":
        torch.backends.cuda.preferred_blas_library("cublaslt")
