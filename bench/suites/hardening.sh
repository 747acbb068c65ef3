#!/usr/bin/env bash
# `make serve`'s supervisor (build/serve.sh, which picks configs/gpu.pbtxt on a GPU host) with random Kev-4B weights,
# then bench/hardening.py: a soak, the Python stub killed and the time to answering again, the shutdown time and the
# shared-memory regions left. After setup (bench/suites/lib.sh). During the soak, six scrapes of Triton's and the
# gateway's /metrics, 20 s apart, into OUT/metrics/ (the dashboard's queries are checked against them by
# tests/deploy/test_monitoring.py, GPU series included).
#   bash bench/gpu.sh hardening [OPTIONS] [soak minutes (5)] [offered req/s (100)]     (OPTIONS: bench/gpu.sh's)
set -uo pipefail
source "$(dirname "$0")/lib.sh"
out=$OUT
gpu_setup || exit 1
kev4b_checkpoint || exit 1
KEV_CHECKPOINT=$KEV4B TRITON_CACHE_DIR=/tmp/triton-cache build/serve.sh > "$out/serve.log" 2>&1 &
serve=$!
(
  mkdir -p "$out/metrics"
  until curl -sf -o /dev/null http://127.0.0.1:8000/v2/health/ready; do sleep 1; done
  sleep 60
  for n in 1 2 3 4 5 6; do
    curl -sf http://127.0.0.1:8002/metrics > "$out/metrics/triton-$n.txt"
    curl -sf http://127.0.0.1:8009/metrics > "$out/metrics/gateway-$n.txt"
    sleep 20
  done
) &
scrapes=$!
"$PY" bench/hardening.py --serve-pid "$serve" --soak-minutes "${1:-5}" --rate "${2:-100}" --out "$out" --commit "$COMMIT"
status=$?
kill "$scrapes" "$serve" 2>/dev/null
grep -E "kev-serve|kev:" "$out/serve.log" | tail -12
exit $status
