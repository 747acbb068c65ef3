#!/usr/bin/env bash
# Triton's dynamic-batcher delay and model instances per GPU chosen by measurement. For each
# instance count in INSTANCES and max_queue_delay in DELAYS (µs; a delay named twice is measured twice, e.g. "500 0 0
# 500" for ABBA), a copy of the model repository with those settings in configs/gpu.pbtxt, the server started afresh
# (kernel cache kept), and loadtest/frontdoor.py over gRPC: short6 on new states, one client, then 64 and 128
# closed-loop clients over FRONTDOOR_PROCS (8) processes, with the server's breakdown. Writes batcher.json into the
# output directory ({"<run>-<instances>x<delay>": frontdoor.py's record}) and prints a line a run, after setup
# (bench/suites/lib.sh) and random Kev-4B weights. Each setting takes ~45 s once the first start has filled the kernel
# cache.
# LONG_STATES=1: the first setting's server also takes 8 new 16k-token states at once (loadtest/long_states.py,
# long-states.json).
#   INSTANCES="1 2" DELAYS="500" bash bench/gpu.sh batcher [OPTIONS]                  (OPTIONS: bench/gpu.sh's)
set -uo pipefail
source "$(dirname "$0")/lib.sh"
out=$OUT
gpu_setup || exit 1
kev4b_checkpoint || exit 1
rm -f /tmp/batcher-*.json  # an earlier run's
run=0
for instances in ${INSTANCES:-1}; do
for delay in ${DELAYS:-0 500 2000}; do
  run=$((run + 1))
  setting=${instances}x$delay
  repo=/tmp/repo-$setting
  rm -rf "$repo" && mkdir -p "$repo" && cp -r model_repository/kev "$repo/kev" && rm -rf "$repo/kev/embedded"
  "$PY" bench/batcher_config.py "$repo/kev/configs/gpu.pbtxt" "$delay" "$instances" || exit 1
  start_triton "$repo" "/tmp/tritonserver-$setting.log"
  wait_ready "/tmp/start-$setting.json" "/tmp/tritonserver-$setting.log" \
    || { kill $server; tail -20 "/tmp/tritonserver-$setting.log"; exit 1; }
  "$PY" loadtest/frontdoor.py --metrics 127.0.0.1:8002 --alone 200 --seconds 6 --procs "${FRONTDOOR_PROCS:-8}" \
    --model kev-4b-shapes --commit "$COMMIT" --out "/tmp/batcher-$run-$setting.json" >"/tmp/batcher-$run.log" \
    || tail -5 "/tmp/batcher-$run.log"
  if ((run == 1)) && [[ -n ${LONG_STATES:-} ]]; then  # the first server also takes 8 new 16k-token states at once
    timeout 150 "$PY" loadtest/long_states.py --tokenizer "$(dirname "$KEV4B")/base" --tokens 16384 --concurrent 8 \
      --alone 2 --rounds 2 --commit "$COMMIT" --out "$out/long-states.json" | tail -2
    grep -E "RESTART|Signal" "/tmp/tritonserver-$setting.log" || echo "long states: no restart, no signal"
  fi
  kill $server
  wait $server
done
done
"$PY" - "$out/batcher.json" /tmp/batcher-*.json <<'PY'
import json, sys
from pathlib import Path
runs = {Path(name).stem.removeprefix("batcher-"): json.loads(Path(name).read_text()) for name in sys.argv[2:]}
Path(sys.argv[1]).write_text(json.dumps(runs, indent=1) + "\n")
for name, run in sorted(runs.items(), key=lambda item: int(item[0].split("-")[0])):
    grpc, levels = run["grpc"], run["grpc"]["levels"]
    alone = grpc["one_client_server"]
    print(name, f"one client {grpc['one_client_p50_ms']:.2f} ms (blocking {grpc['one_client_blocking_p50_ms']:.2f};",
          f"server: queue {alone['queue_ms']:.2f}, execute {alone['compute_infer_ms']:.2f},",
          f"engine {alone['engine_ms_per_batch']:.2f}),",
          ", ".join(f"{n} clients {level['rps']:.1f} req/s (batch {level['server']['mean_batch']:.1f})"
                    for n, level in levels.items()))
PY
