"""The requirement lines to install, from the project's requirement files, for an environment that brings its own
torch (TORCH=system: a GPU server's or an image's torch, with whatever it was built with).

    python build/requirements.py [--have FILE | --installed] REQUIREMENTS.txt...

Without options: every requirement line, one a project: a project named in several files takes the last file's
version (requirements-gpu.txt's torch, the measured GPU stack, over requirements.txt's CPU build) with the extras of
them all (tritonclient[grpc] and tritonclient[http] make tritonclient[grpc,http]).

`--installed` (run with the environment's own python): leaves out every project that is already installed outside
the environment's own site-packages (the system's, through the venv's system-torch.pth), whatever its version, and
torch's own stack (torch, triton, nvidia-*, cuda-*) always. `--have FILE`: the same against a `pip freeze` or `pip
list --format=freeze` of the target environment (for `make wheelhouse`), except numpy, which a wheelhouse always
holds: the tritonserver 2.51 Python stub needs numpy<2, which setup installs into the stub's own environment
(build/venv.sh) while the venv keeps the environment's numpy.

    python build/requirements.py --have FILE --prune DIR     (build/wheelhouse.sh, WHEEL_TORCH=system)

removes from the wheelhouse DIR every wheel of a project the target has, pulled in as a dependency of something it
lacks, unless a wheel there bounds that project's version from above (the target's may be newer: tritonclient's
ml-dtypes<=0.5.4); never numpy nor setuptools (the build backend, which pip installs in isolation from DIR).
"""

from __future__ import annotations

import argparse
import re
import sys
import sysconfig
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

ALWAYS_OURS = {"numpy"}
BUILD_BACKEND = "setuptools"
TORCH_STACK = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")


def name(line: str) -> str:
    return re.split(r"[\s\[(=<>!~;]", line.strip(), maxsplit=1)[0].lower().replace("_", "-").replace(".", "-")


EXTRAS = re.compile(r"^([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?(.*)$")


def merged(earlier: str, later: str) -> str:
    """One line for a project two files name: the later line's version and markers, the extras of both."""
    first, second = EXTRAS.match(earlier), EXTRAS.match(later)
    assert first is not None and second is not None
    extras = sorted({e.strip() for m in (first, second) for e in (m[2] or "").split(",") if e.strip()})
    return f"{second[1]}{'[' + ','.join(extras) + ']' if extras else ''}{second[3]}"


def installed_elsewhere() -> set[str]:
    """Projects installed on sys.path but not in this environment's own site-packages."""
    own = Path(sysconfig.get_paths()["purelib"]).resolve()
    found = set()
    for dist in metadata.distributions():
        location = Path(str(dist.locate_file(""))).resolve()
        if location != own:
            found.add(name(dist.metadata["Name"]))
    return found


def bounded_from_above(wheel: Path) -> set[str]:
    """The projects a wheel requires at an exact version or below a bound."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        requirements = Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
    return {name(spec) for spec in (r.split(";")[0] for r in requirements) if re.search(r"<|==|~=", spec)}


def prune(directory: Path, have: set[str]) -> None:
    wheels = {name(w.name.split("-")[0]): w for w in directory.glob("*.whl")}
    keep = ALWAYS_OURS | {BUILD_BACKEND}
    for wheel in wheels.values():
        keep |= bounded_from_above(wheel)
    for project, wheel in wheels.items():
        if project not in keep and (project in have or TORCH_STACK.match(project)):
            wheel.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--prune", type=Path, help="a wheelhouse to remove the target's own projects from")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--have", type=Path, help="a pip freeze of the target environment")
    source.add_argument("--installed", action="store_true", help="what this python has outside its own site")
    args = parser.parse_args()
    system = args.have is not None or args.installed
    have: set[str] = set()
    if args.have is not None:
        have = {name(line) for line in args.have.read_text().splitlines() if line.strip() and line[0] != "#"}
    elif args.installed:
        have = installed_elsewhere()
    if args.prune is not None:
        prune(args.prune, have)
    lines: dict[str, str] = {}  # by project, in the order first named
    for path in args.files:
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                project = name(line)
                lines[project] = merged(lines[project], line) if project in lines else line
    ours = ALWAYS_OURS if args.have is not None else set()
    for project, line in lines.items():
        if system and project not in ours and (TORCH_STACK.match(project) or project in have):
            print(f"# provided by the environment: {line}", file=sys.stderr)
            continue
        print(line)


if __name__ == "__main__":
    main()
