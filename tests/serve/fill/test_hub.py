"""kev-fill from a model hub at a pinned commit (a loopback server with the hub's two endpoints, LFS files behind a
redirect to another host): both repositories of a deployment filled, reruns that fetch nothing, a partial fill
completed, corrupted files refused or replaced, branch names and hostile listings refused, retries bounded."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kev_backend.serve.fill import cli
from kev_backend.serve.fill.names import MARKER
from tests.serve.fill.conftest import Hub, HubRepo, checkpoint_files

COMMITS = {"kev": "1" * 40, "base": "2" * 40}
REPOS = {"kev": "jaredpalmer/kev-tiny", "base": "Qwen/tiny-base"}
# As on the hub: weights in LFS, small text files in git itself.
LFS = (".safetensors", ".pt")
EXTRA = {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n", "README.md": b"# tiny\n"}


@pytest.fixture
def repos(hub: Hub, tiny_dir: Path) -> dict[str, dict[str, bytes]]:
    """The synthetic checkpoint (kev) and its base as two hub repositories; what each holds."""
    held = {}
    for top, repo in REPOS.items():
        files = {n.removeprefix(f"{top}/"): d for n, d in checkpoint_files(tiny_dir).items() if n.startswith(f"{top}/")}
        files |= EXTRA
        hub.repos[repo] = HubRepo(COMMITS[top], files, {n for n in files if n.endswith(LFS)})
        held[top] = files
    return held


def fill(
    hub: Hub, top: str, dest: Path, capsys: pytest.CaptureFixture[str], *extra: str, revision: str | None = None
) -> tuple[int, list[str]]:
    argv = ["--retries", "2", "--backoff", "0", *extra, "hub", REPOS[top], str(dest / top)]
    argv += ["--revision", revision or COMMITS[top]]
    code = cli.run(argv, {"HF_ENDPOINT": hub.url, "HF_TOKEN": hub.token})
    return code, capsys.readouterr().err.splitlines()


def on_disk(dest: Path) -> dict[str, bytes]:
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted(dest.rglob("*")) if p.is_file()}


def fetched(lines: list[str]) -> list[str]:
    return sorted(
        line.split()[2].rstrip(":") for line in lines if line.startswith(("kev-fill: fetched", "kev-fill: replaced"))
    )


def test_fills_a_checkpoint_and_its_base_at_pinned_commits(
    hub: Hub, repos: dict[str, dict[str, bytes]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for top, files in repos.items():
        code, lines = fill(hub, top, tmp_path, capsys)
        assert code == 0, lines
        assert fetched(lines) == sorted(files)
        assert on_disk(tmp_path / top) == {**files, MARKER: (tmp_path / top / MARKER).read_bytes()}
        marker = json.loads((tmp_path / top / MARKER).read_text())
        assert marker["source"] == {"kind": "hub", "endpoint": hub.url, "repo": REPOS[top], "revision": COMMITS[top]}
        assert marker["files"] == {
            n: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)} for n, d in files.items()
        }
    # The token went to the hub and never to the CDN the LFS files were redirected to.
    assert {auth for server, _, auth in hub.requests if server == "hub"} == {f"Bearer {hub.token}"}
    cdn = [auth for server, _, auth in hub.requests if server == "cdn"]
    assert len(cdn) == sum(n.endswith(LFS) for files in repos.values() for n in files) and set(cdn) == {None}


def test_a_rerun_fetches_nothing_and_a_partial_fill_is_completed(
    hub: Hub, repos: dict[str, dict[str, bytes]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fill(hub, "kev", tmp_path, capsys)[0] == 0
    hub.requests.clear()
    code, lines = fill(hub, "kev", tmp_path, capsys)
    assert code == 0 and fetched(lines) == [] and hub.resolves() == [], lines
    assert sum(line.startswith("kev-fill: kept") for line in lines) == len(repos["kev"])
    # Files lost (the marker with them, as after an interrupted first run): only those are fetched again.
    for name in ("head.pt", "README.md", MARKER):
        (tmp_path / "kev" / name).unlink()
    hub.requests.clear()
    code, lines = fill(hub, "kev", tmp_path, capsys)
    assert code == 0 and fetched(lines) == ["README.md", "head.pt"], lines
    assert sorted(p.rsplit("/", 1)[-1] for p in hub.resolves()) == ["README.md", "head.pt", "head.pt"]  # + the CDN
    assert on_disk(tmp_path / "kev") == {**repos["kev"], MARKER: (tmp_path / "kev" / MARKER).read_bytes()}


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "adapter_config.json"])
def test_a_corrupted_download_is_refused(
    hub: Hub, repos: dict[str, dict[str, bytes]], name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An LFS file against its sha256, a git file against its blob id; nothing left at the final name."""
    good = repos["kev"][name]
    bad = good[:10] + bytes([good[10] ^ 0x20]) + good[11:]
    hub.repos[REPOS["kev"]].served[name] = bad
    code, lines = fill(hub, "kev", tmp_path, capsys)
    assert code == 1
    assert lines[-1].startswith(f"kev-fill: error: {name}: refused: "), lines
    if name.endswith(LFS):
        want = f"sha256 {hashlib.sha256(bad).hexdigest()} where {hashlib.sha256(good).hexdigest()} was expected"
    else:
        want = f"(sha256 {hashlib.sha256(bad).hexdigest()})"
    assert want in lines[-1]
    assert not (tmp_path / "kev" / name).exists() and not (tmp_path / "kev" / MARKER).exists()
    assert not [p for p in (tmp_path / "kev").rglob("*") if p.name.endswith(".part")]


def test_a_corrupted_file_in_the_volume_is_replaced(
    hub: Hub, repos: dict[str, dict[str, bytes]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fill(hub, "base", tmp_path, capsys)[0] == 0
    (tmp_path / "base" / "tokenizer.json").write_text("{}")
    hub.requests.clear()
    code, lines = fill(hub, "base", tmp_path, capsys)
    assert code == 0 and fetched(lines) == ["tokenizer.json"], lines
    assert (tmp_path / "base" / "tokenizer.json").read_bytes() == repos["base"]["tokenizer.json"]
    assert [p for p in hub.resolves()] == [f"/{REPOS['base']}/resolve/{COMMITS['base']}/tokenizer.json"]


@pytest.mark.parametrize("revision", ["main", "v1.0", "1" * 7, "1" * 39 + "G", "refs/pr/1"])
def test_a_revision_that_is_not_a_commit_is_refused(
    hub: Hub, repos: dict[str, dict[str, bytes]], revision: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, lines = fill(hub, "kev", tmp_path, capsys, revision=revision)
    assert code == 2 and "is not a pinned commit" in lines[-1], lines
    assert hub.requests == [] and not (tmp_path / "kev").exists()


def test_the_commit_must_be_the_one_served(
    hub: Hub, repos: dict[str, dict[str, bytes]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, lines = fill(hub, "kev", tmp_path, capsys, revision="3" * 40)
    assert code == 1 and "HTTP 404" in lines[-1] and "RevisionNotFound" not in lines[-1], lines
    hub.repos[REPOS["kev"]].answer_sha = "4" * 40  # a listing of another commit than the one asked for
    code, lines = fill(hub, "kev", tmp_path, capsys)
    assert code == 1 and f"resolved {COMMITS['kev']} to '{'4' * 40}'" in lines[-1], lines
    assert hub.resolves() == [] and not (tmp_path / "kev" / MARKER).exists()


@pytest.mark.parametrize("name", ["../escape.bin", "/etc/escape.bin", "a/../../escape.bin", ".kev-fill.json", "a\\b"])
def test_traversal_names_in_a_listing_are_refused(
    hub: Hub, repos: dict[str, dict[str, bytes]], name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.repos[REPOS["kev"]].extra_siblings = [{"rfilename": name, "size": 7, "blobId": "0" * 40}]
    dest = tmp_path / "volume"
    code, lines = fill(hub, "kev", dest, capsys)
    assert code == 1 and "refused" in lines[-1] and repr(name) in lines[-1], lines
    assert hub.resolves() == [] and on_disk(dest) == {}  # refused before any download
    assert not list(tmp_path.rglob("escape.bin"))


def test_server_errors_are_retried_a_bounded_number_of_times(
    hub: Hub, repos: dict[str, dict[str, bytes]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = f"/{REPOS['kev']}/resolve/{COMMITS['kev']}/adapter_config.json"
    hub.fail[path] = 2  # two 503s, then the file: within --retries 2
    code, lines = fill(hub, "kev", tmp_path, capsys)
    assert code == 0, lines
    assert sum(line.startswith("kev-fill: retry GET") and "HTTP 503" in line for line in lines) == 2
    (tmp_path / "kev" / "adapter_config.json").unlink()
    hub.fail[path] = 10
    hub.requests.clear()
    code, lines = fill(hub, "kev", tmp_path, capsys)
    assert code == 1 and "HTTP 503: try again (gave up after 3 tries)" in lines[-1], lines
    assert [p for _, p, _ in hub.requests].count(path) == 3
    assert not (tmp_path / "kev" / "adapter_config.json").exists()


def test_a_silent_server_times_out(
    hub: Hub, repos: dict[str, dict[str, bytes]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.stall_s[f"/{REPOS['kev']}/resolve/{COMMITS['kev']}/README.md"] = 3
    started = time.monotonic()
    code, lines = fill(hub, "kev", tmp_path, capsys, "--timeout", "0.5", "--retries", "1")
    assert code == 1 and "timed out" in lines[-1] and "README.md" in lines[-1], lines
    assert time.monotonic() - started < 10


def test_a_wrong_token_is_a_clear_error(
    hub: Hub, repos: dict[str, dict[str, bytes]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "token"
    token.write_text("hf_wrong\n")
    argv = ["hub", REPOS["kev"], str(tmp_path / "kev"), "--revision", COMMITS["kev"]]
    code = cli.run(argv, {"HF_ENDPOINT": hub.url, "HF_TOKEN_PATH": str(token)})
    line = capsys.readouterr().err.splitlines()[-1]
    assert code == 1 and "HTTP 401: Invalid credentials" in line, line
    assert [auth for _, _, auth in hub.requests] == ["Bearer hf_wrong"]  # not retried


def test_the_command_and_the_module(hub: Hub, repos: dict[str, dict[str, bytes]], tmp_path: Path) -> None:
    """`python -m kev_backend.serve.fill` and the `kev-fill` script beside this Python, with the environment's
    settings; exit codes 0 and 2."""
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": hub.token, "PATH": "/usr/bin:/bin"}
    args = ["hub", REPOS["kev"], str(tmp_path / "kev"), "--revision", COMMITS["kev"]]
    script = Path(sys.executable).parent / "kev-fill"
    done = subprocess.run([script, *args], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "marker written" in done.stderr, done.stderr
    args[-1] = "main"
    done = subprocess.run([sys.executable, "-m", "kev_backend.serve.fill", *args], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "'main' is not a pinned commit" in done.stderr, done.stderr
