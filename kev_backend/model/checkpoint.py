"""Kev checkpoints: head.pt metadata, a PEFT LoRA adapter merged into the base, or full weights.

Loader rule: `adapter_config.json` present → LoRA on `head.pt["base"]`; else `config.json` + `model*.safetensors`
→ full weights. head.pt's `weights` must agree. The tokenizer always comes from the base. The merge adds the fp32
delta (B·A)·(alpha/r) to the fp32 base weight and rounds once to the serving dtype.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from .files import regular
from .qwen35 import Qwen35Config, Qwen35TextModel
from .weights import load_text_weights, read_config, text_model_name

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}

# head.pt keys and the defaults Kev applies when they are missing (Meta).
META_DEFAULTS: dict[str, Any] = {
    "base_revision": None,
    "lora": 0,
    "head_dim": 256,
    "option_isolation": False,
    "special_embeddings": False,
    "weights_dtype": "fp32",
    "temperature": 1.0,
    "holdout": [],
    "weights": "lora",
}
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


@dataclass(frozen=True)
class Meta:
    base: str
    head: dict[str, torch.Tensor]
    base_revision: str | None
    lora: int
    head_dim: int
    weights_dtype: str
    temperature: float
    weights: str
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> Meta:
        # head.pt is a pickle: weights_only refuses anything but tensors and plain containers.
        raw = torch.load(regular(path), map_location="cpu", weights_only=True)
        if not isinstance(raw, dict) or "base" not in raw or "head" not in raw:
            raise ValueError(f"{path}: not a Kev head.pt (needs 'base' and 'head')")
        if raw.get("special_embeddings"):
            raise ValueError(f"{path}: special_embeddings (trained delimiter rows) are not supported")
        if raw.get("option_isolation"):
            raise ValueError(f"{path}: option_isolation is a packed-mask variant for attention-only bases")
        known = {"base", "head", *META_DEFAULTS}
        values = {**META_DEFAULTS, **{k: v for k, v in raw.items() if k in known}}
        return cls(
            base=str(values["base"]),
            head=dict(values["head"]),
            base_revision=values["base_revision"],
            lora=int(values["lora"]),
            head_dim=int(values["head_dim"]),
            weights_dtype=str(values["weights_dtype"]),
            temperature=float(values["temperature"]),
            weights=str(values["weights"]),
            extra={k: v for k, v in raw.items() if k not in known},
        )


@dataclass(frozen=True)
class LoadOptions:
    """How to load a checkpoint (the Triton model reads these from its settings: kev_backend.settings)."""

    dtype: str | None = None  # None: fp32 on CPU, bf16 on CUDA (and bf16 for bf16-trained LoRAs)
    temperature: float | None = None  # None: head.pt's
    lora_scale: float = 1.0
    base: str | None = None  # a local copy of the base, overriding head.pt's `base`


@dataclass
class KevCheckpoint:
    model: Qwen35TextModel
    head: dict[str, torch.Tensor]  # fp32 pointer-head state_dict
    head_dim: int
    temperature: float
    tokenizer_dir: Path
    kind: str  # "lora" | "full"
    dtype: torch.dtype
    meta: Meta


def resolve_base(checkpoint_dir: Path, meta: Meta, override: str | None) -> Path:
    """A local directory for the base. Kev names a Hub id; there is no hub here, so relative paths resolve
    against the checkpoint and a Hub id needs KEV_BASE."""
    for candidate in (override, meta.base):
        if not candidate:
            continue
        path = Path(candidate)
        path = path if path.is_absolute() else checkpoint_dir / path
        if path.is_dir():
            return path.resolve()
    raise FileNotFoundError(
        f"base model {meta.base!r} (revision {meta.base_revision}) is not a local directory: "
        "set KEV_BASE (or the model parameter `base`) to a local copy of it"
    )


def choose_dtype(
    requested: str | None, device: torch.device, trained: str, kind: str, config_dtype: str | None
) -> torch.dtype:
    if requested:
        if requested not in DTYPES:
            raise ValueError(f"unknown dtype {requested!r}; use one of fp32, bf16, fp16")
        return DTYPES[requested]
    if kind == "full" and config_dtype:
        return DTYPES[config_dtype]
    if trained in ("bf16", "bfloat16"):
        return torch.bfloat16
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def lora_deltas(
    checkpoint_dir: Path,
    lora_scale: float,
    shapes: Mapping[str, tuple[int, ...]],
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """fp32 ΔW = (B·A)·scaling per bare weight name, from a PEFT adapter directory, computed on `device`. `shapes`:
    the base weights' shapes by bare name, each pair checked against its weight before B·A is formed."""
    config = json.loads(regular(checkpoint_dir / "adapter_config.json").read_text())
    for unsupported in ("trainable_token_indices", "modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(unsupported):
            raise ValueError(f"adapter_config.json: {unsupported} is not supported by this loader")
    if config.get("use_dora") or config.get("lora_bias"):
        raise ValueError("adapter_config.json: DoRA and LoRA biases are not supported")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    scaling = (alpha / r**0.5 if config.get("use_rslora") else alpha / r) * lora_scale
    device = torch.device(device or "cpu")
    adapter = regular(checkpoint_dir / "adapter_model.safetensors")
    return merge_deltas(load_file(str(adapter), device=str(device)), scaling, r, shapes)


def merge_deltas(
    tensors: dict[str, torch.Tensor],
    scaling: float,
    rank: int,
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, torch.Tensor]:
    """PEFT-named `lora_A`/`lora_B` pairs → fp32 ΔW = (B·A)·scaling keyed by bare weight name. Each pair must be
    floating point, A [rank, in] and B [out, rank] with [out, in] its weight's shape in `shapes`: checked before the
    product, which a malformed pair would broadcast or make as large as it names."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        suffix = next((s for s in LORA_SUFFIXES if name.endswith(s)), None)
        if suffix is None or not name.startswith("base_model.model."):
            raise ValueError(f"adapter_model.safetensors: unexpected tensor {name!r}")
        module = text_model_name(name[len("base_model.model.") : -len(suffix)])
        if module is None:
            raise ValueError(f"adapter_model.safetensors: adapter on a non-text module {name!r}")
        pairs.setdefault(module + ".weight", {})[suffix[1:7]] = tensor
    deltas = {}
    for weight, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"adapter_model.safetensors: incomplete LoRA pair for {weight}")
        a, b = ab["lora_A"], ab["lora_B"]
        pair = (
            f"adapter_model.safetensors: {weight}: lora_A {tuple(a.shape)} {a.dtype}, lora_B {tuple(b.shape)} {b.dtype}"
        )
        if not (a.is_floating_point() and b.is_floating_point()) or a.dim() != 2 or b.dim() != 2:
            raise ValueError(f"{pair}: not two floating-point matrices")
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{pair}: not a pair of rank {rank}")
        if weight not in shapes:
            raise ValueError(f"{pair}: the model has no such weight")
        if (b.shape[0], a.shape[1]) != tuple(shapes[weight]):
            raise ValueError(f"{pair}: the weight is {tuple(shapes[weight])}")
        deltas[weight] = (b.float() @ a.float()) * scaling
    return deltas


def build_model(
    config: Qwen35Config,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    deltas: dict[str, torch.Tensor] | None = None,
    device: torch.device | None = None,
) -> Qwen35TextModel:
    """The text model with `weights` (+ fp32 LoRA deltas merged before the single rounding to `dtype`) on `device`
    (default: where the weights are). Each tensor moves there before the merge: on a GPU the fp32 merge of a 4B
    model is quick, on the host it is a pass over 16 GB."""
    with torch.device("meta"):
        model = Qwen35TextModel(config)
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    deltas = deltas or {}
    unknown = sorted(set(deltas) - set(expected))
    if unknown:
        raise ValueError(f"LoRA targets not in the model: {unknown[:5]}")
    merged = {}
    for name, param in expected.items():
        tensor = weights[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
        if not tensor.is_floating_point():
            raise ValueError(f"{name}: stored as {tensor.dtype}, not a floating-point type")
        if device is not None:
            tensor = tensor.to(device)
        if name in deltas:
            tensor = tensor.float() + deltas[name]
        merged[name] = tensor.to(dtype)
    model.load_state_dict(merged, assign=True, strict=True)
    return model.eval().requires_grad_(False)


class WeightsDoNotFit(RuntimeError):
    """The model's weights alone need more GPU memory than is free: the message says how much, and what to do."""


def check_weights_fit(config: Qwen35Config, dtype: torch.dtype, device: torch.device) -> None:
    """Refuses at once, before any weight is read, a model whose weights in `dtype` exceed the GPU's free memory
    (loading them would fail for memory part of the way, after minutes of reading)."""
    with torch.device("meta"):
        needed = sum(p.numel() for p in Qwen35TextModel(config).parameters()) * dtype.itemsize
    free, total = torch.cuda.mem_get_info(device)
    if needed > free:
        raise WeightsDoNotFit(weights_message(needed, free, total))


def weights_message(needed: int, free: int, total: int) -> str:
    gib = 1 << 30
    return (
        f"the model's weights need {needed / gib:.1f} GiB on the GPU, which has {free / gib:.1f} GiB free of "
        f"{total / gib:.1f} GiB: serve it on a GPU with more memory, or free this one of other processes (the bank "
        "and the largest pass need more beside the weights: docs/operations.md, GPU memory)"
    )


def load_checkpoint(
    path: str | Path, device: str | torch.device = "cpu", options: LoadOptions | None = None
) -> KevCheckpoint:
    """Loads a Kev checkpoint directory onto `device`."""
    directory = Path(path).resolve()
    device = torch.device(device)
    options = options or LoadOptions()
    meta = Meta.load(directory / "head.pt")
    has_adapter = (directory / "adapter_config.json").exists()
    kind = "lora" if has_adapter else "full"
    if not has_adapter and not (directory / "config.json").exists():
        raise FileNotFoundError(f"{directory}: neither adapter_config.json nor config.json + model*.safetensors")
    if meta.weights != kind:
        raise ValueError(f"head.pt says weights={meta.weights!r} but {directory} holds a {kind} checkpoint")

    base_dir = resolve_base(directory, meta, options.base)
    if not (base_dir / "tokenizer.json").exists():
        raise FileNotFoundError(f"the base {base_dir} has no tokenizer.json (Kev always tokenizes with the base's)")
    for tokenizer_file in ("tokenizer.json", "tokenizer_config.json"):  # what the tokenizer reads, when present
        if (base_dir / tokenizer_file).exists():
            regular(base_dir / tokenizer_file)
    weights_dir = base_dir if has_adapter else directory
    raw_config = read_config(weights_dir)
    config = Qwen35Config.from_dict(raw_config)
    if (
        kind == "full"
        and config.dtype
        and meta.weights_dtype
        and DTYPES.get(config.dtype) != DTYPES.get(meta.weights_dtype)
    ):
        raise ValueError(
            f"head.pt says weights_dtype={meta.weights_dtype!r} but config.json says dtype={config.dtype!r}"
        )
    dtype = choose_dtype(options.dtype, device, meta.weights_dtype, kind, config.dtype)
    if device.type == "cuda":
        check_weights_fit(config, dtype, device)
    weights = load_text_weights(weights_dir, device)
    shapes = {name: tuple(tensor.shape) for name, tensor in weights.items()}
    deltas = lora_deltas(directory, options.lora_scale, shapes, device) if has_adapter else None
    model = build_model(config, weights, dtype, deltas, device)

    if not all(isinstance(v, torch.Tensor) and v.is_floating_point() for v in meta.head.values()):
        raise ValueError(f"head.pt head tensors {sorted(meta.head)} must all be floating-point tensors")
    head = {k: v.float().to(device) for k, v in meta.head.items()}
    expected_head = {
        "q.weight": (meta.head_dim, config.hidden_size),
        "q.bias": (meta.head_dim,),
        "k.weight": (meta.head_dim, config.hidden_size),
        "k.bias": (meta.head_dim,),
    }
    if {k: tuple(v.shape) for k, v in head.items()} != expected_head:
        raise ValueError(
            f"head.pt head tensors {sorted(head)} do not match head_dim={meta.head_dim}, d={config.hidden_size}"
        )
    temperature = options.temperature if options.temperature is not None else meta.temperature
    return KevCheckpoint(
        model=model,
        head=head,
        head_dim=meta.head_dim,
        temperature=temperature,
        tokenizer_dir=base_dir,
        kind=kind,
        dtype=dtype,
        meta=meta,
    )
