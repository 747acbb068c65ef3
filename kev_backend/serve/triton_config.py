"""Engine settings from the Triton model config (`parameters` in config.pbtxt), with KEV_* environment overrides.

Relative checkpoint paths resolve against the model directory, so the repository can move as a whole.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..engine.engine import EngineOptions
from ..model.checkpoint import LoadOptions
from ..protocol.systemone import Limits

TRUE = ("1", "on", "true", "yes")
FALSE = ("0", "off", "false", "no")


def boolean(name: str, value: str, default: bool) -> bool:
    """The one grammar of a switch, in config.pbtxt and in the environment alike: 1/on/true/yes or 0/off/false/no
    (any case); empty is the default."""
    value = value.strip().lower()
    if not value:
        return default
    if value in TRUE or value in FALSE:
        return value in TRUE
    raise ValueError(f"{name} must be one of {'/'.join(TRUE)} or {'/'.join(FALSE)}, not {value!r}")


def parameters(model_config: dict[str, Any]) -> dict[str, str]:
    return {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}


def checkpoint_path(params: dict[str, str], model_dir: Path) -> Path:
    """KEV_CHECKPOINT, else the `checkpoint` parameter (relative to the model directory)."""
    raw = os.environ.get("KEV_CHECKPOINT") or params.get("checkpoint", "")
    if not raw:
        raise ValueError("no checkpoint: set KEV_CHECKPOINT or the model parameter `checkpoint`")
    path = Path(raw)
    return path if path.is_absolute() else (model_dir / path).resolve()


def engine_options(params: dict[str, str], device: str) -> EngineOptions:
    """`device` is the instance's (cuda:N for a KIND_GPU instance, "auto" otherwise); an explicit `device`
    parameter other than "auto" wins over it."""

    def integer(key: str, default: int | None) -> int | None:
        value = os.environ.get(f"KEV_{key.upper()}") or params.get(key, "")
        return int(value) if value else default

    limits = Limits(
        max_request_bytes=integer("max_request_bytes", Limits.max_request_bytes),
        max_json_depth=integer("max_json_depth", Limits.max_json_depth),
        max_questions=integer("max_questions", Limits.max_questions),
        max_state_tokens=integer("max_state_tokens", Limits.max_state_tokens),
        max_row_tokens=integer("max_row_tokens", Limits.max_row_tokens),
    )
    load = LoadOptions.from_env(dtype=params.get("dtype") or None, base=params.get("base") or None)
    graphs = boolean("graphs", os.environ.get("KEV_GRAPHS") or params.get("graphs", ""), EngineOptions.graphs)
    return EngineOptions(
        device=device if params.get("device", "auto") in ("", "auto") else params["device"],
        bank_bytes=integer("bank_bytes", EngineOptions.bank_bytes),
        row_pass_tokens=integer("row_pass_tokens", EngineOptions.row_pass_tokens),
        graphs=graphs,
        graph_max_tokens=integer("graph_max_tokens", EngineOptions.graph_max_tokens),
        max_graphs=integer("max_graphs", EngineOptions.max_graphs),
        long_kernels=os.environ.get("KEV_LONG_KERNELS") or params.get("long_kernels") or "fla",
        limits=limits,
        load=load,
    )


def warmup_requests(params: dict[str, str], model_dir: Path) -> list[str]:
    """System One requests (one JSON per line) to answer at load, before the model reports ready: a customer's
    shapes run once (and, on the GPU, compile and tune their kernels) before traffic arrives."""
    raw = os.environ.get("KEV_WARMUP_REQUESTS") or params.get("warmup_requests", "")
    if not raw:
        return []
    path = Path(raw) if Path(raw).is_absolute() else model_dir / raw
    return [line for line in path.read_text().splitlines() if line.strip()]
