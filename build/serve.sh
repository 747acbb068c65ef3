#!/usr/bin/env bash
# Start tritonserver on the Kev model repository, and the System One gateway beside it: the command behind
# `make serve` (the end-to-end tests run it with GATEWAY=0).
#   HTTP_PORT (8000) GRPC_PORT (8001) METRICS_PORT (8002) GATEWAY_PORT (8009) GATEWAY (1; 0 = no gateway)
#   BIND_ADDRESS (0.0.0.0)  MODEL_REPOSITORY (<repo>/model_repository)  TRITON_ADMIN_KEY (admin API header value)
#   KEV_CHECKPOINT  Kev checkpoint directory (default: the model's `checkpoint` parameter, the embedded tiny one)
#   KEV_API_KEY     bearer key the gateway requires on /v1/* (none: open)
#   TRITON_CACHE_DIR  compiled GPU kernels and autotuning results, kept across restarts (default: build/.triton-cache)
# Extra arguments go to tritonserver.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=$(realpath -m "${KEV_VENV:-$here/../.venv}")
address=${BIND_ADDRESS:-0.0.0.0}
# Triton-language kernels (ours, fla's) compile once per shape class; keep them for the next start. fla stores its
# autotuning results there too (FLA_CACHE_RESULTS, on by default in fla 0.6); TRITON_CACHE_AUTOTUNING=1 does the
# same for any other autotuned Triton kernel.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$here/.triton-cache}
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
# Security by default: no model loading or unloading at run time (model-control none), and the repository,
# shared-memory, trace and logging APIs need an admin header (random unless TRITON_ADMIN_KEY is set).
admin_key=${TRITON_ADMIN_KEY:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}
restricted="model-repository,shared-memory,trace,logging:admin-key=$admin_key"
triton=("$here/tritonserver.sh"
  --model-repository="${MODEL_REPOSITORY:-$here/../model_repository}"
  --model-control-mode=none
  --strict-readiness=true
  --disable-auto-complete-config  # config.pbtxt is complete: no short-lived stub process at model load
  --http-address="$address" --http-port="${HTTP_PORT:-8000}"
  --grpc-address="$address" --grpc-port="${GRPC_PORT:-8001}"
  --metrics-address="$address" --metrics-port="${METRICS_PORT:-8002}"
  --http-restricted-api="$restricted"
  --grpc-restricted-protocol="$restricted"
  "$@")
if [[ ${GATEWAY:-1} == 0 ]]; then
  exec "${triton[@]}"
fi
"${triton[@]}" &
server=$!
"$venv/bin/kev-gateway" --host "$address" --port "${GATEWAY_PORT:-8009}" --triton "127.0.0.1:${GRPC_PORT:-8001}" &
gateway=$!
trap 'kill -TERM $server $gateway 2>/dev/null || true' EXIT INT TERM
echo "System One gateway on port ${GATEWAY_PORT:-8009} (pid $gateway); tritonserver pid $server" >&2
# Whichever stops first stops the other.
wait -n $server $gateway
