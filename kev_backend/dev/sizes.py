"""The model shapes the project builds random checkpoints of: the toy configs the tests use (TINY_CONFIG, and
SMALL_CONFIG with Qwen3.5's proportions) and Kev's sizes (SIZES: 0.8b, 4b, 9b, 27b, at their bases' published text
configs), with what follows from a config: its parameters and the fused path's GEMM shapes.
`kev_backend/dev/synthetic.py` writes checkpoints of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..model.qwen35 import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35Config, Qwen35TextModel

TINY_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "architectures": ["Qwen3_5ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "layer_types": [LINEAR_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION],
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "dtype": "float32",
}


# Small but with Qwen3.5's proportions: width 256, attention and DeltaNet heads of 64 (GPU parity; the 64-wide
# TINY_CONFIG's bf16 rounding does not average out). vocab_size comes from the tokenizer it is used with.
SMALL_CONFIG: dict[str, Any] = {
    **TINY_CONFIG,
    "hidden_size": 256,
    "intermediate_size": 768,
    "head_dim": 64,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "pad_token_id": 1,
}

FULL_ATTENTION_INTERVAL = 4


def hybrid_layers(n: int) -> list[str]:
    """Qwen3.5's layout: three Gated DeltaNet layers, then one gated attention layer, repeated."""
    return [FULL_ATTENTION if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else LINEAR_ATTENTION for i in range(n)]


QWEN35_VOCAB = 248_320  # padded; the tiny tokenizer's ids are a subset

# The published text configs (`text_config` of the Qwen3.5 checkpoints; model cards and config.json as third-party
# loaders and training scripts reproduce them). All: head_dim 256, DeltaNet heads of 128, conv kernel 4, vocab
# 248,320, RoPE theta 1e7 on a quarter of each head.
# Qwen3.5-0.8B: 24 layers, hidden 1,024, MLP 3,584, attention 8 query / 2 KV heads, DeltaNet 16 key / 16 value heads,
# tied embeddings.
KEV08B_CONFIG: dict[str, Any] = {
    **TINY_CONFIG,
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "layer_types": hybrid_layers(24),
    "vocab_size": QWEN35_VOCAB,
    "tie_word_embeddings": True,
}

# Qwen3.5-4B's text config (24 Gated DeltaNet and 8 gated attention layers, GQA 16/4, 32 DeltaNet value heads over 16
# key heads, tied embeddings): random weights of Kev-4B shapes.
KEV4B_CONFIG: dict[str, Any] = {
    **KEV08B_CONFIG,
    "hidden_size": 2560,
    "intermediate_size": 9216,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "linear_num_value_heads": 32,
    "layer_types": hybrid_layers(32),
}

# Qwen3.5-9B: 32 layers, hidden 4,096, MLP 12,288, attention 16 / 4 heads, DeltaNet 16 key / 32 value heads. Untied:
# its text tower's published count, 8.95B, is this config's with a separate LM head (tied it would be 7.94B).
KEV9B_CONFIG: dict[str, Any] = {
    **KEV4B_CONFIG,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "tie_word_embeddings": False,
}

# Kev-27B: Qwen3.8-27B, whose text_config is qwen3_5_text at Qwen3.5-27B's shapes: 64 layers, hidden 5,120, MLP
# 17,408, attention 24 / 4 heads, DeltaNet 16 key / 48 value heads, untied embeddings (~27B parameters, ~51 GB of
# bf16 text-model weights without the LM head Kev never reads).
KEV27B_CONFIG: dict[str, Any] = {
    **KEV4B_CONFIG,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "linear_num_value_heads": 48,
    "layer_types": hybrid_layers(64),
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class Size:
    """A Kev model size: its base's text config and how Kev ships it ("lora": rank-16 LoRA + head on the -Base
    model; "full": bf16 full weights + head). `parity_layers`: the depth the fp32 parity reference runs at, when the
    whole model's fp32 copy does not fit on one GPU beside the bf16 one."""

    name: str
    config: dict[str, Any]
    weights: str
    parity_layers: int | None = None

    @property
    def label(self) -> str:
        return f"kev-{self.name}-shapes"

    @property
    def lora_rank(self) -> int:
        """The rank its random weights merge (Kev's LoRA for a "lora" size, none for a full fine-tune)."""
        return 16 if self.weights == "lora" else 0

    def parity_config(self) -> dict[str, Any]:
        return truncated(self.config, self.parity_layers) if self.parity_layers else self.config


SIZES: dict[str, Size] = {
    "0.8b": Size("0.8b", KEV08B_CONFIG, "lora"),
    "4b": Size("4b", KEV4B_CONFIG, "lora"),
    "9b": Size("9b", KEV9B_CONFIG, "lora"),
    # 64 layers in fp32 are 108 GB: beside the 51 GB bf16 engine that is more than an H200 holds. 16 layers (the
    # first 16: 12 DeltaNet, 4 attention, the same 3:1 order) are 29 GB.
    "27b": Size("27b", KEV27B_CONFIG, "full", parity_layers=16),
}


def truncated(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """The first `layers` layers of `config` (a whole number of 3:1 groups, so the layer pattern is kept)."""
    if layers % FULL_ATTENTION_INTERVAL or not 0 < layers <= config["num_hidden_layers"]:
        raise ValueError(f"truncate to a multiple of {FULL_ATTENTION_INTERVAL} layers up to the model's, not {layers}")
    return {**config, "num_hidden_layers": layers, "layer_types": list(config["layer_types"][:layers])}


def text_parameters(config: dict[str, Any]) -> int:
    """Parameters of the text model at `config`: embedding, every layer (projections, norms, conv, A_log, dt_bias),
    final norm, and the LM head when untied (a tied one is the embedding, counted once). Not counted: the vision
    tower and the multi-token-prediction layer, which the published model names include."""
    parsed = Qwen35Config.from_dict(config)
    with torch.device("meta"):
        body = sum(p.numel() for p in Qwen35TextModel(parsed).parameters())
    return body + (0 if parsed.tie_word_embeddings else parsed.vocab_size * parsed.hidden_size)


def fused_projections(config: Qwen35Config) -> dict[str, list[tuple[int, int]]]:
    """(out, in) features of the GEMMs a layer of each kind runs on the fused path (kev_backend/gpu/weights.py's
    FusedWeights, LoRA merged): the concatenated input projection (attention: query with its gate, keys, values;
    DeltaNet: qkv, z, b, a), the output projection, the MLP's gate and up together, its down."""
    c = config
    hidden, mlp = c.hidden_size, c.intermediate_size
    heads = c.num_attention_heads * c.head_dim
    values = c.linear_num_value_heads * c.linear_value_head_dim
    delta_in = 2 * c.linear_num_key_heads * c.linear_key_head_dim + 2 * values + 2 * c.linear_num_value_heads
    mlp_gemms = [(2 * mlp, hidden), (hidden, mlp)]
    return {
        FULL_ATTENTION: [(2 * heads + 2 * c.num_key_value_heads * c.head_dim, hidden), (hidden, heads), *mlp_gemms],
        LINEAR_ATTENTION: [(delta_in, hidden), (hidden, values), *mlp_gemms],
    }
