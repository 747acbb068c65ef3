"""Deterministic Kev-format checkpoints with random weights:
`python -m kev_backend.dev.synthetic OUT_DIR [--size SIZE]`.

OUT_DIR/base is a Qwen3.5 base in HF layout (config.json, model.safetensors with `model.*` names plus an lm_head,
a word-level tokenizer holding Kev's five delimiter tokens); OUT_DIR/kev is a LoRA checkpoint on it (PEFT adapter +
head.pt); OUT_DIR/kev-full the same model as a full-weight checkpoint. Their answers are meaningless: the weights
are random, scaled so activations stay O(1) through the layers and the probabilities are not flat.

With `--size` (dev/sizes.py's SIZES: 0.8b, 4b, 9b, 27b) the same layout at a published model's text-config shapes,
bf16, each tensor drawn on `--device` and written at once (safetensors shards past `--shard-gib`): OUT/kev is a LoRA
on OUT/base, or for Kev-27B, a full fine-tune, full weights in OUT/kev beside a tokenizer-only OUT/base.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from ..model.checkpoint import DTYPES, KevCheckpoint, Meta, lora_deltas
from ..model.qwen35 import Qwen35Config, Qwen35TextModel
from ..protocol.encoding import DELIMITER_TOKENS
from .sizes import SIZES, TINY_CONFIG, Size
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


def parameter_shapes(config: Qwen35Config) -> dict[str, torch.Size]:
    """The text model's bare parameter names and shapes, in its parameter order (the order weights are drawn in)."""
    with torch.device("meta"):
        return {name: p.shape for name, p in Qwen35TextModel(config).named_parameters()}


def random_tensor(
    name: str,
    shape: torch.Size | tuple[int, ...],
    generator: torch.Generator,
    depth_scale: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One bare-name weight at a trained model's scale, drawn in `dtype` on the generator's device: projections with
    std 1/sqrt(fan_in) so every activation stays O(1), output projections further scaled by `depth_scale`
    (1/sqrt(2·layers)) so the residual stream does not grow with depth, non-zero norm weights (so a missing 1+w
    shows), negative A_log (per-step decay in (0, 1))."""
    device = generator.device
    normal = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "norm.weight":
        tensor = 0.1 * normal  # zero-centred norms: scale is 1 + w
    elif name.endswith("linear_attn.norm.weight"):
        tensor = 1.0 + 0.1 * normal  # plain-weight gated norm
    elif name.endswith("A_log"):
        tensor = torch.log(torch.rand(shape, generator=generator, device=device, dtype=dtype) * 0.9 + 0.05)
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
    return tensor.contiguous()


def depth_scale(config: Qwen35Config) -> float:
    return 1.0 / math.sqrt(2 * config.num_hidden_layers)


def random_text_weights(config: Qwen35Config, seed: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Bare-name fp32 weights (random_tensor), all drawn from one generator in parameter order."""
    generator = torch.Generator(device).manual_seed(seed)
    scale = depth_scale(config)
    return {name: random_tensor(name, shape, generator, scale) for name, shape in parameter_shapes(config).items()}


def lora_modules(config: Qwen35Config) -> dict[str, torch.nn.Linear]:
    """The LoRA targets of the text model by module name, in module order (the order their pairs are drawn in)."""
    with torch.device("meta"):
        modules = dict(Qwen35TextModel(config).named_modules())
    return {
        name: module
        for name, module in modules.items()
        if name.rsplit(".", 1)[-1] in LORA_TARGETS and isinstance(module, torch.nn.Linear)
    }


def lora_pair(module: torch.nn.Linear, rank: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (A, B) for one target; B is non-zero (PEFT initialises it to zero)."""
    device = generator.device
    a = torch.randn(rank, module.in_features, generator=generator, device=device) / math.sqrt(module.in_features)
    b = torch.randn(module.out_features, rank, generator=generator, device=device) * 0.01
    return a.contiguous(), b.contiguous()


def random_lora(
    config: Qwen35Config, rank: int, seed: int, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """PEFT-named fp32 LoRA tensors for every target module."""
    generator = torch.Generator(device).manual_seed(seed)
    tensors = {}
    for name, module in lora_modules(config).items():
        a, b = lora_pair(module, rank, generator)
        tensors[f"base_model.model.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.{name}.lora_B.weight"] = b
    return tensors


def random_head(hidden_size: int, head_dim: int, seed: int, scale: float = 2.5) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def linear() -> tuple[torch.Tensor, torch.Tensor]:
        weight = torch.randn(head_dim, hidden_size, generator=generator) * scale / math.sqrt(hidden_size)
        return weight, torch.randn(head_dim, generator=generator) * 0.1

    (qw, qb), (kw, kb) = linear(), linear()
    return {"q.weight": qw, "q.bias": qb, "k.weight": kw, "k.bias": kb}


def head_meta(
    base: str,
    head: dict[str, torch.Tensor],
    weights: str,
    lora: int,
    temperature: float = 2.0,
    weights_dtype: str = "fp32",
) -> dict:
    return {
        "base": base,
        "base_revision": None,
        "lora": lora,
        "head_dim": head["q.weight"].shape[0],
        "head": head,
        "temperature": temperature,
        "weights": weights,
        "weights_dtype": weights_dtype,
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


# write_lora_checkpoint's lora_alpha / r: the scaling the loader merges a written adapter with.
LORA_SCALING = 2.0


def synthetic_model(
    config: Qwen35Config, device: str | torch.device, dtype: torch.dtype, seed: int = 0, lora_rank: int = 16
) -> Qwen35TextModel:
    """The text model with random weights on `device` in `dtype`, a rank-`lora_rank` LoRA (0: none) merged in fp32
    before the one rounding to `dtype`, as the loader merges one. Built a tensor at a time, so the peak is the
    model plus one tensor's fp32 temporaries (a 27B model in bf16 fits where its fp32 copy would not). The values
    equal random_text_weights' and random_lora's for the same seeds (seed, seed + 1): the same generators draw in
    the same order."""
    device = torch.device(device)
    weights = torch.Generator(device).manual_seed(seed)
    adapters = torch.Generator(device).manual_seed(seed + 1)
    targets = {f"{name}.weight": module for name, module in lora_modules(config).items()} if lora_rank else {}
    scale = depth_scale(config)
    tensors = {}
    for name, shape in parameter_shapes(config).items():
        tensor = random_tensor(name, shape, weights, scale)
        if name in targets:
            a, b = lora_pair(targets[name], lora_rank, adapters)
            tensor = tensor.float() + (b.float() @ a.float()) * LORA_SCALING
        tensors[name] = tensor.to(dtype)
    with torch.device("meta"):
        model = Qwen35TextModel(config)
    model.load_state_dict(tensors, assign=True, strict=True)
    return model.eval().requires_grad_(False)


def synthetic_checkpoint(
    config_dict: dict[str, Any],
    tokenizer_dir: Path,
    device: str | torch.device,
    seed: int = 0,
    lora_rank: int = 16,
    head_dim: int = 256,
    dtype: torch.dtype = torch.float32,
) -> KevCheckpoint:
    """A Kev checkpoint built in memory on `device` (synthetic_model: LoRA merged, or none with `lora_rank` 0: a
    full fine-tune), e.g. Kev-4B shapes for GPU parity and benchmarks, with the tiny tokenizer of `tokenizer_dir`
    (its ids are a subset of any larger vocabulary)."""
    config = Qwen35Config.from_dict(config_dict)
    model = synthetic_model(config, device, dtype, seed, lora_rank)
    head = {k: v.to(device) for k, v in random_head(config.hidden_size, head_dim, seed + 2).items()}
    kind = "lora" if lora_rank else "full"
    weights_dtype = next(name for name, value in DTYPES.items() if value == dtype)
    meta = Meta(
        base=str(tokenizer_dir),
        head=head,
        base_revision=None,
        lora=lora_rank,
        head_dim=head_dim,
        weights_dtype=weights_dtype,
        temperature=2.0,
        weights=kind,
    )
    return KevCheckpoint(
        model=model,
        head=head,
        head_dim=head_dim,
        temperature=2.0,
        tokenizer_dir=tokenizer_dir,
        kind=kind,
        dtype=dtype,
        meta=meta,
    )


def size_checkpoint(
    size: Size, device: str | torch.device, dtype: torch.dtype, config: dict[str, Any] | None = None
) -> KevCheckpoint:
    """Random weights of `size`'s shapes (or of `config`, e.g. parity_config's) on `device` in `dtype`, drawn a
    tensor at a time (synthetic_checkpoint, seed 0), with the tiny tokenizer in a new temporary directory."""
    tokenizer = Path(tempfile.mkdtemp(prefix=f"kev-{size.name}-tokenizer-"))
    write_tokenizer(tokenizer)
    return synthetic_checkpoint(config or size.config, tokenizer, device, lora_rank=size.lora_rank, dtype=dtype)


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
    deltas = lora_deltas(kev_dir, 1.0, {name: tuple(t.shape) for name, t in weights.items()})
    merged = {name: t + deltas.get(name, 0.0) for name, t in weights.items()}
    write_full_checkpoint(out / "kev-full", "../base", config_dict, merged, head)


# --------------------------------------------------------------------------------------------------------------------
# checkpoints of any size on disk, a tensor at a time

SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
SHARD_BYTES = 5 << 30  # per safetensors file, as save_pretrained's default max_shard_size


@dataclass(frozen=True)
class StoredSpec:
    """A tensor to write: its name in the file (`stored`), its bare text-model name (what random_tensor draws)."""

    stored: str
    bare: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def stored_specs(config: Qwen35Config, prefix: str, lm_head: bool, dtype: torch.dtype) -> list[StoredSpec]:
    """The text model's tensors under `prefix` in parameter order, then an LM head (drawn like the embedding)."""
    specs = [StoredSpec(prefix + name, name, tuple(shape), dtype) for name, shape in parameter_shapes(config).items()]
    if lm_head:
        head = (config.vocab_size, config.hidden_size)
        specs.append(StoredSpec("lm_head.weight", "embed_tokens.weight", head, dtype))
    return specs


def plan_shards(specs: list[StoredSpec], shard_bytes: int) -> list[list[StoredSpec]]:
    """Consecutive tensors per file, each file at most `shard_bytes` unless one tensor alone is larger."""
    shards: list[list[StoredSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_safetensors(path: Path, specs: list[StoredSpec], make: Callable[[StoredSpec], torch.Tensor]) -> None:
    """A safetensors file whose header is written first (its shapes are known), then each tensor as `make` returns
    it, copied to the host and written at once: the host holds one tensor, never the file. The header is padded with
    spaces to 8 bytes, as the safetensors library writes it."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        span = [offset, offset + spec.nbytes]
        header[spec.stored] = {"dtype": SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape), "data_offsets": span}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for spec in specs:
            tensor = make(spec).to("cpu").contiguous()
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise ValueError(f"{spec.stored}: made {tuple(tensor.shape)} {tensor.dtype}, planned {spec}")
            f.write(tensor.view(-1).view(torch.uint8).numpy().data)
            del tensor


def write_weights(
    directory: Path, specs: list[StoredSpec], make: Callable[[StoredSpec], torch.Tensor], shard_bytes: int
) -> list[Path]:
    """`model.safetensors`, or past `shard_bytes` HF's shards (`model-00001-of-0000N.safetensors`) and their
    `model.safetensors.index.json`, as save_pretrained lays them out; the files written."""
    shards = plan_shards(specs, shard_bytes)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {
            "metadata": {"total_size": sum(spec.nbytes for spec in specs)},
            "weight_map": {spec.stored: name for name, shard in zip(names, shards) for spec in shard},
        }
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for name, shard in zip(names, shards):
        write_safetensors(directory / name, shard, make)
    return [directory / name for name in names]


def drawn_tensors(config: Qwen35Config, seed: int, device: str | torch.device) -> Callable[[StoredSpec], torch.Tensor]:
    """Draws each StoredSpec when asked, directly in its dtype on `device` (random_tensor), from one generator in
    the order asked: a model never exists whole anywhere, on the device or in fp32."""
    generator = torch.Generator(device).manual_seed(seed)
    scale = depth_scale(config)
    return lambda spec: random_tensor(spec.bare, spec.shape, generator, scale, spec.dtype)


def write_random(
    out: Path,
    config: dict[str, Any],
    weights: str = "lora",
    device: str = "cpu",
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
) -> None:
    """Random weights of any shapes in bf16 (as Qwen ships its bases and Kev its full fine-tunes), drawn on `device`
    a tensor at a time. `weights` "lora": OUT/base, an HF-layout base (`model.*` names, an LM head when
    untied), and OUT/kev, a rank-16 LoRA on it + head.pt. "full": OUT/kev, full weights as Kev's full fine-tunes
    save them (write_full_checkpoint: bare names, no LM head) + head.pt, beside OUT/base holding only the tokenizer
    (Kev always tokenizes with the base's)."""
    if weights not in ("lora", "full"):
        raise ValueError(f"weights must be lora or full, not {weights!r}")
    base_dir, kev_dir = out / "base", out / "kev"
    base_dir.mkdir(parents=True, exist_ok=True)
    kev_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(base_dir)
    config_dict = {**config, "dtype": "bfloat16", "pad_token_id": 1}
    parsed = Qwen35Config.from_dict(config_dict)
    make = drawn_tensors(parsed, seed, device)
    head = random_head(parsed.hidden_size, 256, seed + 2)
    if weights == "lora":
        (base_dir / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
        specs = stored_specs(parsed, "model.", not parsed.tie_word_embeddings, torch.bfloat16)
        write_weights(base_dir, specs, make, shard_bytes)
        write_lora_checkpoint(kev_dir, "../base", parsed, 16, head, seed + 1)
        return
    # Kev's full fine-tunes save no LM head: the config says tied, as write_full_checkpoint's do.
    (kev_dir / "config.json").write_text(json.dumps({**config_dict, "tie_word_embeddings": True}, indent=2) + "\n")
    write_weights(kev_dir, stored_specs(parsed, "", False, torch.bfloat16), make, shard_bytes)
    torch.save(head_meta("../base", head, "full", 0, weights_dtype="bf16"), kev_dir / "head.pt")


def build_random(out: Path, config: dict[str, Any], device: str = "cpu", seed: int = 0) -> None:
    """OUT/base and OUT/kev (LoRA r=16 + head.pt) with random bf16 weights of any shapes (write_random)."""
    write_random(out, config, "lora", device, seed)


def write_size(out: Path, size: str, device: str = "cpu", seed: int = 0, shard_bytes: int = SHARD_BYTES) -> Path:
    """Random weights of a Kev size's shapes as Kev ships it (write_random); the checkpoint's directory."""
    spec = SIZES[size]
    write_random(out, spec.config, spec.weights, device, seed, shard_bytes)
    return out / "kev"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=list(SIZES), help="random weights of a Kev size's shapes instead")
    parser.add_argument("--kev4b", action="store_true", help="the same as --size 4b")
    parser.add_argument("--device", default="cpu", help="where to draw --size weights (cuda is much faster)")
    parser.add_argument("--shard-gib", type=float, default=SHARD_BYTES / (1 << 30), help="largest safetensors file")
    args = parser.parse_args()
    size = "4b" if args.kev4b else args.size
    if size:
        started = time.perf_counter()
        checkpoint = write_size(args.out, size, args.device, args.seed, int(args.shard_gib * (1 << 30)))
        print(f"{SIZES[size].label}: {checkpoint} in {time.perf_counter() - started:.0f} s", flush=True)
    else:
        build(args.out, args.seed)
    print(f"Kev checkpoints written under {args.out} (random weights: answers are meaningless)")


if __name__ == "__main__":
    main()
