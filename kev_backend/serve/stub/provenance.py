"""What answers: the checkpoint by the content of its files, and the base, LoRA rank, GPU, driver and libraries under
it. The bit-identical promise holds for exactly these (README, "Deterministic answers"), so the start-up line, the
`kev_build_info` metric and GET /v1/models name them.

The checkpoint's content hash is the sha256 of a listing of every file of the checkpoint and of its base, one line
each, `checkpoint/<path>` or `base/<path>`, a tab and the file's own sha256, in byte order of the names: the same
files give the same hash wherever they are mounted, and any changed byte changes it. Hashing tens of GB takes tens of
seconds, so the model computes it after it is ready, in the background; a file whose sha256 kev-fill recorded and
verified (its marker, `.kev-fill.json`, in the checkpoint's folder or one above) at the same size is not read again.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..fill.names import MARKER
from ..version import version

DRIVER = Path("/proc/driver/nvidia/version")


@dataclass(frozen=True)
class ContentHash:
    sha256: str  # of the listing (the module's docstring)
    files: int
    bytes: int
    from_marker: int  # files whose sha256 came from kev-fill's marker


def files_under(root: Path) -> Iterator[tuple[str, Path]]:
    """(relative name, path) of every regular file under `root` (links followed, as a hub cache lays them out),
    hidden ones (a fill's marker and temporary files) left out."""
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_file() and not any(part.startswith(".") for part in name.split("/")):
            yield name, path


def recorded(directory: Path) -> dict[Path, tuple[str, int]]:
    """kev-fill's verified (sha256, size) by resolved path, from the nearest marker at or above `directory` (two
    levels up at most: a volume holds the checkpoint and its base side by side)."""
    for folder in (directory, directory.parent, directory.parent.parent):
        marker = folder / MARKER
        if marker.is_file():
            try:
                files = json.loads(marker.read_text())["files"]
                return {
                    (folder / name).resolve(): (entry["sha256"], int(entry["size"])) for name, entry in files.items()
                }
            except (ValueError, KeyError, TypeError):
                return {}
    return {}


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def content_hash(checkpoint_dir: Path, base_dir: Path | None) -> ContentHash:
    roots = [("checkpoint", checkpoint_dir)]
    if base_dir is not None and base_dir.resolve() != checkpoint_dir.resolve():
        roots.append(("base", base_dir))
    known: dict[Path, tuple[str, int]] = {}
    for _, root in roots:
        known |= recorded(root)
    listing, files, size, from_marker = [], 0, 0, 0
    for label, root in roots:
        for name, path in files_under(root):
            stat_size = path.stat().st_size
            sha, recorded_size = known.get(path.resolve(), ("", -1))
            if recorded_size == stat_size:
                from_marker += 1
            else:
                sha = file_sha256(path)
            listing.append(f"{label}/{name}\t{sha}\n")
            files, size = files + 1, size + stat_size
    digest = hashlib.sha256("".join(sorted(listing)).encode()).hexdigest()
    return ContentHash(digest, files, size, from_marker)


def driver_version() -> str:
    """The NVIDIA kernel driver's version ("" without one)."""
    try:
        line = DRIVER.read_text().splitlines()[0]
    except (OSError, IndexError):
        return ""
    words = [word for word in line.split() if word[:1].isdigit() and word.count(".") >= 1]
    return words[0] if words else ""


def describe(
    base: str, base_revision: str | None, lora_rank: int, device: str, stack: dict[str, str]
) -> dict[str, str]:
    """The fields every report names (the checkpoint's hash is added once known): `stack` is the fused path's
    (gpu/stack.py: torch, cuda, cublaslt, triton), empty on the CPU path, where torch's version is given alone."""
    import torch

    fields = {
        "version": version(),
        "base": base + (f"@{base_revision}" if base_revision else ""),
        "lora_rank": str(lora_rank),
        "device": device,
        "gpu": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "",
        "driver": driver_version() if device.startswith("cuda") else "",
        "torch": stack.get("torch", torch.__version__),
        "cuda": stack.get("cuda", ""),
        "cublaslt": stack.get("cublaslt", ""),
        "triton": stack.get("triton", ""),
    }
    return fields


class BuildInfo:
    """`kev_build_info` on Triton's metrics port (value 1, what answers as its labels) and the start-up line's words
    for it. The checkpoint's hash is computed in the background once the model is up: until then its label reads
    "pending", and that series drops to 0 when the series with the hash appears."""

    def __init__(self, pb_utils: Any, labels: dict[str, str], engine: Any, checkpoint_dir: str) -> None:
        meta = engine.checkpoint.meta
        self.checkpoint_dir = Path(checkpoint_dir)
        self.base_dir = Path(engine.checkpoint.tokenizer_dir)  # the base: its tokenizer is the one Kev uses
        self.fields = describe(meta.base, meta.base_revision, meta.lora, str(engine.device), engine.stack)
        self.labels = labels
        family = pb_utils.MetricFamily
        self.family = family(
            name="kev_build_info",
            description="what answers: the checkpoint (the sha256 of its files' listing), base, LoRA rank, device, GPU,"
            " driver, torch, CUDA, cuBLASLt, the Triton compiler and this project's version (value 1)",
            kind=family.GAUGE,
        )
        self.pending = self.family.Metric(labels={**labels, **self.fields, "checkpoint_sha256": "pending"})
        self.pending.set(1)
        self.thread: threading.Thread | None = None
        self.result: ContentHash | None = None
        self.done: Any = None  # the series with the hash, kept alive with the family

    def line(self) -> str:
        shown = ", ".join(f"{name} {value}" for name, value in self.fields.items() if value)
        return f"what answers: {shown}; checkpoint sha256 being computed"

    def hash_in_background(self, log: Callable[[str], None]) -> None:
        def run() -> None:
            started = time.monotonic()
            try:
                self.result = found = content_hash(self.checkpoint_dir, self.base_dir)
            except OSError as error:
                log(f"kev: the checkpoint's sha256 could not be computed: {error!r}")
                return
            done = self.family.Metric(labels={**self.labels, **self.fields, "checkpoint_sha256": found.sha256})
            done.set(1)
            self.pending.set(0)
            self.done = done
            log(
                f"kev: checkpoint sha256 {found.sha256} ({found.files} files, {found.bytes / 2**30:.2f} GiB, "
                f"{found.from_marker} from kev-fill's verified digests) in {time.monotonic() - started:.1f} s"
            )

        self.thread = threading.Thread(target=run, name="kev-checkpoint-hash", daemon=True)
        self.thread.start()
