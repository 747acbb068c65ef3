#!/usr/bin/env bash
# `make serve`'s supervisor (build/serve.sh, which picks configs/gpu.pbtxt on a GPU host) with random Kev-4B weights,
# then bench/hardening.py: a soak, the Python stub killed and the time to answering again, the shutdown time and the
# shared-memory regions left. After setup (bench/suites/lib.sh).
#   bash bench/gpu.sh hardening [OPTIONS] [soak minutes (5)] [offered req/s (100)]     (OPTIONS: bench/gpu.sh's)
set -uo pipefail
source "$(dirname "$0")/lib.sh"
out=$OUT
gpu_setup || exit 1
kev4b_checkpoint || exit 1
KEV_CHECKPOINT=$KEV4B TRITON_CACHE_DIR=/tmp/triton-cache build/serve.sh > "$out/serve.log" 2>&1 &
serve=$!
"$PY" bench/hardening.py --serve-pid "$serve" --soak-minutes "${1:-5}" --rate "${2:-100}" --out "$out" --commit "$COMMIT"
status=$?
kill "$serve" 2>/dev/null
grep -E "kev-serve|kev:" "$out/serve.log" | tail -12
exit $status
