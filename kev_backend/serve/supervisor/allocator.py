"""The host memory allocator of the servers kev-serve starts: tritonserver (its Python stubs inherit it) and the
gateway.

The Python stub runs the engine's host work (and, on the CPU path, all of it) on many short-lived buffers of varying
size beside long-lived banked states. jemalloc is the default where the host has it: on an H100 it lifts the small
model's served rate by an eighth at 64 clients and costs nothing measured at 4B, and over an hour on the CPU path
glibc's cost per request drifts up against it (docs/performance.md, On an H100; docs/operations.md, the hour on both
allocators). kev-serve preloads it into its children; the supervisor itself keeps glibc's.
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
            "WARNING: host allocator: glibc's malloc, jemalloc is not installed. On glibc's malloc a small model "
            f"serves fewer requests/s on a GPU and its host time per request drifts up over hours ({INSTALL})"
        )
    env["LD_PRELOAD"] = library
    return f"host allocator: jemalloc ({library})"
