"""Deterministic tiny Kev-format checkpoints with random weights: `python -m kev_backend.dev.tiny OUT_DIR`.

OUT_DIR/base is a Qwen3.5 base in HF layout (config.json, model.safetensors with `model.*` names plus an lm_head,
a word-level tokenizer holding Kev's five delimiter tokens); OUT_DIR/kev is a LoRA checkpoint on it (PEFT adapter +
head.pt); OUT_DIR/kev-full the same model as a full-weight checkpoint. Their answers are meaningless: the weights
are random, scaled so activations stay O(1) through the layers and the probabilities are not flat.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from ..model.checkpoint import KevCheckpoint, Meta, build_model, lora_deltas, merge_deltas
from ..model.qwen35 import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35Config, Qwen35TextModel
from ..protocol.encoding import DELIMITER_TOKENS
from .workloads import WORDS

PAD, UNK = "<|endoftext|>", "<unk>"
LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_a",
    "in_proj_b",
    "out_proj",
)
PUNCTUATION = list(".,:;!?'\"()[]{}-_/\\@#$%&*+=<>|~`^") + ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]

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

# Qwen3.5-4B's text config (24 Gated DeltaNet and 8 gated attention layers, GQA 16/4, 32 DeltaNet value heads over 16
# key heads): random weights of Kev-4B shapes.
KEV4B_CONFIG: dict[str, Any] = {
    **TINY_CONFIG,
    "hidden_size": 2560,
    "intermediate_size": 9216,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "layer_types": [FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(32)],
    "vocab_size": 248_320,
    "tie_word_embeddings": True,
}


def vocabulary() -> list[str]:
    specials = [UNK, PAD, *DELIMITER_TOKENS.values()]
    words = list(dict.fromkeys(WORDS + PUNCTUATION))
    return specials + words


def write_tokenizer(directory: Path) -> int:
    """A lower-casing word-level tokenizer with Kev's delimiters as special tokens; returns the vocab size."""
    vocab = vocabulary()
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=UNK))
    tokenizer.normalizer = normalizers.Lowercase()
    # Digits one by one, as Qwen's tokenizer splits them: "Ticket 12." and "Ticket 13." must differ.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in vocab[:7]])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK,
        "pad_token": PAD,
        "additional_special_tokens": list(DELIMITER_TOKENS.values()),
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return len(vocab)


def random_text_weights(config: Qwen35Config, seed: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Bare-name fp32 weights at a trained model's scale: projections with std 1/sqrt(fan_in) so every activation
    stays O(1), output projections further scaled by 1/sqrt(2·layers) so the residual stream does not grow with
    depth, non-zero norm weights (so a missing 1+w shows), negative A_log (per-step decay in (0, 1))."""
    generator = torch.Generator(device).manual_seed(seed)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Qwen35TextModel(config).named_parameters()}
    depth_scale = 1.0 / math.sqrt(2 * config.num_hidden_layers)
    weights = {}
    for name, shape in shapes.items():
        normal = torch.randn(shape, generator=generator, device=device)
        if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "norm.weight":
            tensor = 0.1 * normal  # zero-centred norms: scale is 1 + w
        elif name.endswith("linear_attn.norm.weight"):
            tensor = 1.0 + 0.1 * normal  # plain-weight gated norm
        elif name.endswith("A_log"):
            tensor = torch.log(torch.rand(shape, generator=generator, device=device) * 0.9 + 0.05)
        elif name.endswith("dt_bias"):
            tensor = 1.0 + 0.1 * normal
        elif name.endswith("conv1d.weight"):
            tensor = normal / math.sqrt(shape[-1])
        elif name == "embed_tokens.weight":
            tensor = normal
        elif name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
            tensor = normal * depth_scale / math.sqrt(shape[1])
        else:
            tensor = normal / math.sqrt(shape[1])
        weights[name] = tensor.contiguous()
    return weights


def random_lora(
    config: Qwen35Config, rank: int, seed: int, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """PEFT-named fp32 LoRA tensors for every target module; B is non-zero (PEFT initialises it to zero)."""
    generator = torch.Generator(device).manual_seed(seed)
    with torch.device("meta"):
        modules = dict(Qwen35TextModel(config).named_modules())
    tensors = {}
    for name, module in modules.items():
        if name.rsplit(".", 1)[-1] not in LORA_TARGETS or not isinstance(module, torch.nn.Linear):
            continue
        prefix = f"base_model.model.{name}"
        a = torch.randn(rank, module.in_features, generator=generator, device=device) / math.sqrt(module.in_features)
        b = torch.randn(module.out_features, rank, generator=generator, device=device) * 0.01
        tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    return tensors


def random_head(hidden_size: int, head_dim: int, seed: int, scale: float = 2.5) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def linear() -> tuple[torch.Tensor, torch.Tensor]:
        weight = torch.randn(head_dim, hidden_size, generator=generator) * scale / math.sqrt(hidden_size)
        return weight, torch.randn(head_dim, generator=generator) * 0.1

    (qw, qb), (kw, kb) = linear(), linear()
    return {"q.weight": qw, "q.bias": qb, "k.weight": kw, "k.bias": kb}


def head_meta(base: str, head: dict[str, torch.Tensor], weights: str, lora: int, temperature: float = 2.0) -> dict:
    return {
        "base": base,
        "base_revision": None,
        "lora": lora,
        "head_dim": head["q.weight"].shape[0],
        "head": head,
        "temperature": temperature,
        "weights": weights,
        "weights_dtype": "fp32",
        "option_isolation": False,
        "special_embeddings": False,
        "holdout": [],
    }


def write_base(
    directory: Path, config: dict[str, Any], weights: dict[str, torch.Tensor], prefix: str = "model."
) -> None:
    """An HF-layout base as `Qwen3_5ForCausalLM.save_pretrained` writes it (prefix `model.`, untied lm_head)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {prefix + name: t for name, t in weights.items()}
    if not config.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = weights["embed_tokens.weight"].clone()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def write_lora_checkpoint(directory: Path, base: str, config: Qwen35Config, rank: int, head: dict, seed: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    adapter = {
        "peft_type": "LORA",
        "task_type": "FEATURE_EXTRACTION",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.05,
        "bias": "none",
        "target_modules": sorted(LORA_TARGETS),
        "base_model_name_or_path": base,
        "use_rslora": False,
        "use_dora": False,
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter, indent=2) + "\n")
    save_file(random_lora(config, rank, seed), str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    torch.save(head_meta(base, head, "lora", rank), directory / "head.pt")


def write_full_checkpoint(
    directory: Path, base: str, config: dict, weights: dict[str, torch.Tensor], head: dict
) -> None:
    """Full weights as Kev's full fine-tunes save them: the bare text model, unprefixed names, no lm_head."""
    write_base(directory, {**config, "tie_word_embeddings": True}, weights, prefix="")
    torch.save(head_meta(base, head, "full", 0), directory / "head.pt")


def synthetic_checkpoint(
    config_dict: dict[str, Any],
    tokenizer_dir: Path,
    device: str | torch.device,
    seed: int = 0,
    lora_rank: int = 16,
    head_dim: int = 256,
) -> KevCheckpoint:
    """A Kev checkpoint built in memory on `device` (fp32, LoRA merged), e.g. Kev-4B shapes for GPU parity and
    benchmarks, with the tiny tokenizer of `tokenizer_dir` (its ids are a subset of any larger vocabulary)."""
    config = Qwen35Config.from_dict(config_dict)
    weights = random_text_weights(config, seed, device)
    deltas = merge_deltas(random_lora(config, lora_rank, seed + 1, device), 2.0)
    model = build_model(config, weights, torch.float32, deltas)
    del weights, deltas
    head = {k: v.to(device) for k, v in random_head(config.hidden_size, head_dim, seed + 2).items()}
    meta = Meta(
        base=str(tokenizer_dir),
        head=head,
        base_revision=None,
        lora=lora_rank,
        head_dim=head_dim,
        weights_dtype="fp32",
        temperature=2.0,
        weights="lora",
    )
    return KevCheckpoint(
        model=model,
        head=head,
        head_dim=head_dim,
        temperature=2.0,
        tokenizer_dir=tokenizer_dir,
        kind="lora",
        dtype=torch.float32,
        meta=meta,
    )


def build(out: Path, seed: int = 0) -> None:
    base_dir, kev_dir = out / "base", out / "kev"
    base_dir.mkdir(parents=True, exist_ok=True)
    config_dict = {**TINY_CONFIG, "vocab_size": write_tokenizer(base_dir), "pad_token_id": 1}
    config = Qwen35Config.from_dict(config_dict)
    weights = random_text_weights(config, seed)
    write_base(base_dir, config_dict, weights)
    head = random_head(config.hidden_size, 32, seed + 2)
    write_lora_checkpoint(kev_dir, "../base", config, 16, head, seed + 1)
    # The same model as full weights: the LoRA merged in fp32.
    merged = {name: t + lora_deltas(kev_dir, 1.0).get(name, 0.0) for name, t in weights.items()}
    write_full_checkpoint(out / "kev-full", "../base", config_dict, merged, head)


def build_random(out: Path, config: dict[str, Any], device: str = "cpu", seed: int = 0) -> None:
    """OUT/base (bf16 weights, as Qwen ships its bases) and OUT/kev (LoRA r=16 + head.pt) with random weights of
    any shapes, e.g. KEV4B_CONFIG for serving tests on the GPU machine. Weights are drawn on `device`."""
    base_dir = out / "base"
    base_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(base_dir)
    config_dict = {**config, "dtype": "bfloat16", "pad_token_id": 1}
    parsed = Qwen35Config.from_dict(config_dict)
    weights = {k: v.to(torch.bfloat16).cpu() for k, v in random_text_weights(parsed, seed, device).items()}
    write_base(base_dir, config_dict, weights)
    del weights
    head = random_head(parsed.hidden_size, 256, seed + 2)
    write_lora_checkpoint(out / "kev", "../base", parsed, 16, head, seed + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kev4b", action="store_true", help="random weights of Kev-4B shapes instead")
    parser.add_argument("--device", default="cpu", help="where to draw --kev4b weights (cuda is much faster)")
    args = parser.parse_args()
    if args.kev4b:
        build_random(args.out, KEV4B_CONFIG, args.device, args.seed)
    else:
        build(args.out, args.seed)
    print(f"Kev checkpoints written under {args.out} (random weights: answers are meaningless)")


if __name__ == "__main__":
    main()
