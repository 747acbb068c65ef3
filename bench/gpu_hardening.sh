#!/usr/bin/env bash
# One device call: `make serve`'s supervisor (build/serve.sh) on the GPU machine with configs/gpu.pbtxt and random
# Kev-4B weights, then bench/hardening.py: a soak, the Python stub killed and the time to answering again, the
# shutdown time and the shared-memory regions left. Carry .whl (build/gpu_wheels.sh) and .gpu (build/gpu_bundle.sh).
#   bench/gpu_hardening.sh [--out DIR] [--wheels DIR] [--commit REV] [soak minutes (5)] [offered req/s (100)]
set -uo pipefail
source "$(dirname "$0")/device_args.sh" "$@"
set -- ${ARGS[@]+"${ARGS[@]}"}
source "$(dirname "$0")/gpu_triton_env.sh"
# build/tritonserver.sh's install layout, from the trimmed server gpu_triton_env.sh unpacked.
home=/tmp/tshome
mkdir -p "$home/backends"
ln -sfn /tmp/ts/pytriton/tritonserver/bin "$home/bin"
ln -sfn /tmp/ts/nvidia_pytriton.libs "$home/lib"
ln -sfn /tmp/B/python "$home/backends/python"
[[ -d /tmp/ts/pytriton/tritonserver/caches ]] && ln -sfn /tmp/ts/pytriton/tritonserver/caches "$home/caches"
echo "nvidia-pytriton==0.7.0 3.12" > "$home/.installed"
export TRITON_HOME=$home KEV_VENV=/tmp/kv KEV_CHECKPOINT=/tmp/kev4b/kev TRITON_CACHE_DIR=/tmp/triton-cache
build/serve.sh --model-config-name=gpu > "$out/serve.log" 2>&1 &
serve=$!
python3 bench/hardening.py --serve-pid "$serve" --soak-minutes "${1:-5}" --rate "${2:-100}" --out "$out" --commit "$COMMIT"
status=$?
kill "$serve" 2>/dev/null
grep -E "kev-serve|kev:" "$out/serve.log" | tail -12
exit $status
