"""model.safetensors_reader against the safetensors library: the same tensors, bit for bit, whatever the chunking
and worker count, and a clear refusal of malformed files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kev_backend.model.safetensors_reader import read_index, read_tensors


def mixed_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(300, 37, generator=generator),
        "bf16": torch.randn(41, 13, generator=generator).to(torch.bfloat16),
        "f16": torch.randn(7, generator=generator).to(torch.float16),
        "i64": torch.randint(-(2**40), 2**40, (9, 2), generator=generator),
        "mask": torch.rand(11, generator=generator) > 0.5,
        "bytes": torch.randint(0, 256, (5,), generator=generator, dtype=torch.uint8),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
    }


@pytest.mark.parametrize(("chunk_bytes", "workers"), [(1 << 20, 1), (1000, 3), (7, 4)])
def test_reads_what_the_library_reads(tmp_path: Path, chunk_bytes: int, workers: int) -> None:
    path = tmp_path / "mixed.safetensors"
    save_file(mixed_tensors(), str(path), metadata={"format": "pt"})
    expected = load_file(str(path))
    index = read_index(path)
    assert {t.name for t in index} == set(expected)
    read = read_tensors(path, index, torch.device("cpu"), chunk_bytes=chunk_bytes, workers=workers)
    assert set(read) == set(expected)
    for name, tensor in expected.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape, name
        assert torch.equal(read[name], tensor), name


def test_reads_only_the_tensors_asked_for(tmp_path: Path) -> None:
    path = tmp_path / "mixed.safetensors"
    save_file(mixed_tensors(), str(path))
    expected = load_file(str(path))
    wanted = [t for t in read_index(path) if t.name in ("bf16", "i64")]
    read = read_tensors(path, wanted, torch.device("cpu"), chunk_bytes=64, workers=2)
    assert set(read) == {"bf16", "i64"}
    assert torch.equal(read["bf16"], expected["bf16"]) and torch.equal(read["i64"], expected["i64"])


def write_raw(path: Path, header: dict, data: bytes, declared: int | None = None) -> Path:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", declared if declared is not None else len(encoded)) + encoded + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "declared", "message"),
    [
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, 1 << 40, "header of"),
        ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, None, "outside the file"),
        ({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, "needs 12"),
        ({"t": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "no known dtype"),
        ({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "malformed shape"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, None, "outside the file"),
        ({"t": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, "malformed data_offsets"),
    ],
)
def test_refuses_malformed_files(tmp_path: Path, header: dict, data: bytes, declared: int | None, message: str) -> None:
    path = write_raw(tmp_path / "bad.safetensors", header, data, declared)
    with pytest.raises(ValueError, match=message) as error:
        read_index(path)
    assert "bad.safetensors" in str(error.value)


def test_refuses_a_file_too_short_for_its_header(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x05\0\0")
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_index(path)


@pytest.mark.gpu
def test_reads_onto_the_gpu(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = tmp_path / "mixed.safetensors"
    save_file(mixed_tensors(), str(path))
    expected = load_file(str(path))
    read = read_tensors(path, read_index(path), torch.device("cuda"), chunk_bytes=1000, workers=3)
    for name, tensor in expected.items():
        assert read[name].is_cuda and torch.equal(read[name].cpu(), tensor), name
