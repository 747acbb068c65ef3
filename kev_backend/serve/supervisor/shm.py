"""Shared memory (/dev/shm) for Triton's Python backend: what the request limits let it need, and whether /dev/shm
has that much free.

Each model instance (a Python stub) has one pool in /dev/shm, named with the start's region prefix. Triton's side
copies every request's input tensors of a batch into it before the stub sees the batch, and the stub's responses come
back through it. The pool starts at 1 MiB, grows (in 1 MiB steps at least) whenever an allocation does not fit, and
never shrinks while its stub lives (python_backend src/shm_manager.cc: GrowIfNeeded only truncates upward). So its
size is the most it ever held at once; only a restart of the stub (a Triton restart) gives the memory back.

What it holds at once, by the limits: the inputs of the batch being handed to the stub (Triton's max_batch_size
elements of up to max_request_bytes each, whether 64 requests or one request carrying 64)
and the responses still being sent for an earlier batch. A response echoes each option name at most twice (the choice
and its key in `probabilities`) and adds a probability per option (256 questions x 255 options, about 16 bytes each:
under 1 MiB), so an element's response is at most 2 x max_request_bytes + 1 MiB. With the defaults (64, 4 MiB) that
is 64 x (4 + 9) MiB = 832 MiB per instance; with the pool's 1 MiB growth steps and its fragmentation (a 252 MiB peak
of inputs left a 261 MiB pool) 1 GiB per instance is what the deployments give it.

When a batch's inputs do not fit, the Python backend fails the whole batch: every request in it gets INTERNAL "Failed
to increase the shared memory pool size ...", the small ones beside the large one included. kev-serve logs a warning
at start when /dev/shm has less free than the limits allow (`check`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from ...settings import model_limits

SHM_DIR = Path("/dev/shm")
MIB = 1 << 20
# Every error the Python backend gives for a pool it cannot grow or create names "shared memory" ("Failed to increase
# the shared memory pool size ...", "Unable to initialize shared memory key ...").
SHM_ERROR = "shared memory"
# Per option of a response, beyond the names it echoes: `"key":0.1234,` and the like, for at most 256 x 255 options.
RESPONSE_NUMBERS_BYTES = MIB


@dataclass(frozen=True)
class Need:
    """What the limits let the Python backend's pools hold at once: `instances` pools, each the inputs of one batch of
    `max_batch` elements of `max_request_bytes` and the responses of one such batch."""

    instances: int
    max_batch: int
    max_request_bytes: int

    @property
    def per_instance(self) -> int:
        response = 2 * self.max_request_bytes + RESPONSE_NUMBERS_BYTES
        return self.max_batch * (self.max_request_bytes + response)

    @property
    def total(self) -> int:
        return self.instances * self.per_instance

    def describe(self) -> str:
        return (
            f"{mib(self.total)} ({self.instances} instance(s) x a batch of {self.max_batch} requests of"
            f" {mib(self.max_request_bytes)} and their responses, {mib(self.per_instance)} each)"
        )


def mib(size: int) -> str:
    return f"{size / MIB:,.0f} MiB"


def config_path(repository: Path, model: str, config_name: str | None) -> Path:
    """The model configuration Triton loads: configs/NAME.pbtxt for --model-config-name=NAME, else config.pbtxt."""
    directory = repository / model
    return directory / "configs" / f"{config_name}.pbtxt" if config_name else directory / "config.pbtxt"


def need(config_file: Path, gpus: Callable[[], int], env: Mapping[str, str]) -> Need:
    """What the model configuration in `config_file` (`gpus()`: how many GPUs are visible, asked only if a GPU
    instance group needs it; the model's KEV_* overrides in `env`) lets the Python backend's pools need. OSError or
    text_format.ParseError when the file cannot be read, SettingError for a limit that does not parse."""
    config = text_format.Parse(config_file.read_text(), model_config_pb2.ModelConfig())
    params = {key: value.string_value for key, value in config.parameters.items()}
    limits = model_limits(params, env)
    return Need(instances(config.instance_group, gpus), max(1, config.max_batch_size), limits.max_request_bytes)


def instances(groups: Sequence[model_config_pb2.ModelInstanceGroup], gpus: Callable[[], int]) -> int:
    """How many model instances (stubs, pools) Triton makes of these instance groups: `count` (default 1) per group,
    on each of its listed GPUs, or on each visible GPU for a GPU group without a list (KIND_AUTO is a GPU group when
    there is one). No group: one instance, as Triton does on a machine without GPUs."""
    kinds = model_config_pb2.ModelInstanceGroup
    total = 0
    for group in groups:
        count = group.count or 1
        if group.kind in (kinds.KIND_GPU, kinds.KIND_AUTO) and not group.gpus:
            on = gpus() if group.kind == kinds.KIND_AUTO else max(1, gpus())
            total += count * on if on else count  # KIND_AUTO without a GPU: CPU instances
        else:
            total += count * (len(group.gpus) or 1)
    return total or 1


def free_bytes(directory: Path = SHM_DIR) -> int | None:
    """Bytes free in `directory`'s filesystem (to an unprivileged user); None if it cannot be asked."""
    try:
        stat = os.statvfs(directory)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def check(needed: Need, free: int | None) -> str | None:
    """The warning to log when /dev/shm has less free than `needed`, else None."""
    if free is None or free >= needed.total:
        return None
    return (
        f"WARNING: {SHM_DIR} has {mib(free)} free, and the request limits let Triton's Python backend need"
        f" {needed.describe()}. A batch whose inputs do not fit fails whole (INTERNAL: Failed to increase the shared"
        f" memory pool size), its small requests included. Give the container at least {mib(needed.total)} of"
        f" {SHM_DIR} (podman or docker run --shm-size; a Kubernetes emptyDir with medium: Memory and its sizeLimit;"
        " docs/operations.md, Shared memory)"
    )
