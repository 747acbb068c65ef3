"""Our Triton kernels for the fused path, with fixed launch configurations (no autotuning on the request path):
norms and the MLP activation, the gated delta rule, the causal conv and row attention, the last three reading or
writing their segments' states in the bank pool in place, and the new states' K/V into the bank."""

from .attention import rows_attention, states_attention
from .bank import bank_kv
from .conv import conv_rows, conv_tokens
from .delta_rule import chunked_rows
from .norms import gated_rms_norm, rms_norm, rms_norm_rope, sigmoid_gate, silu_mul

__all__ = [
    "bank_kv",
    "chunked_rows",
    "conv_rows",
    "conv_tokens",
    "gated_rms_norm",
    "rms_norm",
    "rms_norm_rope",
    "rows_attention",
    "sigmoid_gate",
    "states_attention",
    "silu_mul",
]
