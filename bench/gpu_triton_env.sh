# Sourced by the device scripts that run the real tritonserver 2.51 on the GPU machine (bench/gpu_triton.sh,
# bench/gpu_batcher.sh, bench/gpu_hardening.sh): our wheels for the clients, a venv with numpy 1.26 over the image's
# torch for the 3.12 stub, the trimmed server, random Kev-4B weights in /tmp/kev4b.
# Carry the wheels (build/gpu_wheels.sh) and .gpu (build/gpu_bundle.sh). Defines start_triton and wait_ready.
# OUT: where results go (default /tmp/out; $out after sourcing). WHEELS: the wheel directory (default .whl).
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${WHEELS:-.whl}"/*.whl \
  .gpu/wheels/tritonclient-*.whl .gpu/wheels/python_rapidjson-*.whl .gpu/wheels/jevbench-*.whl \
  .gpu/wheels/gevent*.whl .gpu/wheels/greenlet-*.whl .gpu/wheels/zope*.whl .gpu/wheels/[Bb]rotli-*.whl || exit 1
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
[[ -d /tmp/kev4b/kev ]] || python3 -m kev_backend.dev.tiny /tmp/kev4b --kev4b --device cuda || exit 1

# start_triton REPOSITORY LOG: tritonserver with configs/gpu.pbtxt (KIND_GPU, graphs on) in the background; sets
# $server (its pid) and $started (its start time). START_ENV: more NAME=VALUE settings for the server.
start_triton() {
  started=$(date +%s.%N)
  LD_LIBRARY_PATH=/tmp/ts/nvidia_pytriton.libs PATH=/tmp/kv/bin:$PATH KEV_CHECKPOINT=/tmp/kev4b/kev \
    TRITON_CACHE_DIR=/tmp/triton-cache TRITON_CACHE_AUTOTUNING=1 env ${START_ENV:-} /tmp/ts/pytriton/tritonserver/bin/tritonserver \
    --model-repository="$1" --model-config-name=gpu --backend-directory=/tmp/B \
    --model-control-mode=none --http-port 8000 --grpc-port 8001 --metrics-port 8002 > "$2" 2>&1 &
  server=$!
}

# wait_ready OUT_JSON LOG [PREFIX]: waits for readiness, sends one short6, writes {"<PREFIX>ready_s",
# "<PREFIX>first_answer_s", "<PREFIX>startup_phases"} from $started and the model's start-up line in LOG.
wait_ready() {
  python3 - "$started" "$1" "$2" "${3:-}" <<'PY'
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
