# Sourced by the GPU benchmark scripts with their arguments: takes `--out DIR`, `--wheelhouse DIR` and `--commit REV`
# out of them (exported as OUT, WHEELHOUSE and COMMIT; defaults /tmp/out, .wheelhouse and git's HEAD where the tree
# has its history, else "unknown") and leaves the others in ARGS. Defines device_setup and kev4b_checkpoint.
#   source "$(dirname "$0")/device_args.sh" "$@"
# The GPU machine has no network: every script installs the project as a user of an air-gapped GPU server does, with
# `make setup` from a wheelhouse made on a connected machine (its own python, torch and CUDA; the rest from there):
#   make wheelhouse WHEELHOUSE_DIR=.wheelhouse WHEEL_PYTHON=3.12 WHEEL_TORCH=system SETS="serve bench" \
#     WHEEL_HAVE=bench/gpu_machine.txt                 (bench/gpu_machine.txt: a `pip freeze` of the GPU machine)
OUT=${OUT:-/tmp/out}
WHEELHOUSE=${WHEELHOUSE:-.wheelhouse}
COMMIT=${COMMIT:-}
ARGS=()
while (($#)); do
  case $1 in
    --out) OUT=${2:?--out DIR}; shift 2 ;;
    --wheelhouse) WHEELHOUSE=${2:?--wheelhouse DIR}; shift 2 ;;
    --commit) COMMIT=${2:?--commit REV}; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
[[ -n $COMMIT ]] || COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
export OUT WHEELHOUSE COMMIT
mkdir -p "$OUT"

# device_setup: `make setup WHEELHOUSE=... TORCH=system SETS="serve bench"` (SETS in the environment: others) in
# this tree (its log in $OUT/setup.log), then PY (the project's python) and PYTHONUNBUFFERED are exported.
device_setup() {
  local begun=$SECONDS
  make setup WHEELHOUSE="$WHEELHOUSE" TORCH=system SETS="${SETS:-serve bench}" PYTHON=python3 >"$OUT/setup.log" 2>&1 || {
    tail -30 "$OUT/setup.log"; return 1; }
  export PY=$PWD/.venv/bin/python PYTHONUNBUFFERED=1
  echo "setup from the wheelhouse: $((SECONDS - begun)) s"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
}

# kev4b_checkpoint [DIR]: random weights of Kev-4B shapes in DIR (default /tmp/kev4b), drawn on the GPU, once;
# exports KEV4B=DIR/kev (the checkpoint).
kev4b_checkpoint() {
  local dir=${1:-/tmp/kev4b}
  [[ -d $dir/kev ]] || "$PY" -m kev_backend.dev.synthetic "$dir" --kev4b --device cuda >/dev/null || return 1
  export KEV4B=$dir/kev
}
