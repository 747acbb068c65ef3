"""What a result file names as its commit (kev_backend/dev/provenance.py)."""

from __future__ import annotations

import subprocess

from kev_backend.dev.provenance import REPO, commit


def test_a_commit_git_can_name_is_its_hash_and_any_other_stays_as_given() -> None:
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=REPO)
    assert commit() == commit("HEAD") == commit(head.stdout.strip()[:7]) == head.stdout.strip()
    assert commit("a-tree-without-its-history") == "a-tree-without-its-history"
