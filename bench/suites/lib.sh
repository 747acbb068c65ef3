# Sourced by every suite that bench/gpu.sh runs; bench/gpu.sh exports what it reads:
#   OUT            where the suite's logs and results go
#   INSTALL        wheelhouse:DIR (offline), index (the package index) or installed (set up already)
#   TORCH_SOURCE   system (the host python's own torch and CUDA stack) or pip (the project's pinned torch)
#   COMMIT         the commit the results name
# Defines gpu_setup, setup_args, kev4b_checkpoint, start_triton and wait_ready.
: "${OUT:?run the suites through bench/gpu.sh}" "${INSTALL:?}" "${TORCH_SOURCE:?}" "${COMMIT:?}"
mkdir -p "$OUT"

# setup_args: make's arguments for this install source (for `make setup` and `make serve`), one a line.
setup_args() {
  echo "TORCH=$TORCH_SOURCE"
  echo "PYTHON=python3"
  [[ $INSTALL == wheelhouse:* ]] && echo "WHEELHOUSE=${INSTALL#wheelhouse:}"
  return 0
}

# gpu_setup: `make setup SETS=...` (SETS in the environment; default "serve bench") in this tree, its log in
# $OUT/setup.log, unless INSTALL=installed; then PY (the project's python) and PYTHONUNBUFFERED are exported, the GPU
# and the stack are printed and the environment's packages written to $OUT/packages.txt.
gpu_setup() {
  local begun=$SECONDS args
  if [[ $INSTALL != installed ]]; then
    mapfile -t args < <(setup_args)
    make setup "${args[@]}" SETS="${SETS:-serve bench}" >"$OUT/setup.log" 2>&1 || { tail -30 "$OUT/setup.log"; return 1; }
    echo "setup (${INSTALL%%:*}, torch $TORCH_SOURCE): $((SECONDS - begun)) s"
  fi
  export PY=$PWD/.venv/bin/python PYTHONUNBUFFERED=1
  [[ -x $PY ]] || { echo "no .venv in $PWD: run make setup, or leave out --installed"; return 1; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  # The environment the run measured, every project and version (the GPU image is checked against a kept copy:
  # tests/deploy/test_image.py).
  "$PY" -m pip freeze --all >"$OUT/packages.txt" 2>/dev/null
}

# kev4b_checkpoint [DIR]: random weights of Kev-4B shapes in DIR (default /tmp/kev4b), drawn on the GPU, once;
# exports KEV4B=DIR/kev (the checkpoint).
kev4b_checkpoint() {
  local dir=${1:-/tmp/kev4b}
  [[ -d $dir/kev ]] || "$PY" -m kev_backend.dev.synthetic "$dir" --kev4b --device cuda >/dev/null || return 1
  export KEV4B=$dir/kev
}

# start_triton REPOSITORY LOG: tritonserver with configs/gpu.pbtxt (KIND_GPU, graphs on) on $KEV4B in the background;
# sets $server (its pid) and $started (its start time). START_ENV: more NAME=VALUE settings for the server.
start_triton() {
  started=$(date +%s.%N)
  # shellcheck disable=SC2086
  KEV_CHECKPOINT=$KEV4B TRITON_CACHE_DIR=/tmp/triton-cache TRITON_CACHE_AUTOTUNING=1 env ${START_ENV:-} \
    build/tritonserver.sh --model-repository="$1" --model-config-name=gpu --model-control-mode=none \
    --http-port 8000 --grpc-port 8001 --metrics-port 8002 >"$2" 2>&1 &
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
line = re.search(r"start-up seconds ([^\";]*)", open(log).read())  # the phases end at the next ";"
phases = dict((name, float(value)) for name, value in re.findall(r"(\w+) ([\d.]+)", line[1])) if line else {}
record = {f"{prefix}ready_s": ready, f"{prefix}first_answer_s": first, f"{prefix}startup_phases": phases}
print(json.dumps(record))
open(out, "w").write(json.dumps(record) + "\n")
PY
}
