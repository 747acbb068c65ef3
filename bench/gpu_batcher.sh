#!/usr/bin/env bash
# One device call: Triton's dynamic-batcher delay and model instances per GPU chosen by measurement. For each
# instance count in INSTANCES and max_queue_delay in DELAYS (µs), a copy of the model repository with those settings in
# configs/gpu.pbtxt, the server started afresh (kernel cache kept), and short6 on new states through gRPC at 1, 8 and
# 64 closed-loop clients with the server's breakdown (loadtest/loops.py). Writes batcher.json into the output directory
# ({"<instances>x<delay>": {clients: {rps, p50_ms, p99_ms, server}}}). Setup: bench/gpu_triton_env.sh (carry the
# wheelhouse). Each setting takes ~50 s once the first start has filled the kernel cache.
#   INSTANCES="1 2" DELAYS="500" bench/gpu_batcher.sh [--out DIR] [--wheelhouse DIR] [--commit REV]
# --out, --wheelhouse, --commit: as bench/gpu_run.sh.
set -uo pipefail
source "$(dirname "$0")/device_args.sh" "$@"
set -- ${ARGS[@]+"${ARGS[@]}"}
source "$(dirname "$0")/gpu_triton_env.sh"
echo '{}' > /tmp/batcher.json
for instances in ${INSTANCES:-1}; do
for delay in ${DELAYS:-0 500 2000}; do
  setting=${instances}x$delay
  repo=/tmp/repo-$setting
  rm -rf "$repo" && mkdir -p "$repo" && cp -r model_repository/kev "$repo/kev" && rm -rf "$repo/kev/embedded"
  "$PY" bench/batcher_config.py "$repo/kev/configs/gpu.pbtxt" "$delay" "$instances" || exit 1
  start_triton "$repo" "/tmp/tritonserver-$setting.log"
  wait_ready "/tmp/start-$setting.json" "/tmp/tritonserver-$setting.log" \
    || { kill $server; tail -20 "/tmp/tritonserver-$setting.log"; exit 1; }
  "$PY" - "$setting" <<'PY'
import asyncio, json, sys
sys.path.insert(0, "loadtest")
from loops import measured_loop
from kev_backend.serve.client import AsyncKevClient

async def main() -> dict:
    async with AsyncKevClient("127.0.0.1:8001", "grpc") as kev:
        async def send(body: str) -> None:
            await kev.score_raw(body)
        return {
            str(clients): await measured_loop(send, clients, 8.0, "127.0.0.1:8001", "127.0.0.1:8002")
            for clients in (1, 8, 64)
        }

setting = sys.argv[1]
record = json.load(open("/tmp/batcher.json"))
record[setting] = asyncio.run(main())
json.dump(record, open("/tmp/batcher.json", "w"), indent=2)
print(setting, {c: (round(r["rps"], 1), round(r["p50_ms"], 2), r["server"]["mean_batch"]) for c, r in record[setting].items()})
PY
  kill $server
  wait $server
done
done
cp /tmp/batcher.json "$out/batcher.json"
