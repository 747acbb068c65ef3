#!/usr/bin/env bash
# One call on the GPU machine, as a user of an air-gapped GPU server meets the project: a fresh copy of the tree, then
#   make serve WHEELHOUSE=DIR TORCH=system SETS=serve
# (the machine's own python, torch and CUDA; everything else from the wheelhouse, no network), timed from the
# command to readiness and to the first answer, then short6 over gRPC alone and at 64 clients (loadtest/served.py),
# then SIGTERM. The wheelhouse: bench/device_args.sh says how it is made; carry it.
#   bench/gpu_serve.sh [--out DIR] [--wheelhouse DIR (.wheelhouse)] [--commit REV] [VARIANT...]
# VARIANT: after the first run (as shipped), serve again with NAME=VALUE[,NAME=VALUE] in the environment (an empty
# VALUE unsets it; e.g. MALLOC_ARENA_MAX=), on the kernel cache the first run filled; "shipped" repeats the first.
# KEV_CHECKPOINT: the served checkpoint (default: random Kev-4B weights written here first, as the benchmarks use).
set -uo pipefail
source "$(dirname "$0")/device_args.sh" "$@"
wheelhouse=$(realpath "$WHEELHOUSE")
out=$OUT
mkdir -p "$out"
clone=$(mktemp -d /tmp/kev-clone.XXXXXX)
tar --exclude=./.wheelhouse --exclude=./.venv --exclude=./.stamps --exclude=./build/.tritonserver -cf - . \
  | tar -xf - -C "$clone"
cd "$clone" || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# `make serve` is setup then serve; they are timed apart because the benchmark's checkpoint (random Kev-4B weights,
# written with the environment setup installs) comes between them. A user's command is both: the two sums.
begun=$(date +%s.%N)
make setup WHEELHOUSE="$wheelhouse" TORCH=system SETS=serve PYTHON=python3 >"$out/setup.log" 2>&1 || {
  tail -30 "$out/setup.log"; exit 1; }
echo "setup (make setup WHEELHOUSE=... TORCH=system SETS=serve): $(python3 -c "import time; print(round(time.time() - $begun, 1))") s"
if [[ -z ${KEV_CHECKPOINT:-} ]]; then
  .venv/bin/python -m kev_backend.dev.synthetic /tmp/kev4b --kev4b --device cuda >/dev/null || exit 1
  export KEV_CHECKPOINT=/tmp/kev4b/kev
fi
status=0
serve_once() {  # LABEL [NAME=VALUE...]: make serve with that environment, measured, then SIGTERM
  local label=$1 started serve stopping
  shift
  started=$(python3 -c 'import time; print(time.time())')
  setsid env "$@" make serve WHEELHOUSE="$wheelhouse" TORCH=system SETS=serve PYTHON=python3 >"$out/serve-$label.log" 2>&1 &
  serve=$!
  .venv/bin/python loadtest/served.py --started "$started" --commit "$COMMIT" --out "$out/served-$label.json" \
    | sed "s/^/$label: /" || status=1
  stopping=$(python3 -c 'import time; print(time.time())')
  kill -TERM -- -$serve 2>/dev/null
  # The supervisor's own last line says when everything had stopped.
  while pgrep -f kev_backend.serve.supervisor >/dev/null; do sleep 0.1; done
  echo "$label: stopped $(python3 -c "import time; print(round(time.time() - $stopping, 1))") s after SIGTERM"
}
serve_once shipped
grep -E "kev-serve|kev: |WARNING|rror" "$out/serve-shipped.log" | cut -c1-300 | tail -8
for variant in ${ARGS[@]+"${ARGS[@]}"}; do
  [[ $variant == shipped ]] && { serve_once shipped-again; continue; }
  settings=()
  IFS=, read -ra pairs <<<"$variant"
  for pair in "${pairs[@]}"; do
    if [[ $pair == *= ]]; then settings+=(-u "${pair%=}"); else settings+=("$pair"); fi
  done
  serve_once "$(tr -c 'A-Za-z0-9_\n' _ <<<"$variant")" "${settings[@]}"
done
exit $status
