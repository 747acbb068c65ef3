#!/usr/bin/env bash
# One device call on the GPU machine: install the carried wheels (.whl, from build/gpu_wheels.sh), then run the named
# steps in order. Everything lands in $OUT.
#   bench/gpu_run.sh STEP...        (default: all)
# Steps:
#   tests      GPU tests but parity and graphs: compiled kernels, engine API, no compiles after warm-up (~2.5 min)
#   parity     fused vs fp32 reference on tiny, width-256 and Kev-4B checkpoints (~5 min)
#   graphtest  graph replay vs eager on our long kernels (~1.5 min)
#   long       bench/diag.py long: our kernels against fla's, block, warps and chunk sweeps (~2 min)
#   latency    the engine's latency and 64-client throughput from graphs, short segments token by token, chunked, or
#              chunked for new states only (~3 min)
#   recurrent  bench/diag.py recurrent: the token-by-token delta rule's value block and warps on short6 rows (~20 s)
#   padded     bench/diag.py padded: the delta rule on captured passes' groups (capacity ending in padding segments), a
#              program per item against programs taking items in turn, and unpadded (~30 s)
#   rowsconv   long's row cases alone: the delta rule and the rows' conv tiles (~40 s)
#   diag       long, then latency (~6 min)
#   profile    bench/diag.py kernels: GPU time by kernel for busy and single short6 and long5 passes, replayed from
#              CUDA graphs on our long kernels (~2 min)
#   chunkvariants  bench/diag.py chunkvariants: the chunked delta rule's sequential pass by value block, warps,
#              product operands (tf32 / bf16) and register cap, for 1 / 8 / 24 new long states and rows (~1 min)
#   chainwaves bench/diag.py chainwaves: the chained pass's value block by new long-state count (waves) (~2 min)
#   rounds     bench/diag.py rounds: captured groups' chain by LAUNCH_ROUNDS and narrow configuration (~1 min)
#   launch     bench/diag.py launch: whether a graph's launch delays its first kernel (~1 min)
#   hostsplit  bench/diag.py hostsplit: one request's model time by host phase and GPU span, from graphs (~1 min)
#   hostops    bench/diag.py hostops: the host's primitive steps (launch, events, pinned copy), short6's layout and fill
#   prepregs   bench/diag.py prepregs: the chunked delta rule by the prep's warps and register cap (~1 min)
#   rowsattn   bench/diag.py rowsattn: rows' attention by query rows per program and keys per step (~30 s)
#   gemmpad    bench/diag.py gemmpad: each projection's GEMM by row count, and the fastest padding (~2 min)
#   flagab     bench/diag.py flagab: a module flag (KEV_AB_FLAG=module:NAME) off and on, two engines, requests interleaved
#   gemmlayout bench/diag.py gemmlayout: each projection with its weights as stored (TN) or transposed (NN) (~1 min)
#   rowschain  bench/diag.py rowschain: a short6's rows' chain by value block, warps and programs an SM (~1 min)
#   longattn   bench/diag.py longattn: new long states' attention, varlen (FA2) against our kernel's tiles (~1 min)
#   convscan   bench/diag.py convscan: the pass's conv by tokens, channels and warps a program (~1 min)
#   timeline   bench/diag.py timeline: one short6 request's model time against its kernels' busy time and gaps, then
#              the host functions by own time, from graphs (~1 min)
#   ncu        Nsight Compute (--set full, if the image has ncu) on the chunked delta rule's prep and chain (8 new
#              2,200-token states) and the token-by-token one (6 rows of 40 tokens): bench/diag.py ncuprobe (~2 min)
#   gaps       bench/diag.py gaps: the GPU's idle gaps and the model thread's phases at 64 pipelined short6 clients,
#              from graphs on our long kernels (~1 min)
#   startup    bench/diag.py startup: start-up phases on an empty kernel cache, the kept one (with a host profile), and
#              the kept one with an eager pass before every capture; then graph replay vs eager (~4 min)
#   coldstart  bench/diag.py coldstart: imports by package, then an engine from a Kev-4B checkpoint on disk on an empty and
#              a kept kernel cache, the second profiled (~3 min)
#   bench      python -m kev_backend.dev.bench; BENCH_ARGS adds arguments (e.g. "--graphs --seconds 4") (~4-5 min)
#   first      tests diag: what to run first after kernel changes
#   all        tests parity bench
# Environment: KEV_COMMIT (the commit the results name; pass it: the device's checkout may name an older HEAD),
# PARITY_SELECT (pytest -k for parity), KEV_LONG_KERNELS, KEV_SHORT_DELTA_RULE, KEV_CHUNK (kernel choices),
# LATENCY_CHOICES (latency's settings), KEV_GAPS_WORKLOAD (gaps: short6 or long5), KEV_TIMELINE_SHAPES (timeline:
# short6,long5).
set -uo pipefail
steps=("${@:-all}")
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KEV_RESULTS_DIR=$out
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, importlib.metadata as m; print('torch', torch.__version__, 'fla-core', m.version('fla-core'),
'transformers', m.version('transformers'), 'triton', m.version('triton'))"
status=0
gpu_pytest() {  # LOG -k EXPRESSION: the GPU tests matching it, the log's tail through FILTER (grep -E)
  local log=$1 expression=$2 filter=$3
  python3 -m pytest -q -p no:cacheprovider -m gpu -rs -s tests/test_kernels.py tests/test_fused_gpu.py \
    tests/test_safetensors_reader.py \
    -k "$expression" 2>&1 | tee "$out/$log" | grep -E "$filter" | cut -c1-1500 || status=1
}
diag_sweep() {  # NAME SECONDS: bench/diag.py NAME's own lines (they start with NAME) and errors, into diag-NAME.log
  timeout "$2" python3 bench/diag.py "$1" 2>&1 | grep -E "^$1|Error" | tee "$out/diag-$1.log" || status=1
}
run_step() {
  case $1 in
    tests) gpu_pytest gpu-tests.log "not parity and not graph" "passed|failed|Error|assert" ;;
    parity) gpu_pytest gpu-parity.log "${PARITY_SELECT:-parity and not graph}" "^(tiny|small|kev4b) |passed|failed|Error|error" ;;
    graphtest) gpu_pytest gpu-graphs.log "graph_replay" "^graphs |passed|failed|Error" ;;
    long) timeout 240 python3 bench/diag.py long 2>&1 | grep -v -i warn | tee "$out/diag-long.log" || status=1 ;;
    padded) timeout 120 python3 bench/diag.py padded 2>&1 | grep -v -i warn | tee "$out/diag-padded.log" || status=1 ;;
    rowsconv) timeout 120 python3 bench/diag.py long rows 2>&1 | grep -v -i warn | tee "$out/diag-rows.log" || status=1 ;;
    diag) run_step long; run_step latency ;;
    recurrent) timeout 120 python3 bench/diag.py recurrent 2>&1 | grep -v -i warn | tee "$out/diag-recurrent.log" || status=1 ;;
    latency)
      # The engine replaying CUDA graphs (as the GPU config does) with each kernel choice: latency and 64-client
      # throughput, pipelined and serial (which to make the default). LATENCY_CHOICES: the choices (default all three).
      for choice in ${LATENCY_CHOICES:-KEV_SHORT_DELTA_RULE=recurrent KEV_SHORT_DELTA_RULE=chunked \
        KEV_SHORT_DELTA_RULE=chunked-states}; do
        echo "choice $choice" | tee -a "$out/diag-latency.log"
        # shellcheck disable=SC2086
        env KEV_GRAPHS=1 KEV_LONG_KERNELS=ours $choice timeout 120 python3 bench/diag.py latency 2>&1 \
          | grep -E "^(kernels|short6|long5)" | tee -a "$out/diag-latency.log" || status=1
      done
      ;;
    profile)
      KEV_GRAPHS=1 KEV_LONG_KERNELS=ours timeout 180 python3 bench/diag.py kernels 2>&1 | grep -v -i warn \
        | tee "$out/diag-kernels.log" | grep -E "^==" || status=1
      ;;
    chunkvariants) diag_sweep chunkvariants 240 ;;
    rounds) diag_sweep rounds 150 ;;
    chainwaves) diag_sweep chainwaves 240 ;;
    launch) diag_sweep launch 150 ;;
    hostsplit) diag_sweep hostsplit 150 ;;
    hostops) diag_sweep hostops 150 ;;
    prepregs) diag_sweep prepregs 180 ;;
    rowsattn) diag_sweep rowsattn 120 ;;
    gemmpad) diag_sweep gemmpad 300 ;;
    flagab) KEV_GRAPHS=1 KEV_LONG_KERNELS=ours diag_sweep flagab 400 ;;
    gemmlayout) diag_sweep gemmlayout 200 ;;
    rowschain) diag_sweep rowschain 200 ;;
    longattn) diag_sweep longattn 180 ;;
    convscan)
      timeout 180 python3 bench/diag.py convscan 2>&1 | grep -E "convscan|Error" | tee "$out/diag-convscan.log" || status=1
      ;;
    ncu)
      ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      if [[ -z $ncu ]]; then echo "ncu: not in this image" | tee "$out/ncu.log"; return; fi
      for filter in "_chunk:4:2" "_recurrent:2:1"; do
        IFS=: read -r name skip count <<< "$filter"
        timeout 240 "$ncu" --set full -k "regex:$name" --launch-skip "$skip" --launch-count "$count" \
          python3 bench/diag.py ncuprobe >> "$out/ncu.log" 2>&1 || status=1
      done
      grep -E "^  [_a-z]|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|No Eligible|\
Warp Cycles Per Issued|Compute \(SM\) Throughput|Memory Throughput|Executed Ipc A|ERR|spill" "$out/ncu.log" | cut -c1-150
      ;;
    timeline)
      KEV_GRAPHS=1 KEV_LONG_KERNELS=ours timeout 150 python3 bench/diag.py timeline 2>&1 | grep -v -i warn \
        | tee "$out/diag-timeline.log" | head -60 || status=1
      ;;
    gaps)
      KEV_GRAPHS=1 KEV_LONG_KERNELS=ours timeout 120 python3 bench/diag.py gaps 2>&1 | grep -E "^gaps|Error" \
        | tee -a "$out/diag-gaps.log" || status=1
      ;;
    bench)
      # shellcheck disable=SC2086
      python3 -m kev_backend.dev.bench --out "$out" ${BENCH_ARGS:-} 2>&1 | tee -a "$out/bench.log" | tail -12 || status=1
      ;;
    startup)
      timeout 200 python3 bench/diag.py startup 2>&1 | grep -E "^startup|Error" | tee "$out/diag-startup.log" || status=1
      KEV_PROFILE=1 timeout 120 python3 bench/diag.py startup 2>&1 | grep -v -i warn | head -70 \
        | tee -a "$out/diag-startup.log" || status=1
      KEV_GRAPH_WARM_PASSES=1 timeout 120 python3 bench/diag.py startup 2>&1 | grep -E "^startup|Error" \
        | tee -a "$out/diag-startup.log" || status=1
      run_step graphtest
      ;;
    coldstart) timeout 400 python3 bench/diag.py coldstart 2>&1 | tee "$out/diag-coldstart.log" | cut -c1-200 || status=1 ;;
    first) run_step tests; run_step diag ;;
    all) run_step tests; run_step parity; run_step bench ;;
    *) echo "unknown step $1"; status=1 ;;
  esac
}
for step in "${steps[@]}"; do
  run_step "$step"
done
exit $status
