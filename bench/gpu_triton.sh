#!/usr/bin/env bash
# One device call: the real tritonserver 2.51 on the GPU machine with the Kev model on random Kev-4B weights
# (setup: bench/gpu_triton_env.sh; carry .whl and .gpu). Writes logs and JSON under $OUT.
#   bench/gpu_triton.sh [short6 open-loop rates] [mix open-loop rates]
# Measures (issue 6, and issue 4's start times): the engine in-process, then tritonserver with configs/gpu.pbtxt
# (KIND_GPU, graphs on): time to ready and to the first answer with an empty kernel cache and again with the cache the
# first start filled, each with its start-up phases; gRPC and HTTP at 64 closed-loop clients, open-loop
# sweeps for short6 and the realistic mix, Triton's and our metrics. Files under $OUT (at most 8 come back).
set -uo pipefail
source "$(dirname "$0")/gpu_triton_env.sh"
# The engine alone first (in this process, nothing else on the GPU), then the server: never both at once.
python3 loadtest/closedloop.py inprocess --checkpoint /tmp/kev4b/kev --graphs --out /tmp/inprocess.json || exit 1
# First start: an empty kernel cache (a fresh container). Second: the cache the first filled (Triton's compiled
# kernels and autotuning results), as a restarted or redeployed server with a kept TRITON_CACHE_DIR sees it.
start_triton "$PWD/model_repository" /tmp/first-start.log
wait_ready /tmp/start.json /tmp/first-start.log
kill $server
wait $server
[[ -s /tmp/start.json ]] || { tail -40 /tmp/first-start.log; exit 1; }
start_triton "$PWD/model_repository" "$out/tritonserver.log"
wait_ready /tmp/restart.json "$out/tritonserver.log" cached_
[[ -s /tmp/restart.json ]] || { kill $server; tail -40 "$out/tritonserver.log"; exit 1; }
python3 loadtest/closedloop.py triton --inprocess /tmp/inprocess.json --extra /tmp/start.json \
  --extra /tmp/restart.json --out "$out/triton-$(date +%F).json"
python3 loadtest/openloop.py --rates "${1:-50,100,200,300,400}" --seconds 10 --shape short6 --out "$out/openloop-short6"
python3 loadtest/openloop.py --rates "${2:-10,20,40,80}" --seconds 10 --shape mix --out "$out/openloop-mix"
curl -s 127.0.0.1:8002/metrics | grep -E "^kev_|^nv_inference_(count|exec_count|queue_duration)" > "$out/metrics.txt"
kill $server
wait $server
tail -5 "$out/tritonserver.log"
