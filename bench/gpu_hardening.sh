#!/usr/bin/env bash
# One device call: `make serve`'s supervisor (build/serve.sh, which picks configs/gpu.pbtxt on a GPU machine) with
# random Kev-4B weights, then bench/hardening.py: a soak, the Python stub killed and the time to answering again, the
# shutdown time and the shared-memory regions left. Setup from the carried wheelhouse (bench/device_args.sh).
#   bench/gpu_hardening.sh [--out DIR] [--wheelhouse DIR] [--commit REV] [soak minutes (5)] [offered req/s (100)]
set -uo pipefail
source "$(dirname "$0")/device_args.sh" "$@"
set -- ${ARGS[@]+"${ARGS[@]}"}
out=$OUT
device_setup || exit 1
kev4b_checkpoint || exit 1
KEV_CHECKPOINT=$KEV4B TRITON_CACHE_DIR=/tmp/triton-cache build/serve.sh > "$out/serve.log" 2>&1 &
serve=$!
"$PY" bench/hardening.py --serve-pid "$serve" --soak-minutes "${1:-5}" --rate "${2:-100}" --out "$out" --commit "$COMMIT"
status=$?
kill "$serve" 2>/dev/null
grep -E "kev-serve|kev:" "$out/serve.log" | tail -12
exit $status
