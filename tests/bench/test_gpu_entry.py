"""bench/gpu.sh: the one entry point of the GPU suites, its options and its suites, on a host without a GPU (an
nvidia-smi that names one stands in where a suite asks for the GPU's name)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.conftest import REPO

ENTRY = REPO / "bench" / "gpu.sh"
SUITES = sorted(path.stem for path in (REPO / "bench" / "suites").glob("*.sh") if path.stem != "lib")


def gpu_sh(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ENTRY), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd="/",
    )


def test_without_a_suite_it_lists_every_suite_and_exits_2() -> None:
    shown = gpu_sh()
    assert shown.returncode == 2
    listed = set(re.findall(r"^  (\w+) ", shown.stderr.split("Suites", 1)[1], re.MULTILINE))
    assert listed == set(SUITES) | {"base"}, shown.stderr
    assert gpu_sh("lib").returncode == 2 and gpu_sh("nosuch").returncode == 2


def test_a_bad_option_value_is_refused() -> None:
    refused = gpu_sh("steps", "--torch", "conda")
    assert refused.returncode == 2
    assert "--torch: system or pip, not conda" in refused.stderr


def test_a_suite_runs_only_through_the_entry_point() -> None:
    alone = subprocess.run(
        ["bash", str(REPO / "bench" / "suites" / "steps.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "OUT"},
    )
    assert alone.returncode != 0
    assert "run the suites through bench/gpu.sh" in alone.stderr


def test_a_suite_runs_from_the_installed_tree_into_its_output_folder(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA Test GPU, 81559 MiB, 570.00'\n")
    (fake / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    ran = gpu_sh(
        "steps",
        "--installed",
        "--out",
        str(out),
        "--commit",
        "abc1234",
        "nosuchstep",
        env={"PATH": f"{fake}:{os.environ['PATH']}"},
    )
    # Nothing installed (--installed), the tree's environment and the GPU named, then the step refused by name.
    assert "setup (" not in ran.stdout
    assert "NVIDIA Test GPU" in ran.stdout and re.search(r"^torch \S+ triton \S+$", ran.stdout, re.MULTILINE)
    assert "unknown step nosuchstep" in ran.stdout
    assert ran.returncode == 1
    assert out.is_dir() and not (out / "setup.log").exists()
