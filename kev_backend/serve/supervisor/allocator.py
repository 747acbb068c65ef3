"""The host memory allocator of tritonserver and its children.

The Python stub runs the engine's host work (and, on the CPU path, all of it) on many short-lived buffers of varying
size. Under glibc's malloc an aged stub spends more and more of each request allocating (its heap fragments as the
state bank and the tokenizer cache fill and turn over); jemalloc keeps that cost flat (docs/operations.md, "The hour
at 5 requests/s"). kev-serve preloads it into its children where the host has it; tritonserver's children inherit
the preload.
"""

from __future__ import annotations

from ctypes.util import find_library

INSTALL = "Debian and Ubuntu: apt-get install libjemalloc2; RHEL and Fedora: dnf install jemalloc"


def use_host_allocator(env: dict[str, str], choice: str) -> str:
    """Set LD_PRELOAD in the children's environment `env` for `choice` (settings: KEV_HOST_ALLOCATOR); the start-up
    line that says what they allocate with. A preload the operator set is kept as it is."""
    if env.get("LD_PRELOAD"):
        return f"host allocator: as LD_PRELOAD gives ({env['LD_PRELOAD']})"
    if choice == "glibc":
        return "host allocator: glibc's malloc (KEV_HOST_ALLOCATOR=glibc)"
    library = find_library("jemalloc")  # the loader's cache: the soname, which LD_PRELOAD resolves like a link
    if library is None:
        return (
            "WARNING: host allocator: glibc's malloc, jemalloc is not installed. Over hours of traffic each request "
            f"costs more host CPU under glibc's malloc than under jemalloc ({INSTALL}; docs/operations.md)"
        )
    env["LD_PRELOAD"] = library
    return f"host allocator: jemalloc ({library})"
