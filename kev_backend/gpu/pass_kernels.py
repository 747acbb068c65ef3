"""The kernel table of a fused pass: which function runs each of its kernels. On a GPU this project's Triton kernels
(kev_backend.gpu.kernels); on a CPU (the tests) each kernel's plain torch
reference, kept beside it in kernels/ with the same signature.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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
    states_attention: Callable
    bank_kv: Callable

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
            kernels.states_attention,
            kernels.bank_kv,
        )

    @classmethod
    def references(cls) -> PassKernels:
        """Each kernel's torch reference (kernels/*.py, `reference_*`): a pass that runs anywhere, slowly, and answers
        as the kernels do (their tests compare each kernel with its reference)."""
        from .kernels import attention, bank, conv, delta_rule, norms

        def chunked_rows(*args: Any, padded: bool = False, lead_apart: bool = False, lead: int = 0, **kw: Any) -> Any:
            return delta_rule.reference_rows(*args, **kw)  # the launch options change no result

        return cls(
            norms.reference_rms_norm,
            norms.reference_rms_norm_rope,
            norms.reference_gated_rms_norm,
            norms.reference_silu_mul,
            norms.reference_sigmoid_gate,
            chunked_rows,
            conv.reference_conv_rows,  # conv_tokens' job, segment by segment
            attention.reference_rows_attention,
            attention.reference_states_attention,
            bank.reference_bank_kv,
        )
