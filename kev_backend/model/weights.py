"""HF-layout safetensors weights for the Qwen3.5 text tower: one file or shards + index, any of the layouts
Qwen3.5 checkpoints come in (`model.language_model.*` multimodal, `model.*` CausalLM, unprefixed bare text model).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .files import inside, regular
from .safetensors_reader import StoredTensor, read_index, read_tensors

# Prefixes of the text tower in the layouts we accept, longest first.
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
# Parts of a checkpoint Kev never reads: the vision tower, the multi-token-prediction layer, the LM head.
SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "lm_head.", "model.mtp.")


def safetensors_files(directory: Path) -> list[Path]:
    """`model.safetensors`, or the shards named by `model.safetensors.index.json`."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(regular(index).read_text())["weight_map"]
        return [inside(directory, name) for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    shards = sorted(directory.glob("model-*-of-*.safetensors"))
    if shards:
        return shards
    raise FileNotFoundError(f"no model.safetensors or shard index in {directory}")


def text_model_name(name: str) -> str | None:
    """The bare text-model parameter name (`layers.3.mlp.up_proj.weight`), or None for skipped tensors."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def load_text_weights(directory: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """All text-tower tensors of an HF checkpoint directory, keyed by bare name, in their stored dtype, read straight
    onto `device` (the parts Kev never reads are never read from disk)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(directory):
        wanted: dict[str, StoredTensor] = {}  # bare name → where this file stores it
        for stored in read_index(path):
            bare = text_model_name(stored.name)
            if bare is None:
                continue
            if bare in tensors or bare in wanted:
                raise ValueError(f"{path.name}: tensor {stored.name!r} duplicates {bare!r}")
            wanted[bare] = stored
        read = read_tensors(path, wanted.values(), torch.device(device))
        tensors.update((bare, read[stored.name]) for bare, stored in wanted.items())
    return tensors


def read_config(directory: Path) -> dict:
    return json.loads(regular(directory / "config.json").read_text())
