"""Reads the tensors of a safetensors file straight onto a device, several chunks at a time.

`safetensors.safe_open(...).get_tensor` copies each tensor out of the memory-mapped file into a new host tensor, and
`.to("cuda")` then copies it again from pageable memory, one tensor after another. Here worker threads read the
file's byte ranges with `os.preadv` into pinned buffers of their own and copy each buffer to the device on their own
stream, so disk (or page cache) reads and host-to-device copies overlap, and the GIL is free during both
(docs/kernels.md, Start-up).

The format (github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON header mapping each
name to its dtype, shape and byte range relative to the data that follows the header, then the data. The header is
checked before any byte is read: known dtypes, sizes that match the shapes, ranges inside the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .files import regular

DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}
MAX_HEADER_BYTES = 100 << 20  # the limit the safetensors library itself sets
CHUNK_BYTES = 64 << 20  # a worker's pinned buffer
WORKERS = 4


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offsets in the file
    end: int


@dataclass
class _Chunk:
    """A contiguous byte range of the file, read at once; `pieces` say where its bytes go:
    (destination bytes, offset there, offset in the chunk, length)."""

    start: int
    end: int
    pieces: list[tuple[torch.Tensor, int, int, int]] = field(default_factory=list)


def read_index(path: Path) -> list[StoredTensor]:
    """The tensors `path` holds, as its header places them, checked against the file's size."""
    size = regular(path).stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path.name}: not a safetensors file ({size} bytes)")
        header_bytes = int.from_bytes(prefix, "little")
        if header_bytes > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path.name}: header of {header_bytes} bytes in a file of {size}")
        try:
            header = json.loads(f.read(header_bytes))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path.name}: unreadable header ({error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: the header is not a JSON object")
    data_start = 8 + header_bytes
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors.append(_stored_tensor(path.name, name, entry, data_start, size))
    return tensors


def _stored_tensor(file: str, name: str, entry: object, data_start: int, size: int) -> StoredTensor:
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        raise ValueError(f"{file}: tensor {name!r} has no known dtype ({entry!r:.200})")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"{file}: tensor {name!r} has a malformed shape {shape!r:.200}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)):
        raise ValueError(f"{file}: tensor {name!r} has malformed data_offsets {offsets!r:.200}")
    dtype = DTYPES[entry["dtype"]]
    begin, end = offsets
    numel = 1
    for n in shape:
        numel *= n
    if not 0 <= begin <= end or data_start + end > size:
        raise ValueError(f"{file}: tensor {name!r} lies outside the file (bytes {begin}-{end} of {size - data_start})")
    needed = numel * dtype.itemsize
    if end - begin != needed:
        raise ValueError(f"{file}: tensor {name!r} holds {end - begin} bytes, its shape {shape} needs {needed}")
    return StoredTensor(name, dtype, tuple(shape), data_start + begin, data_start + end)


def read_tensors(
    path: Path,
    tensors: Iterable[StoredTensor],
    device: torch.device,
    chunk_bytes: int = CHUNK_BYTES,
    workers: int = WORKERS,
) -> dict[str, torch.Tensor]:
    """The given tensors of `path` (from read_index), each a new tensor on `device`, by name."""
    wanted = sorted(tensors, key=lambda t: t.start)
    out = {t.name: torch.empty(t.shape, dtype=t.dtype, device=device) for t in wanted}
    chunks = _chunks(wanted, out, chunk_bytes)
    if not chunks:
        return out
    cuda = device.type == "cuda"
    workers = min(workers, len(chunks))
    buffer_bytes = max(chunk.end - chunk.start for chunk in chunks)

    def work(first: int) -> None:
        buffer = torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=cuda)
        stream = torch.cuda.Stream(device) if cuda else None
        view = memoryview(buffer.numpy())
        with path.open("rb", buffering=0) as f:
            for chunk in chunks[first::workers]:
                if stream is not None:
                    stream.synchronize()  # the buffer's copies from the last chunk are done
                _read_exactly(f.fileno(), view[: chunk.end - chunk.start], chunk.start, path.name)
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    for dest, at, offset, length in chunk.pieces:
                        dest[at : at + length].copy_(buffer[offset : offset + length], non_blocking=cuda)
        if stream is not None:
            stream.synchronize()

    if workers == 1:
        work(0)
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="kev-read") as pool:
            for done in [pool.submit(work, i) for i in range(workers)]:
                done.result()
    return out


def _chunks(wanted: list[StoredTensor], out: dict[str, torch.Tensor], chunk_bytes: int) -> list[_Chunk]:
    """The wanted tensors' bytes in chunks of at most `chunk_bytes`: adjacent tensors share a chunk, a large one spans
    several, and bytes no wanted tensor holds (skipped tensors) are never read."""
    chunks: list[_Chunk] = []
    for t in wanted:
        dest = out[t.name].view(-1).view(torch.uint8)
        at = t.start
        while at < t.end:
            if not chunks or chunks[-1].end != at or chunks[-1].end - chunks[-1].start == chunk_bytes:
                chunks.append(_Chunk(at, at))
            chunk = chunks[-1]
            length = min(t.end - at, chunk_bytes - (chunk.end - chunk.start))
            chunk.pieces.append((dest, at - t.start, at - chunk.start, length))
            chunk.end += length
            at += length
    return chunks


def _read_exactly(fd: int, into: memoryview, offset: int, file: str) -> None:
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if n == 0:
            raise ValueError(f"{file}: the file ends before byte {offset + len(into)} its header names")
        done += n
