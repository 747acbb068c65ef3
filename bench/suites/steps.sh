#!/usr/bin/env bash
# The named steps in order, after setup (bench/suites/lib.sh); everything lands in the output directory.
#   bash bench/gpu.sh steps [OPTIONS] STEP...        (default: all; OPTIONS: bench/gpu.sh's)
# Steps (the diagnostics are `python -m bench.diag SUBCOMMAND`; its --help describes each):
#   tests      GPU tests but parity and graphs: compiled kernels, engine API, no compiles after warm-up (~2.5 min)
#   parity     fused vs fp32 reference on tiny, width-256 and Kev-4B checkpoints (~5 min)
#   graphtest  graph replay vs eager on our long kernels (~1.5 min)
#   determinism  every answer's bits alone against in batch mixes, graphs and eager (tests/gpu/test_determinism.py)
#   latency    the engine's latency and 64-client throughput from graphs (~1 min)
#   scaling    diag scaling: new and same-state latency on states of 2k to 64k tokens (~1 min)
#   long       diag long: our delta rule and conv against fla's (~2 min)
#   diag       long, then latency
#   profile    diag kernels: GPU time by kernel for busy and single short6 and long5 passes, from graphs (~2 min)
#   timeline   diag timeline: one short6 request's model time against its kernels' busy time and gaps, then the host
#              functions by own time, from graphs (~1 min)
#   gaps       diag gaps: the GPU's idle gaps and the model thread's phases at 64 pipelined short6 clients, from
#              graphs; GAPS_WORKLOAD=long5 or grow for those (~1 min)
#   invariance diag invariance: where answers depend on the batch (~3 min)
#   batchtrace diag batchtrace: the op where a question's numbers first depend on its batch, alone against
#              shuffled batches, bit for bit (~3 min; batchtrace.json)
#   chunkvariants  diag chunkvariants: the chain by value block, warps and register cap (~1 min)
#   chainwaves diag chainwaves: the chain narrow and wide by new long-state count (~2 min)
#   prepregs   diag prepregs: the chunked delta rule by the prep's register cap (~1 min)
#   padded     diag padded: the delta rule on captured groups, unpadded, padded and lead apart (~30 s)
#   rowsattn   diag rowsattn: rows' attention by query rows per program, keys per step and stages (~30 s)
#   longattn   diag longattn: new long states' attention, varlen and SDPA against our kernel's tiles (~1 min;
#              LONGATTN_ARGS, e.g. "--tokens 8192,65535 --states 1": other state lengths)
#   turnattn   diag turnattn: a conversation's turn's attention after points of 2k-64k tokens, its parts in parallel
#              and in turn, against the state whole, bit for bit (~1 min; TURNATTN_ARGS, e.g. "--size 27b")
#   convscan   diag convscan: the pass's conv by tokens, channels and warps a program (~1 min)
#   ncu        Nsight Compute (--set full, if the image has ncu) on the chunked delta rule's prep and chain for 8 new
#              2,200-token states and for 6 rows of 40 tokens: diag ncuprobe (~2 min)
#   gemm       diag gemm: each projection's batch invariance by row count and speed, by BLAS library (~1 min)
#   gemmpad    diag gemmpad: each projection's GEMM by row count, and the fastest padding (~2 min; GEMMPAD_ARGS,
#              e.g. "--size 27b --rows 2560:2816:32")
#   hostsplit  diag hostsplit: one request's model time by host phase and GPU span, from graphs (~1 min)
#   hostops    diag hostops: the host's primitive steps (launch, events, pinned copy), short6's layout and fill
#   launch     diag launch: whether a graph's launch delays its first kernel (~1 min)
#   hostprofile  diag hostprofile: short6 on its banked state, host functions by own time
#   startup    diag startup: start-up phases on an empty kernel cache, then the kept one with a host profile; then
#              graph replay vs eager (~3 min)
#   coldstart  diag coldstart: imports by package, then an engine from a Kev-4B checkpoint on disk on an empty and a
#              kept kernel cache, the second profiled (~3 min)
#   bench      python -m kev_backend.dev.bench; BENCH_ARGS adds arguments (e.g. "--seconds 4") (~4-5 min)
#   grow       the bench's growing conversations (--quick --grow 1000) on a 48 GiB bank, 64 conversations near 8k
#              fitting it; GROW_ARGS adds arguments (e.g. "--size 27b --bank-gib 8") (~5 min)
#   first      tests diag: what to run first after kernel changes
#   all        tests parity bench
# Environment: PARITY_SELECT (pytest -k for parity), TIMELINE_SHAPES (timeline: e.g. short6,long5), GAPS_WORKLOAD
# (gaps: short6 or long5), BENCH_ARGS (bench), GROW_ARGS (grow), LONGATTN_ARGS (longattn), TURNATTN_ARGS (turnattn), PROFILE_ARGS (profile: e.g.
# "--state-tokens 65535" or "--size 27b"), GEMMPAD_ARGS (gemmpad).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
out=$OUT steps=("$@")
((${#steps[@]})) || steps=(all)
gpu_setup || exit 1
status=0
gpu_pytest() {  # LOG -k EXPRESSION FILTER: the GPU tests matching it, the log's tail through FILTER (grep -E)
  local log=$1 expression=$2 filter=$3
  "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs -s tests/gpu/kernels/test_compiled_for_hopper.py tests/gpu/test_fused_gpu.py \
    tests/gpu/test_determinism.py tests/model/test_safetensors_reader.py \
    -k "$expression" 2>&1 | tee "$out/$log" | grep -E "$filter" | cut -c1-1500 || status=1
}
diag() {  # SECONDS FILTER SUBCOMMAND [ARGS...]: python -m bench.diag, its output but warnings into
  # diag-SUBCOMMAND.log (appended), the lines matching FILTER (grep -E) on the terminal
  local seconds=$1 filter=$2 log=$out/diag-$3.log raw
  raw=$(mktemp)
  timeout "$seconds" "$PY" -m bench.diag "${@:3}" > "$raw" 2>&1 || status=1
  grep -v -i warn "$raw" | tee -a "$log" | grep -E "$filter" | cut -c1-400
  rm -f "$raw"
}
run_step() {
  case $1 in
    tests) gpu_pytest gpu-tests.log "not parity and not graph" "passed|failed|Error|assert" ;;
    parity) gpu_pytest gpu-parity.log "${PARITY_SELECT:-parity and not graph}" "^(tiny|small|kev4b) |passed|failed|Error|error" ;;
    graphtest) gpu_pytest gpu-graphs.log "graph_replay" "^graphs |passed|failed|Error" ;;
    determinism) gpu_pytest gpu-determinism.log "same_bits" "^determinism |passed|failed|Error" ;;
    long) diag 240 . long ;;
    diag) run_step long; run_step latency ;;
    latency) diag 120 "^(kernels|short6|long5)|Error" latency ;;
    scaling) diag 150 "^scaling|Error" scaling ;;
    profile) diag 180 "^==" kernels ${PROFILE_ARGS:-} ;;
    timeline) diag 150 . timeline --shapes "${TIMELINE_SHAPES:-short6}" ;;
    gaps) diag 120 "^gaps|Error" gaps --workload "${GAPS_WORKLOAD:-short6}" ;;
    invariance) diag 400 . invariance ;;
    batchtrace) diag 400 "^batchtrace|Error" batchtrace --out "$out" ;;
    longattn) diag 300 "^longattn|Error" longattn ${LONGATTN_ARGS:-} ;;
    turnattn) diag 300 "^turnattn|Error" turnattn ${TURNATTN_ARGS:-} ;;
    gemmpad) diag 300 "^gemmpad|Error" gemmpad ${GEMMPAD_ARGS:-} ;;
    chunkvariants | chainwaves | prepregs | padded | rowsattn | convscan | gemm)
      diag 300 "^$1|Error" "$1" ;;
    hostsplit | hostops | launch) diag 150 "^$1|Error" "$1" ;;
    hostprofile) diag 150 . hostprofile ;;
    ncu)
      ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      if [[ -z $ncu ]]; then echo "ncu: not in this image" | tee "$out/ncu.log"; return; fi
      for filter in "_chunk:4:2" "_chunk:10:2"; do
        IFS=: read -r name skip count <<< "$filter"
        timeout 240 "$ncu" --set full -k "regex:$name" --launch-skip "$skip" --launch-count "$count" \
          "$PY" -m bench.diag ncuprobe >> "$out/ncu.log" 2>&1 || status=1
      done
      grep -E "^  [_a-z]|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|No Eligible|\
Warp Cycles Per Issued|Compute \(SM\) Throughput|Memory Throughput|Executed Ipc A|ERR|spill" "$out/ncu.log" | cut -c1-150
      ;;
    bench)
      # shellcheck disable=SC2086
      "$PY" -m kev_backend.dev.bench --out "$out" --commit "$COMMIT" ${BENCH_ARGS:-} 2>&1 | tee -a "$out/bench.log" | tail -12 || status=1
      ;;
    grow)
      # shellcheck disable=SC2086
      "$PY" -m kev_backend.dev.bench --quick --grow 1000 --bank-gib 48 --out "$out" --commit "$COMMIT" ${GROW_ARGS:-} \
        2>&1 | tee -a "$out/grow.log" | grep -E "^grow|written|Error" | cut -c1-2000 || status=1
      ;;
    startup)
      diag 200 "^startup|Error" startup
      diag 120 "^startup|Error|function calls|tottime| [0-9]" startup --profile
      run_step graphtest
      ;;
    coldstart) diag 400 . coldstart ;;
    first) run_step tests; run_step diag ;;
    all) run_step tests; run_step parity; run_step bench ;;
    *) echo "unknown step $1"; status=1 ;;
  esac
}
for step in "${steps[@]}"; do
  run_step "$step"
done
exit $status
