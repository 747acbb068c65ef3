#!/usr/bin/env bash
# A against B: a diagnostic (python -m bench.diag SUBCOMMAND) run in turn from a base tree and from this one (ABBA
# rounds), so that a change's gain is measured on one machine in one run, not across machines.
#   bash bench/gpu.sh base REV                          where the history is: REV's tree into .ab/base (git-ignored);
#                                                       copy .ab with the tree to the GPU host
#   bash bench/gpu.sh ab [OPTIONS] [DIAG] [ROUNDS]      DIAG (default latency) from .ab/base then this tree, then this
#                                                       tree then .ab/base, ROUNDS times (default 1); each run's
#                                                       output into OUT/ab-DIAG.log, its figures side by side in
#                                                       OUT/ab-DIAG.json (bench/ab_report.py)
# Both trees run on this tree's environment (setup: bench/suites/lib.sh), each with its own kev_backend first on the
# path.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
out=$OUT step=${1:-latency} rounds=${2:-1}
base=$PWD/.ab/base
[[ -d $base && -f .ab/REV ]] || { echo "no .ab/base: bash bench/gpu.sh base REV where the history is"; exit 2; }
gpu_setup || exit 1
log=$out/ab-$step.log
status=0
for ((i = 0; i < rounds; i++)); do
  for side in base this this base; do
    if [[ $side == base ]]; then tree=$base name="base $(cat .ab/REV)"; else tree=$PWD name="this $COMMIT"; fi
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
