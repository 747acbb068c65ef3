#!/usr/bin/env bash
# One call on the GPU machine: one Kev server per GPU behind the state-affinity router (Envoy), measured against one
# server behind the same router (loadtest/scaleout.py): short6 throughput at 64 and 128 gRPC clients, the realistic
# mix with half its requests on states already sent (the bank's hit rate with affinity and without), and a server
# killed mid-run. Random Kev-4B weights are written first; the servers run the GPU configuration.
#   bench/gpu_scaleout.sh [--out DIR] [--wheelhouse DIR] [--commit REV] [SECONDS (10)]
# The router is the test set's Envoy, so the wheelhouse holds the serve and test sets (SETS="serve test"; the test
# set brings the bench one): make it as bench/device_args.sh says with those sets. With one GPU only the baseline
# runs. Writes DIR/scaleout-1.json, DIR/scaleout-N.json and the comparison DIR/<date>-<gpu>-scaleout-<commit>.json
# with its plot (.png).
set -uo pipefail
source "$(dirname "$0")/device_args.sh" "$@"
seconds=${ARGS[0]:-10}
SETS="serve test" device_setup || exit 1
kev4b_checkpoint || exit 1
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
counts=(1)
((gpus > 1)) && counts+=("$gpus")
status=0
runs=()
for servers in "${counts[@]}"; do
  json=$OUT/scaleout-$servers.json
  timeout 400 "$PY" loadtest/scaleout.py run --checkpoint "$KEV4B" --servers "$servers" --seconds "$seconds" \
    --procs 8 --commit "$COMMIT" --out "$json" || status=1
  [[ -e $json ]] && runs+=("$json")
done
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-')
((${#runs[@]})) && "$PY" loadtest/scaleout.py report --out "$OUT/$(date -u +%F)-$gpu-scaleout-${COMMIT:0:7}.json" \
  "${runs[@]}" || status=1
exit $status
