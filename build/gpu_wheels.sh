#!/usr/bin/env bash
# Wheels the GPU machine lacks (its image has torch 2.11, triton 3.6, numpy 2, transformers, grpcio, uvloop; no
# network there), downloaded here for Python 3.12 into .whl/ to carry with a device call (bench/gpu_run.sh installs
# them): fla-core and pydantic for the engine, FastAPI and uvicorn (with zstd) for the gateway.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
for spec in fla-core==0.6.0 pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 httptools==0.7.1 backports.zstd==1.8.0 \
  opentelemetry-api==1.45.2; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec"
done
ls -la .whl
