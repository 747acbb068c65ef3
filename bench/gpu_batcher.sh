#!/usr/bin/env bash
# One device call: Triton's dynamic-batcher delay chosen by measurement (issue 6). For each max_queue_delay in
# DELAYS (µs), a copy of the model repository with that delay in configs/gpu.pbtxt, the server started afresh, and
# short6 on new states through gRPC at 1, 8 and 64 closed-loop clients. Writes $OUT/batcher.json
# ({delay: {clients: {rps, p50_ms, p99_ms}}}). Setup: bench/gpu_triton_env.sh (carry .whl and .gpu).
#   DELAYS="0 500 2000" bench/gpu_batcher.sh
set -uo pipefail
source "$(dirname "$0")/gpu_triton_env.sh"
echo '{}' > /tmp/batcher.json
for delay in ${DELAYS:-0 500 2000}; do
  repo=/tmp/repo-$delay
  rm -rf "$repo" && mkdir -p "$repo" && cp -r model_repository/kev "$repo/kev" && rm -rf "$repo/kev/embedded"
  python3 bench/set_queue_delay.py "$repo/kev/configs/gpu.pbtxt" "$delay" || exit 1
  start_triton "$repo" "/tmp/tritonserver-$delay.log"
  wait_ready "/tmp/start-$delay.json" "/tmp/tritonserver-$delay.log" || { kill $server; tail -20 "/tmp/tritonserver-$delay.log"; exit 1; }
  python3 - "$delay" <<'PY'
import asyncio, json, sys
sys.path.insert(0, "loadtest")
from loops import closed_loop
from kev_backend.client import AsyncKevClient

async def main() -> dict:
    async with AsyncKevClient("127.0.0.1:8001", "grpc") as kev:
        async def send(body: str) -> None:
            await kev.score_raw(body)
        levels = {}
        for clients in (1, 8, 64):
            await closed_loop(send, clients, 2.0)
            levels[str(clients)] = await closed_loop(send, clients, 8.0)
        return levels

delay = sys.argv[1]
record = json.load(open("/tmp/batcher.json"))
record[delay] = asyncio.run(main())
json.dump(record, open("/tmp/batcher.json", "w"), indent=2)
print(delay, {c: (round(r["rps"], 1), round(r["p50_ms"], 2)) for c, r in record[delay].items()})
PY
  kill $server
  wait $server
done
cp /tmp/batcher.json "$out/batcher.json"
