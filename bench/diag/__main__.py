"""python -m bench.diag SUBCOMMAND: see bench/diag/__init__.py."""

from __future__ import annotations

import argparse
import sys

from . import __doc__ as summary
from . import gemm, gemm_epilogues, host, passes, startup, sweeps

FAMILIES = {
    "passes and latency": passes,
    "kernel sweeps": sweeps,
    "GEMMs": gemm,
    "GEMM epilogues": gemm_epilogues,
    "host path": host,
    "start-up": startup,
}


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(
        prog="python -m bench.diag",
        description=summary.split("\n\n")[0],
        epilog="Subcommands that build a Kev-4B engine take the GPU config's options by default (CUDA graphs, our "
        "long kernels); --no-graphs and --graph-max-tokens change them. bench/gpu.sh steps runs these "
        "as steps.",
    )
    sub = main.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)
    for family in FAMILIES.values():
        family.register(sub)
    return main


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
