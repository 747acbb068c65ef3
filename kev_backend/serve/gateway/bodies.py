"""Request bodies at the gateway: read as they stream within the byte limits and the front's deadlines, decoded from
zstd or gzip a chunk at a time, and parsed as Starlette would read them.

- A body is refused with 413 once it passes its limit (at once when its Content-Length says so); nothing past the
  limit is kept. Every byte kept is counted against the gateway's bytes arriving (`reserve`), so what bodies not yet
  admitted hold is bounded however many connections send them.
- A zstd or gzip body is decompressed a chunk at a time and refused with 413 once its output passes the decoded
  limit, on a worker thread when it is large; corrupt data is a 400, an encoding not served a 415.
- A body that stops arriving, or takes too long in all, is refused with 408 by the front's deadline (front.py), which
  wakes the reader: the check is in the one loop that reads bodies, so no reader can miss it.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable, Iterator

from starlette.requests import Request

from .front import body_clock
from .replies import CLIENT_CLOSED, Refused

try:
    from backports.zstd import ZstdDecompressor, ZstdError
except ImportError:  # Python 3.14+
    from compression.zstd import ZstdDecompressor, ZstdError  # type: ignore[import-not-found, no-redef]

DRAIN_FACTOR = 4  # a body up to this many times the limit is read (and dropped) before its 413: see read_body
OFFLOAD_BYTES = 64 << 10  # bodies over this decompress, and are parsed, on a worker thread, off the event loop
# A decompressor is fed DECODE_IN bytes at a time (what a frame leaves over, its `unused_data`, is a copy of at most
# that) and asked for at most DECODE_OUT bytes a call (a bomb's output stops within DECODE_OUT of the limit).
DECODE_IN = 16 << 10
DECODE_OUT = 256 << 10
MAX_FRAMES = 100  # zstd frames or gzip members in one body: each costs a new decompressor; clients send one


class CorruptBody(ValueError):
    """Compressed data that ends before its frame or member does."""


async def read_body(request: Request, limit: int, reserve: Callable[[int], None]) -> bytes:
    """The body as sent, refused with 413 once it is known to be over `limit` bytes. Nothing past the limit is kept,
    and `reserve(n)` is told how many bytes are held (at once the Content-Length's, within the limit), which refuses
    the request when the gateway's bytes arriving are full. A body up to DRAIN_FACTOR times the limit is read to its
    end (and dropped) first, so its client, still sending, reads the 413 rather than a reset connection; a larger
    one is refused at once (from its Content-Length, or once that much has arrived) and the server discards the rest
    of the upload, within the front's body deadlines."""
    declared = request.headers.get("content-length", "")
    drain = limit * DRAIN_FACTOR
    if declared.isdigit() and int(declared) > drain:
        raise too_large(f"request body is {int(declared):,} bytes, over the {limit:,}-byte limit")
    if declared.isdigit():
        reserve(min(int(declared), limit))
    clock = body_clock(request.scope)
    body, seen = bytearray(), 0
    while True:
        message = await request.receive()
        if clock is not None and clock.expired is not None:
            raise Refused(408, "timeout", clock.expired)
        if message["type"] == "http.disconnect":
            raise client_gone()
        chunk = message.get("body", b"")
        seen += len(chunk)
        if seen <= limit:
            reserve(seen)
            body += chunk
        elif seen > drain:
            break
        if not message.get("more_body", False):
            break
    if seen > limit:
        size = f"{seen:,} bytes" if seen <= drain else f"over {drain:,} bytes"
        raise too_large(f"request body is {size}, over the {limit:,}-byte limit")
    return bytes(body)


def too_large(message: str) -> Refused:
    return Refused(413, "too_large", message)


def client_gone() -> Refused:
    return Refused(CLIENT_CLOSED, "client_disconnected", "the client closed the connection")


async def decode_body(raw: bytes, encoding: str, limit: int) -> bytes:
    """`raw` decompressed per its Content-Encoding: on a worker thread when it is large, so a big body does not stall
    every other client. The output is bounded whatever the ratio: see `decompress`."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in DECODERS:
        raise Refused(415, "unsupported_encoding", f"unsupported content-encoding {encoding!r}: use zstd or gzip")
    if len(raw) > OFFLOAD_BYTES:
        return await asyncio.to_thread(decompress, raw, encoding, limit)
    return decompress(raw, encoding, limit)


def decompress(raw: bytes, encoding: str, limit: int) -> bytes:
    """`raw` decoded, refused with 413 once the output passes `limit` bytes (a bomb costs at most `limit` +
    DECODE_OUT bytes) and with 400 when it is not valid data."""
    out = bytearray()
    try:
        for chunk in DECODERS[encoding](raw):
            out += chunk
            if len(out) > limit:
                raise too_large(f"the {encoding} body decodes to over the {limit:,}-byte limit")
    except (ZstdError, zlib.error, CorruptBody) as error:
        raise Refused(400, "bad_encoding", f"could not decode the {encoding} body: {error}") from None
    return bytes(out)


def zstd_chunks(raw: bytes) -> Iterator[bytes]:
    """Decoded zstd, frame after frame as `zstd.decompress` reads them (at most MAX_FRAMES)."""
    view, pending = memoryview(raw), b""
    for _ in range(MAX_FRAMES):
        if not pending and not view:
            return
        frame = ZstdDecompressor()
        while not frame.eof:
            if frame.needs_input:
                if not pending:
                    pending, view = bytes(view[:DECODE_IN]), view[DECODE_IN:]
                if not pending:
                    raise CorruptBody("the data ends inside a frame")
                chunk, pending = frame.decompress(pending, DECODE_OUT), b""
            else:  # more output is waiting on the input already given
                chunk = frame.decompress(b"", DECODE_OUT)
            yield chunk
        pending = frame.unused_data  # the rest of the last slice: the next frame's start
    if pending or view:
        raise CorruptBody(f"more than {MAX_FRAMES} frames")


def gzip_chunks(raw: bytes) -> Iterator[bytes]:
    """Decoded gzip, member after member as `gzip.decompress` reads them (at most MAX_FRAMES)."""
    view, pending = memoryview(raw), b""
    for _ in range(MAX_FRAMES):
        if not pending and not view:
            return
        member = zlib.decompressobj(wbits=31)  # 31: a gzip header and trailer around deflate data
        while not member.eof:
            if not pending:
                pending, view = bytes(view[:DECODE_IN]), view[DECODE_IN:]
            chunk = member.decompress(pending, DECODE_OUT)
            if not chunk and not pending:  # no input left and no output pending
                raise CorruptBody("the data ends inside a member")
            pending = member.unconsumed_tail  # input held back because the output reached DECODE_OUT
            yield chunk
        pending = member.unused_data  # the rest of the last slice: the next member's start
    if pending or view:
        raise CorruptBody(f"more than {MAX_FRAMES} members")


DECODERS: dict[str, Callable[[bytes], Iterator[bytes]]] = {"zstd": zstd_chunks, "gzip": gzip_chunks}
