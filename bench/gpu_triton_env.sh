# Sourced, after bench/device_args.sh, by the device scripts that run the real tritonserver on the GPU machine
# (bench/gpu_triton.sh, bench/gpu_batcher.sh): `make setup` from the wheelhouse (device_setup), random Kev-4B weights
# in /tmp/kev4b. Defines start_triton and wait_ready; $out is the output directory.
out=$OUT
device_setup || exit 1
kev4b_checkpoint || exit 1

# start_triton REPOSITORY LOG: tritonserver with configs/gpu.pbtxt (KIND_GPU, graphs on) in the background; sets
# $server (its pid) and $started (its start time). START_ENV: more NAME=VALUE settings for the server.
start_triton() {
  started=$(date +%s.%N)
  KEV_CHECKPOINT=$KEV4B TRITON_CACHE_DIR=/tmp/triton-cache TRITON_CACHE_AUTOTUNING=1 env ${START_ENV:-} \
    build/tritonserver.sh --model-repository="$1" --model-config-name=gpu --model-control-mode=none \
    --http-port 8000 --grpc-port 8001 --metrics-port 8002 > "$2" 2>&1 &
  server=$!
}

# wait_ready OUT_JSON LOG [PREFIX]: waits for readiness, sends one short6, writes {"<PREFIX>ready_s",
# "<PREFIX>first_answer_s", "<PREFIX>startup_phases"} from $started and the model's start-up line in LOG.
wait_ready() {
  "$PY" - "$started" "$1" "$2" "${3:-}" <<'PY'
import json, re, sys, time, urllib.request
from kev_backend.serve.client import KevClient
from kev_backend.dev.workloads import short6
started, out, log, prefix = float(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
while True:
    try:
        if urllib.request.urlopen("http://127.0.0.1:8000/v2/health/ready", timeout=1).status == 200:
            break
    except OSError:
        time.sleep(0.2)
    if time.time() - started > 300:
        sys.exit("not ready after 300 s")
ready = time.time() - started
with KevClient("127.0.0.1:8001") as kev:
    kev.score(short6(1))
    first = time.time() - started
line = re.search(r"start-up seconds ([^\"]*)", open(log).read())
phases = dict((name, float(value)) for name, value in re.findall(r"(\w+) ([\d.]+)", line[1])) if line else {}
record = {f"{prefix}ready_s": ready, f"{prefix}first_answer_s": first, f"{prefix}startup_phases": phases}
print(json.dumps(record))
open(out, "w").write(json.dumps(record) + "\n")
PY
}
