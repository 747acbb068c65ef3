#!/usr/bin/env bash
# One device call on the GPU machine: install the carried wheels (.whl, from build/gpu_wheels.sh), run the GPU tests
# (fused vs fp32 reference parity, CUDA eager reference), then the benchmark. Everything lands in $OUT.
#   bench/gpu_run.sh [tests|parity|bench|graphs|first|all] [pytest -k expression]
# graphs: the graph-vs-eager parity test, then the bench with CUDA graphs on.
# first: the GPU tests, bench/diag.py long (our long-segment kernels against fla's) and the graph-vs-eager test,
#        about 5 minutes: what to run first after kernel changes.
set -uo pipefail
mode=${1:-all}
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KEV_RESULTS_DIR=$out
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, importlib.metadata as m; print('torch', torch.__version__, 'fla-core', m.version('fla-core'),
'transformers', m.version('transformers'), 'triton', m.version('triton'))"
status=0
if [[ $mode == tests || $mode == all || $mode == first ]]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_kernels.py tests/test_fused_gpu.py -k "${2:-not parity and not graph}" 2>&1 \
    | tee "$out/gpu-tests.log" | tail -30 || status=1
fi
if [[ $mode == parity || $mode == all ]]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu -rs -s tests/test_fused_gpu.py -k "${2:-parity and not graph}" 2>&1 \
    | tee "$out/gpu-parity.log" | grep -E "^(tiny|small|kev4b) |passed|failed|Error|error" | cut -c1-1500 || status=1
fi
if [[ $mode == bench || $mode == all ]]; then
  python3 -m kev_backend.bench --out "$out" 2>&1 | tee "$out/bench.log" | tail -12 || status=1
fi
if [[ $mode == first ]]; then
  timeout 180 python3 bench/diag.py long 2>&1 | grep -v -i warn | tee "$out/diag-long.log" || status=1
fi
if [[ $mode == graphs || $mode == first ]]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu -rs -s tests/test_fused_gpu.py -k graph_replay 2>&1 \
    | tee "$out/gpu-graphs.log" | grep -E "^graphs |passed|failed|Error" | cut -c1-1500 || status=1
fi
if [[ $mode == graphs ]]; then
  python3 -m kev_backend.bench --out "$out" --graphs 2>&1 | tee "$out/bench-graphs.log" | tail -12 || status=1
fi
exit $status
