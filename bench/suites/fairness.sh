#!/usr/bin/env bash
# Long work against short requests on the GPU, served as `make serve` serves (the supervisor with its probe on), with
# random Kev-4B weights, after setup (bench/suites/lib.sh).
#   bash bench/gpu.sh fairness [OPTIONS] [STEP...]          (default: tests serve; OPTIONS: bench/gpu.sh's)
# The `ab` step needs a base tree in .ab/base: `bash bench/gpu.sh base REV` where the history is.
# Steps:
#   tests   the fused path's GPU tests of the pipeline and graphs, and the determinism test (every answer's bits
#           alone against in batch mixes)
#   serve   serve the tree, then loadtest/served.py (short6 alone and at 64 clients over gRPC) and
#           loadtest/fairness.py twice: 65,536-token new states, then 64-order /permute requests, each against
#           short6 clients; the supervisor's restarts counted from its log
#   ab      served short6 throughput (loadtest/served.py: one client, then 64) from the base tree in .ab/base and from
#           this one, ABBA (AB_ROUNDS times, default 1), each served from its own setup; served-ab.json gathers them
# FAIR_ARGS adds arguments to both fairness runs (e.g. "--seconds 20"). Results: served.json, fairness-state.json,
# fairness-permute.json, served-ab.json, the logs.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
out=$OUT steps=("$@")
((${#steps[@]})) || steps=(tests serve)
gpu_setup || exit 1
status=0
run_tests() {
  "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests/gpu/test_fused_gpu.py tests/gpu/test_determinism.py \
    -k "back_to_back or long_work_between or graph_replay or same_bits or engine_api" 2>&1 \
    | tee "$out/gpu-tests.log" | grep -E "^determinism |passed|failed|Error|assert" | cut -c1-400 || status=1
}
run_serve() {
  kev4b_checkpoint || return 1
  local tokenizer=/tmp/kev4b/base started
  started=$(python3 -c 'import time; print(time.time())')
  KEV_CHECKPOINT=$KEV4B TRITON_CACHE_DIR=/tmp/triton-cache GATEWAY=0 build/serve.sh > "$out/serve.log" 2>&1 &
  local serve=$!
  "$PY" loadtest/served.py --started "$started" --commit "$COMMIT" --out "$out/served.json" | tail -2 || status=1
  for long in state permute; do
    # shellcheck disable=SC2086
    "$PY" loadtest/fairness.py --tokenizer "$tokenizer" --long $long --units 1 --clients 8 --long-clients 2 \
      --seconds 30 --alone 2 --commit "$COMMIT" --label "$long" ${FAIR_ARGS:-} --out "$out/fairness-$long.json" \
      2>&1 | tail -1 | cut -c1-600 || status=1
  done
  kill -TERM $serve
  wait $serve
  echo "supervisor restarts: $(grep -c 'TRITON RESTART' "$out/serve.log")"
  grep -E "kev-serve|kev: " "$out/serve.log" | cut -c1-300 | tail -6
}
served_from() {  # LABEL TREE: TREE served (its own setup), served.py against it, stopped
  local label=$1 tree=$2 started serve setup
  mapfile -t setup < <(setup_args)
  (cd "$tree" && make setup "${setup[@]}" SETS=serve >"$out/setup-$label.log" 2>&1) \
    || { tail -5 "$out/setup-$label.log"; return 1; }
  kev4b_checkpoint || return 1
  started=$(python3 -c 'import time; print(time.time())')
  (cd "$tree" && KEV_CHECKPOINT=$KEV4B TRITON_CACHE_DIR=/tmp/triton-cache GATEWAY=0 exec build/serve.sh) \
    > "$out/serve-$label.log" 2>&1 &
  serve=$!
  "$PY" loadtest/served.py --started "$started" --seconds 10 --commit "$label" --out "$out/served-$label.json" \
    | tail -1 | cut -c1-400 || status=1
  kill -TERM $serve
  wait $serve
}
run_ab() {
  local base=$PWD/.ab/base round side turn=0
  [[ -d $base ]] || { echo "no .ab/base: bash bench/gpu.sh base REV where the history is, and copy .ab with the tree"; return 1; }
  for ((round = 1; round <= ${AB_ROUNDS:-1}; round++)); do
    for side in base this this base; do
      ((turn += 1))
      [[ $side == base ]] && served_from "$turn-base-$(cat .ab/REV)" "$base"
      [[ $side == this ]] && served_from "$turn-this" "$PWD"
    done
  done
  "$PY" -c "import json, glob, sys; json.dump({p: json.load(open(p)) for p in sorted(glob.glob(sys.argv[1] + '/served-*-*.json'))}, open(sys.argv[1] + '/served-ab.json', 'w'), indent=1)" "$out"
}
for step in "${steps[@]}"; do
  case $step in
    tests) run_tests ;;
    serve) run_serve ;;
    ab) run_ab ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
done
exit $status
