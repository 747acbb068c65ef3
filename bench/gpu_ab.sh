#!/usr/bin/env bash
# A against B on the GPU machine: a bench/diag.py step run in turn from a base tree and from this one (ABBA rounds),
# so that a change's gain is measured on one machine in one call, not across machines (whose GPUs differ by ~1 ms on
# long5 new). The base tree is made here and carried:
#   bash bench/gpu_ab.sh prepare REV         here: .ab/ (git-ignored) holds REV's kev_backend/ and bench/; carry
#                                            ".ab" with ".whl"
#   bash bench/gpu_ab.sh run [STEP] [ROUNDS] there: STEP (default latency) from .ab/ then this tree, then this tree
#                                            then .ab/, ROUNDS times (default 1); each run's output into $OUT/ab-STEP.log
# Environment as bench/gpu_run.sh (KEV_COMMIT names this tree); KEV_GRAPHS=1 and KEV_LONG_KERNELS=ours as the GPU
# config runs.
set -uo pipefail
case ${1:-} in
  prepare)
    rev=${2:?a base revision}
    rm -rf .ab && mkdir .ab && git archive "$rev" kev_backend bench | tar -x -C .ab || exit 1
    git rev-parse --short "$rev" > .ab/REV
    echo "base $(cat .ab/REV) in .ab/"
    ;;
  run)
    step=${2:-latency} rounds=${3:-1}
    out=${OUT:-/tmp/out}
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || exit 1
    export PYTHONUNBUFFERED=1 KEV_GRAPHS=1 KEV_LONG_KERNELS=ours
    log=$out/ab-$step.log
    status=0
    for ((i = 0; i < rounds; i++)); do
      for side in base this this base; do
        if [[ $side == base ]]; then tree=$PWD/.ab name="base $(cat .ab/REV)"; else tree=$PWD name="this ${KEV_COMMIT:-?}"; fi
        echo "== $name" | tee -a "$log"
        # The tree's own diag.py and kev_backend (the script's directory comes first on sys.path, then PYTHONPATH).
        # The whole output into the log; the lines naming a workload or an error on the terminal.
        PYTHONPATH=/tmp/site:$tree timeout 200 python3 "$tree/bench/diag.py" "$step" 2>&1 | tee -a "$log" \
          | grep -E "^(short6|long5|== |$step)|Error" || status=1
      done
    done
    exit $status
    ;;
  *)
    echo "usage: bench/gpu_ab.sh prepare REV | run [STEP] [ROUNDS]" >&2
    exit 2
    ;;
esac
