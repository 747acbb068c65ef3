"""What the Triton model's settings (kev_backend.settings.ModelSettings: its config.pbtxt parameters with their KEV_*
overrides) mean for the engine: its options on this instance's device, and the warm-up requests."""

from __future__ import annotations

from ...engine.engine import EngineOptions
from ...model.checkpoint import LoadOptions
from ...settings import ModelSettings


def engine_options(settings: ModelSettings, device: str) -> EngineOptions:
    """`device` is the instance's (cuda:N for a KIND_GPU instance, "auto" otherwise); a `device` setting other than
    "auto" wins over it. Settings not given keep EngineOptions' and LoadOptions' defaults."""
    return EngineOptions(
        **{"device": device, **settings.engine}, load=LoadOptions(**settings.load), limits=settings.limits
    )


def warmup_requests(settings: ModelSettings) -> list[str]:
    """System One requests (one JSON per line) to answer at load, before the model reports ready: a customer's
    shapes run once (and, on the GPU, compile and tune their kernels) before traffic arrives."""
    if settings.warmup_requests is None:
        return []
    return [line for line in settings.warmup_requests.read_text().splitlines() if line.strip()]
