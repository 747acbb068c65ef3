"""SHA256SUMS: the manifest that vouches for every object of an S3 prefix.

The format `sha256sum` writes and `sha256sum -c` reads: `<64 hex>  <name>` (or `<hex> *<name>`, binary mode), names
relative to the prefix; a leading `./` (from `sha256sum ./x`) is dropped. A line in any other shape, a name twice
with two digests or an unsafe name refuses the whole manifest: a manifest that is half understood vouches for nothing.
"""

from __future__ import annotations

import re

from .names import UnsafeName, safe_name
from .remote import FillError

NAME = "SHA256SUMS"
_LINE = re.compile(r"([0-9a-fA-F]{64}) [ *](.+)")


def parse(text: str, where: str = NAME) -> dict[str, str]:
    """name -> lower-case sha256 hex."""
    sums: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _LINE.fullmatch(line)
        if not match:
            raise FillError(f"{where}:{number}: not a `<sha256>  <name>` line: {line[:120]!r}")
        digest, name = match.group(1).lower(), match.group(2)
        name = name[2:] if name.startswith("./") else name
        try:
            safe_name(name)
        except UnsafeName as error:
            raise FillError(f"{where}:{number}: refused: {error}") from None
        if sums.setdefault(name, digest) != digest:
            raise FillError(f"{where}:{number}: {name} listed twice with different digests")
    if not sums:
        raise FillError(f"{where}: lists no file")
    return sums
