#!/usr/bin/env bash
# A against B on the GPU machine: a diagnostic (python -m bench.diag SUBCOMMAND) run in turn from a base tree and from
# this one (ABBA rounds), so that a change's gain is measured on one machine in one call, not across machines. The
# base tree is made here and carried:
#   bash bench/gpu_ab.sh prepare REV         here: .ab/ (git-ignored) holds REV's kev_backend/ and bench/; carry
#                                            ".ab" with the wheelhouse
#   bash bench/gpu_ab.sh run [--out DIR] [--wheelhouse DIR] [STEP] [ROUNDS]
#                                            there: STEP (default latency) from .ab/ then this tree, then this tree
#                                            then .ab/, ROUNDS times (default 1); each run's output into DIR/ab-STEP.log,
#                                            its figures side by side in DIR/ab-STEP.json (bench/ab_report.py)
# --out DIR, --wheelhouse DIR, --commit REV (the commit this tree is): as bench/gpu_run.sh. Both trees run on this
# tree's environment (`make setup` from the wheelhouse), each with its own kev_backend first on the path.
set -uo pipefail
case ${1:-} in
  prepare)
    rev=${2:?a base revision}
    rm -rf .ab && mkdir .ab && git archive "$rev" kev_backend bench | tar -x -C .ab || exit 1
    git rev-parse --short "$rev" > .ab/REV
    echo "base $(cat .ab/REV) in .ab/"
    ;;
  run)
    shift
    source "$(dirname "$0")/device_args.sh" "$@"
    out=$OUT
    step=${ARGS[0]:-latency} rounds=${ARGS[1]:-1}
    device_setup || exit 1
    log=$out/ab-$step.log
    status=0
    for ((i = 0; i < rounds; i++)); do
      for side in base this this base; do
        if [[ $side == base ]]; then tree=$PWD/.ab name="base $(cat .ab/REV)"; else tree=$PWD name="this $COMMIT"; fi
        echo "== $name" | tee -a "$log"
        # The tree's own diagnostics and kev_backend (run from the tree: it comes first on sys.path); a base from
        # before bench/diag/ has bench/diag.py. The whole output into the log; the lines naming a workload or an
        # error on the terminal.
        if [[ -d $tree/bench/diag ]]; then diag=(-m bench.diag); else diag=(bench/diag.py); fi
        (cd "$tree" && PYTHONPATH=$tree timeout 200 "$PY" "${diag[@]}" "$step") 2>&1 | tee -a "$log" \
          | grep -E "^(short6|long5|== |$step)|Error" || status=1
      done
    done
    gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)
    "$PY" bench/ab_report.py --out "$out/ab-$step.json" --field "what=bench.diag $step, ABBA" \
      --field "base=$(cat .ab/REV)" --field "this=$COMMIT" --field "gpu=${gpu%%,*}" --field "driver=${gpu##*, }" \
      --field "date=$(date -u +%F)" "$log" >/dev/null || status=1
    exit $status
    ;;
  *)
    echo "usage: bench/gpu_ab.sh prepare REV | run [--out DIR] [--wheelhouse DIR] [STEP] [ROUNDS]" >&2
    exit 2
    ;;
esac
