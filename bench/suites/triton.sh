#!/usr/bin/env bash
# The real tritonserver 2.51 with the Kev model on random Kev-4B weights, after setup (bench/suites/lib.sh). Writes
# logs and JSON under the output directory.
#   bash bench/gpu.sh triton [OPTIONS] [short6 open-loop rates] [mix open-loop rates]   (OPTIONS: bench/gpu.sh's)
# Measures: the bench in-process with graphs on, then tritonserver with configs/gpu.pbtxt (KIND_GPU, graphs on): time
# to ready and to the first answer with an empty kernel cache and again with the cache the first start filled, each
# with its start-up phases (added to the bench JSON); gRPC (loadtest/frontdoor.py) against the bench's
# in-process figures; open-loop sweeps for short6 and the realistic mix; Triton's and our metrics. About 5.5 minutes.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
out=$OUT
gpu_setup || exit 1
kev4b_checkpoint || exit 1
# The engine alone first (the bench in this process, graphs on, nothing else on the GPU), then the server: never both
# at once. The bench JSON gets the start times (below) and is the in-process reference.
# STARTUP_ONLY=1: only the two starts below (~2.5 minutes), their times in $out/triton-startup.json.
if [[ ${STARTUP_ONLY:-0} != 1 ]]; then
  timeout 240 "$PY" -m kev_backend.dev.bench --checkpoint "$KEV4B" --no-baseline --commit "$COMMIT" \
    --seconds "${BENCH_SECONDS:-3}" --out "$out" 2>&1 | tail -4
  bench_json=$(ls -t "$out"/2[0-9][0-9][0-9]-*.json 2>/dev/null | head -1)
  [[ -n $bench_json ]] || { echo "no bench JSON"; exit 1; }
fi
# First start: an empty kernel cache (a fresh container). Second: the cache the first filled (Triton's compiled
# kernels and autotuning results), as a restarted or redeployed server with a kept TRITON_CACHE_DIR sees it. An
# earlier run's cache is emptied first.
rm -rf /tmp/triton-cache
start_triton "$PWD/model_repository" /tmp/first-start.log
wait_ready /tmp/start.json /tmp/first-start.log
kill $server
wait $server
[[ -s /tmp/start.json ]] || { tail -40 /tmp/first-start.log; exit 1; }
start_triton "$PWD/model_repository" "$out/tritonserver.log"
wait_ready /tmp/restart.json "$out/tritonserver.log" cached_
[[ -s /tmp/restart.json ]] || { kill $server; tail -40 "$out/tritonserver.log"; exit 1; }
if [[ ${STARTUP_ONLY:-0} == 1 ]]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  echo "{\"gpu\": \"$gpu\", \"commit\": \"$COMMIT\", \"date\": \"$(date -u +%FT%TZ)\"}" \
    > "$out/triton-startup.json"
  "$PY" bench/merge_json.py "$out/triton-startup.json" /tmp/start.json /tmp/restart.json
  kill $server
  wait $server
  exit 0
fi
"$PY" bench/merge_json.py "$bench_json" /tmp/start.json /tmp/restart.json
"$PY" loadtest/frontdoor.py --inprocess "$bench_json" --procs 8 --commit "$COMMIT" --seconds 10 \
  --out "$out/triton-$(date +%F).json"
"$PY" bench/merge_json.py "$out/triton-$(date +%F).json" /tmp/start.json /tmp/restart.json
"$PY" loadtest/openloop.py --rates "${1:-50,100,200,300}" --seconds 8 --shape short6 --out "$out/openloop-short6"
"$PY" loadtest/openloop.py --rates "${2:-20,40,80,120}" --seconds 8 --shape mix --out "$out/openloop-mix"
curl -s 127.0.0.1:8002/metrics | grep -E "^kev_|^nv_inference_(count|exec_count|queue_duration)" > "$out/metrics.txt"
kill $server
wait $server
tail -5 "$out/tritonserver.log"
# The image sets PYTHONDONTWRITEBYTECODE=1, so every start above compiled from source what it imports that has no
# bytecode beside it (a deployment image ships bytecode). Two more starts on the kept kernel cache with bytecode cached under a prefix: the
# first writes it, the second is a restart as a deployed server sees it.
for run in write kept; do
  START_ENV="PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONDONTWRITEBYTECODE=" start_triton "$PWD/model_repository" /tmp/bc.log
  wait_ready "/tmp/bytecode-$run.json" /tmp/bc.log bytecode_
  kill $server
  wait $server
done
"$PY" bench/merge_json.py "$bench_json" /tmp/bytecode-kept.json
cat /tmp/bytecode-*.json
