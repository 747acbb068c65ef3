"""Shared fixtures: tiny Kev checkpoints built by the project's own builder, and helpers for HF references."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kev_backend import tiny

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """base/, kev/ (LoRA) and kev-full/ checkpoints with random weights (kev_backend.tiny)."""
    out = tmp_path_factory.mktemp("tiny")
    tiny.build(out)
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (GPU machine only)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def hf_qwen35_torch_path() -> ModuleType:
    """transformers' Qwen3.5 modeling module bound to its pure-torch kernels.

    transformers picks fla's kernels at import whenever fla (and triton) import; on a CPU those crash, and on a
    GPU they are not the fp32 reference. Re-importing with fla and causal_conv1d hidden forces the torch path.
    """
    hidden = {name: sys.modules.get(name) for name in ("fla", "causal_conv1d")}
    sys.modules.update({name: None for name in hidden})  # None in sys.modules makes `import` raise ImportError
    try:
        import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

        modeling = importlib.reload(modeling)
    finally:
        for name, module in hidden.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return modeling
