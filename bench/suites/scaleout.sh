#!/usr/bin/env bash
# One Kev server per GPU behind the state-affinity router (Envoy), measured against one
# server behind the same router (loadtest/scaleout.py): short6 throughput at 64 and 128 gRPC clients, the realistic
# mix with half its requests on states already sent (the bank's hit rate with affinity and without), and a server
# killed mid-run. Random Kev-4B weights are written first; the servers run the GPU configuration.
#   bash bench/gpu.sh scaleout [OPTIONS] [SECONDS (10)]                               (OPTIONS: bench/gpu.sh's)
# The router is the test set's Envoy, so setup installs the serve and test sets (SETS="serve test"; the test set
# brings the bench one): a wheelhouse for it is made as bench/gpu.sh says, with those sets. With one GPU only the baseline
# runs. Writes DIR/scaleout-1.json, DIR/scaleout-N.json and the comparison DIR/<date>-<gpu>-scaleout-<commit>.json
# with its plot (.png).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
seconds=${1:-10}
SETS="serve test" gpu_setup || exit 1
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
