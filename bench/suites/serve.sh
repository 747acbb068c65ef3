#!/usr/bin/env bash
# As a user meets the project: a fresh copy of the tree, then `make serve` with the install source's arguments
# (bench/suites/lib.sh; with a wheelhouse: WHEELHOUSE=DIR TORCH=system SETS=serve, no network), timed from the
# command to readiness and to the first answer, then short6 over gRPC alone and at 64 clients (loadtest/served.py),
# then SIGTERM.
#   bash bench/gpu.sh serve [OPTIONS] [VARIANT...]                        (OPTIONS: bench/gpu.sh's)
# VARIANT: after the first run (as shipped), serve again with NAME=VALUE[,NAME=VALUE] in the environment (an empty
# VALUE unsets it; e.g. MALLOC_ARENA_MAX=), on the kernel cache the first run filled; "shipped" repeats the first;
# "added-pod" starts as a pod the autoscaler adds (deploy/components/kernel-cache): the installed tree, and a kernel
# cache in a directory of its own that other starts filled (a copy of the first runs' cache, as on the shared claim).
# KEV_CHECKPOINT: the served checkpoint (default: random Kev-4B weights written here first, as the benchmarks use).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
[[ $INSTALL != installed ]] || { echo "serve measures make serve from a fresh copy: give an install source"; exit 2; }
mapfile -t setup < <(setup_args)
out=$OUT
clone=$(mktemp -d /tmp/kev-clone.XXXXXX)
tar --exclude=./.wheelhouse --exclude=./.ab --exclude=./.venv --exclude=./.stamps --exclude=./build/.tritonserver -cf - . \
  | tar -xf - -C "$clone"
cd "$clone" || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# `make serve` is setup then serve; they are timed apart because the benchmark's checkpoint (random Kev-4B weights,
# written with the environment setup installs) comes between them. A user's command is both: the two sums.
begun=$(date +%s.%N)
make setup "${setup[@]}" SETS=serve >"$out/setup.log" 2>&1 || { tail -30 "$out/setup.log"; exit 1; }
echo "setup (make setup ${setup[*]} SETS=serve): $(python3 -c "import time; print(round(time.time() - $begun, 1))") s"
if [[ -z ${KEV_CHECKPOINT:-} ]]; then
  .venv/bin/python -m kev_backend.dev.synthetic /tmp/kev4b --kev4b --device cuda >/dev/null || exit 1
  export KEV_CHECKPOINT=/tmp/kev4b/kev
fi
status=0
serve_once() {  # LABEL [NAME=VALUE...]: make serve with that environment, measured, then SIGTERM
  local label=$1 started serve stopping
  shift
  started=$(python3 -c 'import time; print(time.time())')
  setsid env "$@" make serve "${setup[@]}" SETS=serve >"$out/serve-$label.log" 2>&1 &
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
for variant in "$@"; do
  [[ $variant == shipped ]] && { serve_once shipped-again; continue; }
  if [[ $variant == added-pod ]]; then
    rm -rf /tmp/kev-pod-cache && cp -a build/.triton-cache /tmp/kev-pod-cache || exit 1
    serve_once added-pod TRITON_CACHE_DIR=/tmp/kev-pod-cache
    continue
  fi
  settings=()
  IFS=, read -ra pairs <<<"$variant"
  for pair in "${pairs[@]}"; do
    if [[ $pair == *= ]]; then settings+=(-u "${pair%=}"); else settings+=("$pair"); fi
  done
  serve_once "$(tr -c 'A-Za-z0-9_\n' _ <<<"$variant")" "${settings[@]}"
done
exit $status
