"""The names a listing may give, and SHA256SUMS' grammar."""

from __future__ import annotations

import pytest

from kev_backend.serve.fill import sums
from kev_backend.serve.fill.names import UnsafeName, safe_name
from kev_backend.serve.fill.remote import FillError

SUM = "ab" * 32


@pytest.mark.parametrize("name", ["head.pt", "kev-4b/model-00001-of-00002.safetensors", ".gitattributes", "a b/c"])
def test_safe_names(name: str) -> None:
    assert safe_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "/etc/passwd", "..", "../x", "a/../../x", "a/./b", "a//b", "a/", "a\\..\\b", "a\0b", "a\nb",
     ".kev-fill.json", "kev/.head.pt.kev-fill-x1y2.part"],
)  # fmt: skip
def test_unsafe_names(name: str) -> None:
    with pytest.raises(UnsafeName):
        safe_name(name)


def test_sha256sums_as_sha256sum_writes_them() -> None:
    text = f"{SUM}  kev/head.pt\n{SUM.upper()} *./base/model.safetensors\n\n{SUM}  kev/head.pt\n"
    assert sums.parse(text) == {"kev/head.pt": SUM, "base/model.safetensors": SUM}


@pytest.mark.parametrize(
    "text",
    ["", f"{SUM} kev/head.pt", f"{SUM[:-1]}  x", f"{SUM}  x\n{'cd' * 32}  x", f"{SUM}  ../x", f"\\{SUM}  a\\\\b"],
)
def test_malformed_sha256sums_are_refused(text: str) -> None:
    with pytest.raises(FillError):
        sums.parse(text)
