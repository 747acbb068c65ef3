#!/usr/bin/env bash
# Start tritonserver on the Kev model repository: the command behind `make serve` (and the end-to-end tests).
#   HTTP_PORT (8000) GRPC_PORT (8001) METRICS_PORT (8002) BIND_ADDRESS (0.0.0.0)
#   KEV_CHECKPOINT  Kev checkpoint directory (default: the model's `checkpoint` parameter, the embedded tiny one)
#   MODEL_REPOSITORY (<repo>/model_repository)  TRITON_ADMIN_KEY: header value for the restricted admin APIs
# Extra arguments go to tritonserver.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
address=${BIND_ADDRESS:-0.0.0.0}
# Security by default: no model loading or unloading at run time (model-control none), and the repository,
# shared-memory, trace and logging APIs need an admin header (random unless TRITON_ADMIN_KEY is set).
admin_key=${TRITON_ADMIN_KEY:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}
restricted="model-repository,shared-memory,trace,logging:admin-key=$admin_key"
exec "$here/tritonserver.sh" \
  --model-repository="${MODEL_REPOSITORY:-$here/../model_repository}" \
  --model-control-mode=none \
  --strict-readiness=true \
  --http-address="$address" --http-port="${HTTP_PORT:-8000}" \
  --grpc-address="$address" --grpc-port="${GRPC_PORT:-8001}" \
  --metrics-address="$address" --metrics-port="${METRICS_PORT:-8002}" \
  --http-restricted-api="$restricted" \
  --grpc-restricted-protocol="$restricted" \
  "$@"
