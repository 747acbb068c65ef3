"""The kernel table of a fused pass: which function runs each of its kernels. On a GPU this project's Triton kernels
(kev_backend.gpu.kernels) and cuDNN's attention for long new states; a CPU test substitutes torch references with
the same signatures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PassKernels:
    """The GPU kernels of a pass: ours (kev_backend.gpu.kernels) for norms, the causal conv, the chunked delta rule
    and attention, which read (rows) or write (new states) the bank in place. A CPU test substitutes torch references
    with the same signatures to check the pass's plumbing."""

    rms_norm: Callable
    rms_norm_rope: Callable
    gated_rms_norm: Callable
    silu_mul: Callable
    sigmoid_gate: Callable
    chunked_rows: Callable
    conv: Callable
    rows_attention: Callable
    bank_kv: Callable
    # One new state's attention over its own tokens when it is over CUDNN_ABOVE tokens in an eager pass (cuDNN's,
    # where it runs the model's heads); None: rows_attention's.
    long_attention: Callable | None = None

    @classmethod
    def gpu(cls) -> PassKernels:
        from . import kernels

        return cls(
            kernels.rms_norm,
            kernels.rms_norm_rope,
            kernels.gated_rms_norm,
            kernels.silu_mul,
            kernels.sigmoid_gate,
            kernels.chunked_rows,
            kernels.conv_tokens,
            kernels.rows_attention,
            kernels.bank_kv,
            kernels.cudnn_attention,
        )
