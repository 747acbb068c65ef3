#!/usr/bin/env bash
# The GPU benchmarks, on any Linux x86_64 host with an NVIDIA GPU and a copy of this tree:
#   bash bench/gpu.sh SUITE [--out DIR] [--wheelhouse DIR | --index | --installed] [--torch system|pip]
#                           [--commit REV] [ARG...]
# Run from the tree's root. Every suite installs the project first (`make setup`), writes its logs and JSON under
# --out (default /tmp/kev-bench) and prints a short table. The install source:
#   --wheelhouse DIR  offline, from a wheelhouse made on a connected machine (the default when .wheelhouse exists):
#                       make wheelhouse WHEELHOUSE_DIR=.wheelhouse WHEEL_PYTHON=3.12 WHEEL_TORCH=system \
#                         SETS="serve bench" WHEEL_HAVE=bench/gpu_host_packages.txt
#                     (WHEEL_HAVE: a `pip freeze` of the GPU host, so the wheelhouse holds only what it lacks;
#                     bench/gpu_host_packages.txt is the host the figures in docs/performance.md came from)
#   --index           from the package index (the host has network)
#   --installed       the tree's environment is set up already (`make setup` ran): nothing is installed
# --torch system (default): the host python's own torch and CUDA stack; pip: the project's pinned torch.
# --commit REV: the commit the results name (default: git's HEAD where the tree has its history, else "unknown").
# Suites (each script's header in bench/suites/ says more):
#   steps STEP...     GPU tests, parity, the bench and the diagnostics, by name (steps.sh lists them)
#   sizes SIZE...     every step of a Kev size on random weights of its shapes: write, tune, bench, parity, serve
#   serve [VARIANT]   `make serve` timed to ready and to its first answer, short6 over gRPC, SIGTERM
#   triton            tritonserver's starts on an empty and a kept kernel cache, gRPC against in process, open loop
#   batcher           the dynamic batcher's delay and instance count by measurement (INSTANCES, DELAYS)
#   fairness [STEP]   long work against short requests, served; `ab`: served short6 from a base tree and this one
#   hardening [MIN] [RPS]  a soak, the stub killed, shutdown time, shared memory left
#   scaleout [SECONDS]  one server per GPU behind the state-affinity router against one
#   ab [DIAG] [ROUNDS]  a diagnostic from a base tree and from this one, ABBA
#   base REV          (on a machine with the history) REV's tree into .ab/base for `ab` and `fairness ab`; copy
#                     .ab with the tree
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
suite=${1:-}
shift || true
if [[ $suite == base ]]; then
  rev=${1:?usage: bench/gpu.sh base REV}
  rm -rf .ab && mkdir -p .ab/base && git archive "$rev" | tar -x -C .ab/base || exit 1
  git rev-parse --short "$rev" >.ab/REV && echo "base $(cat .ab/REV) in .ab/base"
  exit 0
fi
[[ -n $suite && -f bench/suites/$suite.sh && $suite != lib ]] || {
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | cut -c3- >&2
  exit 2
}
OUT=/tmp/kev-bench INSTALL= TORCH_SOURCE=system COMMIT=
ARGS=()
while (($#)); do
  case $1 in
    --out) OUT=${2:?--out DIR}; shift 2 ;;
    --wheelhouse) INSTALL=wheelhouse:$(realpath "${2:?--wheelhouse DIR}"); shift 2 ;;
    --index) INSTALL=index; shift ;;
    --installed) INSTALL=installed; shift ;;
    --torch) TORCH_SOURCE=${2:?--torch system|pip}; shift 2 ;;
    --commit) COMMIT=${2:?--commit REV}; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
[[ $TORCH_SOURCE == system || $TORCH_SOURCE == pip ]] || { echo "--torch: system or pip, not $TORCH_SOURCE" >&2; exit 2; }
if [[ -z $INSTALL ]]; then
  if [[ -d .wheelhouse ]]; then INSTALL=wheelhouse:$PWD/.wheelhouse; else INSTALL=index; fi
fi
[[ -n $COMMIT ]] || COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
mkdir -p "$OUT" && OUT=$(realpath "$OUT")
export OUT INSTALL TORCH_SOURCE COMMIT
exec bash "bench/suites/$suite.sh" ${ARGS[@]+"${ARGS[@]}"}
