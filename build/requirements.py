"""The requirement lines to install, from the project's requirement files, for an environment that brings its own
torch (TORCH=system: a GPU server's or an image's torch, with whatever it was built with).

    python build/requirements.py [--have FILE | --installed] REQUIREMENTS.txt...

Without options: every requirement line, as written. `--installed` (run with the environment's own python): leaves
out every project that is already installed outside the environment's own site-packages (the system's, through the
venv's system-torch.pth), whatever its version, and torch's own stack (torch, triton, nvidia-*) always. `--have FILE`:
the same against a `pip freeze` or `pip list --format=freeze` of the target environment (for `make wheelhouse`).
numpy is never left out: the tritonserver 2.51 Python stub needs numpy<2, which the environment gets from us.
"""

from __future__ import annotations

import argparse
import re
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

ALWAYS_OURS = {"numpy"}
TORCH_STACK = re.compile(r"^(torch|triton|nvidia-.*)$")


def name(line: str) -> str:
    return re.split(r"[\s\[=<>!~;]", line.strip(), maxsplit=1)[0].lower().replace("_", "-").replace(".", "-")


def installed_elsewhere() -> set[str]:
    """Projects installed on sys.path but not in this environment's own site-packages."""
    own = Path(sysconfig.get_paths()["purelib"]).resolve()
    found = set()
    for dist in metadata.distributions():
        location = Path(str(dist.locate_file(""))).resolve()
        if location != own:
            found.add(name(dist.metadata["Name"]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
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
    for path in args.files:
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            project = name(line)
            if system and project not in ALWAYS_OURS and (TORCH_STACK.match(project) or project in have):
                print(f"# provided by the environment: {line}", file=sys.stderr)
                continue
            print(line)


if __name__ == "__main__":
    main()
