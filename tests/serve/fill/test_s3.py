"""kev-fill from an S3-compatible store (moto's server on loopback, signatures checked): a full fill that Kev loads,
reruns that fetch nothing, an interrupted fill completed, corrupted objects refused, a corrupted volume file replaced,
hostile keys and manifests refused."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from kev_backend.model.checkpoint import load_checkpoint
from kev_backend.serve.fill import cli
from kev_backend.serve.fill.names import MARKER
from tests.serve.fill.conftest import S3Store, checkpoint_files, sha256sums

PREFIX = "models/kev-tiny/"


@pytest.fixture
def files(tiny_dir: Path) -> dict[str, bytes]:
    return checkpoint_files(tiny_dir)


@pytest.fixture
def bucket(s3_store: S3Store, files: dict[str, bytes]) -> str:
    """A bucket holding the checkpoint and its base under PREFIX, with their SHA256SUMS."""
    name = s3_store.bucket()
    s3_store.put(name, {**files, "SHA256SUMS": sha256sums(files)}, PREFIX)
    return name


def fill(
    store: S3Store, bucket: str, dest: Path, capsys: pytest.CaptureFixture[str], *extra: str, **env: str
) -> tuple[int, list[str]]:
    argv = ["--retries", "1", "--backoff", "0", "s3", f"s3://{bucket}/{PREFIX}", str(dest), *extra]
    code = cli.run(argv, {**store.env(), **env})
    return code, capsys.readouterr().err.splitlines()


def named(lines: list[str], action: str) -> list[str]:
    """The files of the log lines `kev-fill: <action> <name>: ...`, sorted."""
    return sorted(line.split()[2].rstrip(":") for line in lines if line.startswith(f"kev-fill: {action} "))


def on_disk(dest: Path) -> dict[str, bytes]:
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted(dest.rglob("*")) if p.is_file()}


def leftovers(dest: Path) -> list[str]:
    return [p.name for p in dest.rglob("*") if p.name.endswith(".part")]


def test_fills_the_checkpoint_and_its_base(
    s3_store: S3Store, bucket: str, files: dict[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "models"
    code, lines = fill(s3_store, bucket, dest, capsys)
    assert code == 0, lines
    marker = json.loads((dest / MARKER).read_text())
    assert on_disk(dest) == {**files, MARKER: (dest / MARKER).read_bytes()}
    assert marker["source"] == {
        "kind": "s3",
        "endpoint": s3_store.url,
        "bucket": bucket,
        "prefix": PREFIX,
        "sha256sums": hashlib.sha256(sha256sums(files)).hexdigest(),
    }
    assert marker["files"] == {n: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)} for n, d in files.items()}
    # One line a file, then the summary.
    assert named(lines, "fetched") == sorted(files)
    assert lines[-1].startswith(f"kev-fill: complete: {len(files)} files")
    assert all((dest / n).stat().st_mode & 0o777 == 0o644 for n in files)
    # What was filled is a checkpoint Kev loads: the LoRA on its base beside it (head.pt names ../base).
    checkpoint = load_checkpoint(dest / "kev")
    assert checkpoint.kind == "lora" and checkpoint.tokenizer_dir == (dest / "base").resolve()


def test_a_rerun_fetches_nothing(
    s3_store: S3Store, bucket: str, files: dict[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "models"
    assert fill(s3_store, bucket, dest, capsys)[0] == 0
    before = {n: (os.stat(dest / n).st_ino, os.stat(dest / n).st_mtime_ns) for n in files}
    # The objects now hold other bytes (the manifest unchanged): a rerun that fetched any would be refused.
    s3_store.put(bucket, {n: b"not the listed bytes" for n in files}, PREFIX)
    code, lines = fill(s3_store, bucket, dest, capsys)
    assert code == 0, lines
    assert named(lines, "kept") == sorted(files)
    assert not [line for line in lines if "fetched " in line and "complete" not in line]
    assert {n: (os.stat(dest / n).st_ino, os.stat(dest / n).st_mtime_ns) for n in files} == before
    assert (dest / MARKER).is_file()


def test_an_interrupted_fill_is_completed(
    s3_store: S3Store, bucket: str, files: dict[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "models"
    # The last object (in key order) is corrupt: the run stops there, the earlier files in place, no marker.
    names = sorted(files)
    s3_store.put(bucket, {names[-1]: files[names[-1]][:-1] + bytes([files[names[-1]][-1] ^ 1])}, PREFIX)
    code, lines = fill(s3_store, bucket, dest, capsys)
    assert code == 1, lines
    assert not (dest / MARKER).exists() and not (dest / names[-1]).exists()
    assert on_disk(dest) == {n: files[n] for n in names[:-1]}
    # A crash mid-download leaves a temporary file; a later run removes it.
    (dest / "kev" / ".head.pt.kev-fill-abc123.part").write_bytes(b"half")
    s3_store.put(bucket, {names[-1]: files[names[-1]]}, PREFIX)  # the store is fixed
    code, lines = fill(s3_store, bucket, dest, capsys)
    assert code == 0, lines
    assert named(lines, "fetched") == [names[-1]]
    assert on_disk(dest) == {**files, MARKER: (dest / MARKER).read_bytes()} and not leftovers(dest)


def test_a_corrupted_object_is_refused(
    s3_store: S3Store, bucket: str, files: dict[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "models"
    bad = "kev/adapter_model.safetensors"
    corrupt = bytearray(files[bad])
    corrupt[len(corrupt) // 2] ^= 0xFF
    s3_store.put(bucket, {bad: bytes(corrupt)}, PREFIX)
    code, lines = fill(s3_store, bucket, dest, capsys)
    assert code == 1
    error = lines[-1]
    assert error.startswith(f"kev-fill: error: {bad}: refused: sha256 {hashlib.sha256(corrupt).hexdigest()}"), error
    assert f"where {hashlib.sha256(files[bad]).hexdigest()} was expected" in error
    assert not (dest / bad).exists() and not (dest / MARKER).exists() and not leftovers(dest)


def test_a_corrupted_file_in_the_volume_is_replaced(
    s3_store: S3Store, bucket: str, files: dict[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "models"
    assert fill(s3_store, bucket, dest, capsys)[0] == 0
    damaged = dest / "base/model.safetensors"
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0x01
    damaged.write_bytes(bytes(data))
    (dest / "base/config.json").unlink()
    (dest / "base/config.json").symlink_to("/etc/hostname")  # a link is not the listed file either
    code, lines = fill(s3_store, bucket, dest, capsys)
    assert code == 0, lines
    replaced = [line for line in lines if line.startswith("kev-fill: replac")]
    assert [line.split()[2].rstrip(":") for line in replaced] == ["base/config.json", "base/config.json",
                                                                   "base/model.safetensors",
                                                                   "base/model.safetensors"]  # fmt: skip
    assert on_disk(dest) == {**files, MARKER: (dest / MARKER).read_bytes()}
    assert not (dest / "base/config.json").is_symlink()


@pytest.mark.parametrize("key", ["../escape.bin", "kev/../../escape.bin", "kev//head2.pt"])
def test_a_traversal_key_is_refused(
    s3_store: S3Store, files: dict[str, bytes], key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bucket = s3_store.bucket()
    hostile = {**files, key: b"payload"}
    s3_store.put(bucket, {**files, key: b"payload"}, PREFIX)
    # Listed in the manifest or not, the name is refused before anything is written.
    s3_store.put(bucket, {"SHA256SUMS": sha256sums(files)}, PREFIX)
    dest = tmp_path / "a" / "models"
    code, lines = fill(s3_store, bucket, dest, capsys)
    assert code == 1 and "refused" in lines[-1] and key in lines[-1], lines
    s3_store.put(bucket, {"SHA256SUMS": sha256sums(hostile)}, PREFIX)
    code, lines = fill(s3_store, bucket, dest, capsys)
    assert code == 1 and "refused" in lines[-1], lines
    assert not list((tmp_path / "a").rglob("escape.bin")) and on_disk(dest) == {}


@pytest.mark.parametrize("line", ["{}  /etc/passwd", "{}  ../x", "{} *kev/../../x", "not a sum"])
def test_a_hostile_manifest_is_refused(
    s3_store: S3Store, files: dict[str, bytes], line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bucket = s3_store.bucket()
    manifest = sha256sums(files) + line.format("0" * 64).encode() + b"\n"
    s3_store.put(bucket, {**files, "SHA256SUMS": manifest}, PREFIX)
    code, lines = fill(s3_store, bucket, tmp_path / "models", capsys)
    assert code == 1 and "SHA256SUMS:" in lines[-1], lines
    assert on_disk(tmp_path / "models") == {}


def test_objects_the_manifest_does_not_vouch_for_are_refused(
    s3_store: S3Store, bucket: str, files: dict[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s3_store.put(bucket, {"kev/extra.bin": b"smuggled"}, PREFIX)
    code, lines = fill(s3_store, bucket, tmp_path / "models", capsys)
    assert code == 1 and lines[-1].endswith(f"{PREFIX}kev/extra.bin: not listed in SHA256SUMS: refused"), lines
    s3_store.client.delete_object(Bucket=bucket, Key=PREFIX + "kev/extra.bin")
    s3_store.client.delete_object(Bucket=bucket, Key=PREFIX + "kev/head.pt")
    code, lines = fill(s3_store, bucket, tmp_path / "models", capsys)
    assert code == 1 and "SHA256SUMS lists kev/head.pt, absent under" in lines[-1], lines
    assert on_disk(tmp_path / "models") == {}


def test_a_given_or_pinned_manifest(
    s3_store: S3Store, bucket: str, files: dict[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = sha256sums(files)
    code, lines = fill(s3_store, bucket, tmp_path / "a", capsys, "--sha256sums-sha256", "0" * 64)
    assert code == 1 and "SHA256SUMS: sha256" in lines[-1] and "refused" in lines[-1], lines
    pinned = hashlib.sha256(manifest).hexdigest()
    assert fill(s3_store, bucket, tmp_path / "a", capsys, "--sha256sums-sha256", pinned)[0] == 0
    # A manifest given by the user wins over the stored one: here it disagrees with an object, which is refused.
    local = tmp_path / "SHA256SUMS"
    local.write_bytes(manifest.replace(hashlib.sha256(files["kev/head.pt"]).hexdigest().encode(), b"1" * 64))
    code, lines = fill(s3_store, bucket, tmp_path / "b", capsys, "--sha256sums", str(local))
    assert code == 1 and lines[-1].startswith("kev-fill: error: kev/head.pt: refused: sha256"), lines


def test_credentials_are_checked_by_the_store(
    s3_store: S3Store, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, lines = fill(s3_store, bucket, tmp_path / "a", capsys, AWS_SECRET_ACCESS_KEY="wrong")
    assert code == 1 and "HTTP 403" in lines[-1] and "SignatureDoesNotMatch" in lines[-1], lines
    # Keys from files, as a Secret mounts them.
    (tmp_path / "id").write_text(s3_store.access_key + "\n")
    (tmp_path / "key").write_text(s3_store.secret_key + "\n")
    env = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    env |= {"AWS_ACCESS_KEY_ID_FILE": str(tmp_path / "id"), "AWS_SECRET_ACCESS_KEY_FILE": str(tmp_path / "key")}
    env |= {"AWS_SESSION_TOKEN_FILE": str(tmp_path / "absent")}  # a key the Secret does not hold: unset
    assert fill(s3_store, bucket, tmp_path / "b", capsys, **env)[0] == 0
    code, lines = fill(s3_store, bucket, tmp_path / "c", capsys, AWS_SECRET_ACCESS_KEY="")
    assert code == 2 and "no S3 credentials" in lines[-1], lines
