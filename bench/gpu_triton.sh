#!/usr/bin/env bash
# One device call: the real tritonserver 2.51 on the GPU machine with the Kev model on random Kev-4B weights, by
# the recipe of ../shared/docs/triton.md §0.1 (a venv with numpy 1.26 over the image's torch; the 3.12 stub).
# Carry .whl (build/gpu_wheels.sh) and .gpu (build/gpu_bundle.sh). Writes logs and JSON under $OUT.
#   bench/gpu_triton.sh [short6 open-loop rates] [mix open-loop rates]
# Measures (issue 6, and issue 4's start times): the engine in-process, then tritonserver with configs/gpu.pbtxt
# (KIND_GPU, graphs on): time to ready and to the first answer, gRPC and HTTP at 64 closed-loop clients, open-loop
# sweeps for short6 and the realistic mix, Triton's and our metrics. Files under $OUT (at most 8 come back).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  .gpu/wheels/tritonclient-*.whl .gpu/wheels/python_rapidjson-*.whl .gpu/wheels/jevbench-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# The stub's environment: numpy 1.26 first, then our wheels, the project and the image's torch (a .pth file: the
# stub ignores PYTHONPATH).
python3 -m venv /tmp/kv
/tmp/kv/bin/python -m pip install -q --no-index --no-deps .gpu/wheels/numpy-1.26.4-*.whl || exit 1
site=$(/tmp/kv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
image=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
printf '%s\n' /tmp/site "$PWD" "$image" > "$site/kev.pth"
/tmp/kv/bin/python -c 'import numpy, torch, fla; print("stub env: numpy", numpy.__version__, "torch", torch.__version__,
"cuda", torch.cuda.is_available())' || exit 1
mkdir -p /tmp/ts /tmp/B/python
tar -xJf .gpu/tritonserver-py312.tar.xz -C /tmp/ts
cp /tmp/ts/pytriton/tritonserver/backends/python/* /tmp/ts/pytriton/tritonserver/python_backend_stubs/3.12/* /tmp/B/python/
python3 -m kev_backend.tiny /tmp/kev4b --kev4b --device cuda || exit 1
# The engine alone first (in this process, nothing else on the GPU), then the server: never both at once.
python3 loadtest/closedloop.py inprocess --checkpoint /tmp/kev4b/kev --graphs --out /tmp/inprocess.json || exit 1
started=$(date +%s.%N)
LD_LIBRARY_PATH=/tmp/ts/nvidia_pytriton.libs PATH=/tmp/kv/bin:$PATH KEV_CHECKPOINT=/tmp/kev4b/kev \
  TRITON_CACHE_DIR=/tmp/triton-cache /tmp/ts/pytriton/tritonserver/bin/tritonserver \
  --model-repository="$PWD/model_repository" --model-config-name=gpu --backend-directory=/tmp/B \
  --model-control-mode=none --http-port 8000 --grpc-port 8001 --metrics-port 8002 > "$out/tritonserver.log" 2>&1 &
server=$!
python3 - "$started" /tmp/start.json <<'PY'
import json, sys, time, urllib.request
from kev_backend.client import KevClient
from kev_backend.workloads import short6
started, out = float(sys.argv[1]), sys.argv[2]
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
record = {"ready_s": ready, "first_answer_s": first}
print(json.dumps(record))
open(out, "w").write(json.dumps(record) + "\n")
PY
[[ -s /tmp/start.json ]] || { kill $server; tail -40 "$out/tritonserver.log"; exit 1; }
python3 loadtest/closedloop.py triton --inprocess /tmp/inprocess.json --extra /tmp/start.json \
  --out "$out/triton-$(date +%F).json"
python3 loadtest/openloop.py --rates "${1:-50,100,200,300,400}" --seconds 10 --shape short6 --out "$out/openloop-short6"
python3 loadtest/openloop.py --rates "${2:-10,20,40,80}" --seconds 10 --shape mix --out "$out/openloop-mix"
curl -s 127.0.0.1:8002/metrics | grep -E "^kev_|^nv_inference_(count|exec_count|queue_duration)" > "$out/metrics.txt"
kill $server
wait $server
tail -5 "$out/tritonserver.log"
