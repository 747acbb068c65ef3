"""kev_backend/serve/stub/provenance.py: a checkpoint named by its content (any byte changes it, where it is mounted
does not), kev-fill's verified digests reused, the driver's version read as the kernel module reports it."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from kev_backend.serve.fill.names import MARKER
from kev_backend.serve.stub import provenance


def layout(root: Path) -> tuple[Path, Path]:
    (root / "kev" / "sub").mkdir(parents=True)
    (root / "base").mkdir()
    (root / "kev" / "adapter_model.safetensors").write_bytes(b"adapter" * 1000)
    (root / "kev" / "head.pt").write_bytes(b"head")
    (root / "kev" / "sub" / "tokenizer.json").write_text("{}")
    (root / "base" / "model.safetensors").write_bytes(b"base weights" * 1000)
    return root / "kev", root / "base"


def test_the_hash_follows_the_content_not_the_place(tmp_path: Path) -> None:
    kev, base = layout(tmp_path / "a")
    first = provenance.content_hash(kev, base)
    assert (first.files, first.from_marker) == (4, 0) and first.bytes == 7000 + 4 + 2 + 12000
    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere")
    assert provenance.content_hash(tmp_path / "elsewhere" / "kev", tmp_path / "elsewhere" / "base") == first
    (kev / ".kev-fill.json.kev-fill-x.part").write_text("a temporary file")  # hidden: not part of the checkpoint
    assert provenance.content_hash(kev, base).sha256 == first.sha256
    (base / "model.safetensors").write_bytes(b"base weights" * 999 + b"base weightz")  # one byte
    assert provenance.content_hash(kev, base).sha256 != first.sha256
    assert provenance.content_hash(kev, None).files == 3


def test_kev_fills_verified_digests_are_reused_at_the_same_size(tmp_path: Path) -> None:
    kev, base = layout(tmp_path)
    whole = provenance.content_hash(kev, base)
    files = {}
    for path in sorted(tmp_path.rglob("*")):
        if path.is_file():
            files[path.relative_to(tmp_path).as_posix()] = {
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "size": path.stat().st_size
            }  # fmt: skip
    (tmp_path / MARKER).write_text(json.dumps({"files": files}))
    reused = provenance.content_hash(kev, base)
    assert reused.sha256 == whole.sha256 and reused.from_marker == 4
    (kev / "head.pt").write_bytes(b"head, changed")  # another size: read again, not trusted from the marker
    changed = provenance.content_hash(kev, base)
    assert changed.from_marker == 3 and changed.sha256 != whole.sha256


def test_the_driver_version_as_the_kernel_module_reports_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report = tmp_path / "version"
    report.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22)\n"
        "GCC version:  gcc version 12.3.0\n"
    )
    monkeypatch.setattr(provenance, "DRIVER", report)
    assert provenance.driver_version() == "580.159.04"
    monkeypatch.setattr(provenance, "DRIVER", tmp_path / "none")
    assert provenance.driver_version() == ""
