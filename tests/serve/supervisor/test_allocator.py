"""KEV_HOST_ALLOCATOR's choices as kev-serve applies them to its children's environment (the served default is
tested against the real processes in test_supervisor.py)."""

from __future__ import annotations

import pytest

from kev_backend.serve.supervisor import allocator
from kev_backend.settings import ServeSettings, SettingError


def test_jemalloc_is_preloaded_where_the_loader_finds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "find_library", {"jemalloc": "libjemalloc.so.2"}.get)
    env: dict[str, str] = {}
    assert allocator.use_host_allocator(env, "jemalloc") == "host allocator: jemalloc (libjemalloc.so.2)"
    assert env == {"LD_PRELOAD": "libjemalloc.so.2"}


def test_a_host_without_jemalloc_serves_on_glibc_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "find_library", lambda name: None)
    env: dict[str, str] = {}
    line = allocator.use_host_allocator(env, "jemalloc")
    assert line.startswith("WARNING: host allocator: glibc's malloc, jemalloc is not installed")
    assert "apt-get install libjemalloc2" in line
    assert env == {}


def test_glibc_by_choice_and_an_operators_preload_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "find_library", {"jemalloc": "libjemalloc.so.2"}.get)
    env: dict[str, str] = {}
    assert allocator.use_host_allocator(env, "glibc") == "host allocator: glibc's malloc (KEV_HOST_ALLOCATOR=glibc)"
    assert env == {}
    env = {"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}
    line = allocator.use_host_allocator(env, "jemalloc")
    assert line == "host allocator: as LD_PRELOAD gives (/usr/lib/libtcmalloc.so.4)"
    assert env == {"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}


def test_the_setting_takes_two_values() -> None:
    assert ServeSettings.read({}).host_allocator == "jemalloc"
    assert ServeSettings.read({"KEV_HOST_ALLOCATOR": " GLIBC "}).host_allocator == "glibc"
    with pytest.raises(SettingError, match="KEV_HOST_ALLOCATOR"):
        ServeSettings.read({"KEV_HOST_ALLOCATOR": "tcmalloc"})
