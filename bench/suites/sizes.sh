#!/usr/bin/env bash
# Every chosen Kev size measured in turn, each on random weights of its shapes (kev_backend.dev.sizes.SIZES), after
# setup (bench/suites/lib.sh).
#   bash bench/gpu.sh sizes [OPTIONS] SIZE...     (SIZE: 0.8b 4b 9b 27b; OPTIONS: bench/gpu.sh's)
# Per size, in order; seconds on an H200 estimated from Kev-4B's measured figures scaled by weight bytes and FLOPs
# (0.8b / 4b / 9b / 27b), the first size of a run paying ~20 s more for an empty kernel cache:
#   write   python -m kev_backend.dev.synthetic /tmp/kev-sizes/SIZE --size SIZE --device cuda: bf16 weights drawn a tensor
#           at a time on the GPU, written in 5 GiB shards (disk: 1.5 / 8.4 / 18 / 51 GB)             5 / 15 / 30 / 100
#   tune    python -m kev_backend.dev.gemm_tuner tune SIZE: the size's GEMM table                     3 / 5 / 10 / 20
#   bench   python -m kev_backend.dev.bench --quick --clients 64,128 (latencies, one request's wall time, short6 at 64
#           and 128 clients) on the checkpoint written, with its table; 4b also --scaling (states of 2k-64k tokens,
#           the bank's room for 64k ones: ~40 s)
#                                                                                                  40 / 90 / 70 / 120
#   parity  python -m kev_backend.dev.parity --size SIZE --questions 300: fused bf16 against the fp32 reference
#           (27b: its first 16 layers, SIZES' parity_layers)                                     20 / 45 / 70 / 60
#   serve   KEV_CHECKPOINT=... build/serve.sh (the GPU configuration, chosen by itself) with the size's table:
#           loadtest/served.py (ready, first answer, short6 over gRPC alone and at 64 clients), then
#           loadtest/frontdoor.py (gRPC and the gateway: one client, 64 and 128 clients over FRONTDOOR_PROCS (8)
#           processes for 5 s each, 27b 20 s (its batches take about a second), beside the bench's figures; the one
#           client once more with Triton's trace on, its time by phase: loadtest/tracing.py; ~50 s), 4b also
#           loadtest/long_states.py (16k-token new states alone and 8 at once), the GPU's memory, SIGTERM.
#           PYSPY=PATH (a py-spy binary): the stub's threads sampled through 64 gRPC clients, 5 s of them waits
#           included (pyspy-SIZE.txt among the logs), 5 s only where a thread holds the GIL (pyspy-gil-SIZE.txt)
#                                                                                                  30 / 45 / 50 / 110
#   refuse  (only when named in STEPS) the server started twice on a GPU another process fills: once leaving half the
#           weights' bytes (the checkpoint's and its base's) and 1.5 GiB free (tritonserver's and the stub's CUDA
#           contexts take about 1.2 GiB: the weights do not fit), once the weights' bytes and 4 GiB (less than any
#           size's largest pass needs beside the contexts: the weights fit, the pass does not);
#           each start must exit (exit code 1) with its message and no restart; refuse-SIZE.json: seconds to exit,
#           exit code, restarts, the message                                                                      ~40
#   the checkpoint is deleted (before the next size is written: the disk holds one 27b at a time)
# Totals with setup (~35 s): 0.8b ~140 s, 4b ~240 s, 9b ~270 s, 27b ~450 s (its write depends on the disk: 51 GB
# at 0.5-1.5 GB/s). STEPS="bench serve" (a subset of write tune bench parity serve refuse, in that order; refuse only
# when named) runs only those: the checkpoint is written when bench, serve or refuse is among them.
# Out: sizes-SIZE.json per size (bench/sizes_report.py: every step's JSON merged, the size's GEMM table among them),
# gemm-algos-SIZES.json (this run's tables merged: to commit, merge it with the packaged one:
# python -m kev_backend.dev.gemm_tuner merge OUT.json kev_backend/gpu/gemm_algos/TABLE.json THIS.json),
# sizes-logs.tar.gz (every step's log, setup's). Each size's files are written when it ends: a run cut short keeps
# the sizes done.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
sizes=("$@")
((${#sizes[@]})) || { echo "usage: bash bench/gpu.sh sizes [OPTIONS] SIZE... (0.8b 4b 9b 27b)"; exit 2; }
for size in "${sizes[@]}"; do
  [[ $size =~ ^(0\.8b|4b|9b|27b)$ ]] || { echo "unknown size $size (0.8b 4b 9b 27b)"; exit 2; }
done
steps=" ${STEPS:-write tune bench parity serve} "
[[ $steps == *" bench "* || $steps == *" serve "* || $steps == *" refuse "* ]] && steps+="write "
wanted() { [[ $steps == *" $1 "* ]]; }
work=/tmp/kev-sizes
logs=$work/logs
rm -rf "$work"
mkdir -p "$logs"
trap 'rm -rf "$work"/{0.8b,4b,9b,27b}' EXIT  # a checkpoint never outlives the run (the disk holds one 27b)
gpu_setup || { mv "$OUT/setup.log" "$logs/" 2>/dev/null; tar -czf "$OUT/sizes-logs.tar.gz" -C "$work" logs; exit 1; }
mv "$OUT/setup.log" "$logs/"
# One kernel cache for every step: the server starts on the kernels the bench compiled.
export TRITON_CACHE_DIR=/tmp/triton-cache TRITON_CACHE_AUTOTUNING=1
status=0

step() {  # SIZE NAME TIMEOUT_S COMMAND...: runs it (a shell function without the time limit: its commands bound
  # their own), its output in $logs/NAME-SIZE.log, its seconds and exit code noted in $work/steps-SIZE.txt
  local size=$1 name=$2 limit=$3 begun=$SECONDS code
  shift 3
  if declare -F "$1" >/dev/null; then "$@"; else timeout "$limit" "$@"; fi >"$logs/$name-$size.log" 2>&1
  code=$?
  echo "$name $((SECONDS - begun)) $code" >>"$work/steps-$size.txt"
  ((code == 0)) || { status=1; echo "$size: $name failed ($code):"; tail -5 "$logs/$name-$size.log"; }
  return $code
}

serve() {  # SIZE CHECKPOINT TABLE: the real server on the checkpoint, measured, then SIGTERM
  local size=$1 checkpoint=$2 table=$3 started server spy=
  started=$(python3 -c 'import time; print(time.time())')
  # A chosen admin key and a trace file (tracing off until frontdoor.py turns it on for its traced client).
  python3 -c 'import secrets; print(secrets.token_hex(16))' >"$work/admin-key"
  setsid env KEV_CHECKPOINT="$checkpoint" KEV_GEMM_ALGOS="$table" TRITON_ADMIN_KEY_FILE="$work/admin-key" \
    build/serve.sh --trace-config triton,file="$work/trace-$size.json" --trace-config level=OFF \
    --trace-config rate=1 --trace-config triton,log-frequency=1 >"$logs/tritonserver-$size.log" 2>&1 &
  server=$!
  timeout 400 "$PY" loadtest/served.py --started "$started" --seconds 5 --limit 300 --commit "$COMMIT" \
    --out "$work/served-$size.json"
  local code=$? used bytes inprocess
  used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
  bytes=$(du -sb "$work/$size" 2>/dev/null | cut -f1)
  echo "{\"checkpoint_bytes\": ${bytes:-null}, \"served_gpu_mib\": ${used:-null}}" >"$work/facts-$size.json"
  inprocess=$(ls -t "$work/bench-$size"/*.json 2>/dev/null | head -1)
  if ((code == 0)); then
    timeout 300 "$PY" loadtest/frontdoor.py --metrics 127.0.0.1:8002 --gateway http://127.0.0.1:8009 \
      ${inprocess:+--inprocess "$inprocess"} --admin-key-file "$work/admin-key" --procs "${FRONTDOOR_PROCS:-8}" \
      --seconds "$([[ $size == 27b ]] && echo 20 || echo 5)" --model "kev-$size-shapes" --commit "$COMMIT" \
      --out "$work/frontdoor-$size.json" || code=1
  fi
  if ((code == 0)) && [[ -n ${PYSPY:-} ]]; then  # the stub sampled through 64 gRPC clients: its threads (waits
    # included) for 5 s, then for 5 s only where a thread holds the GIL (what the stub's Python work costs)
    local stub
    stub=$(pgrep -f triton_python_backend_stub | head -1)
    timeout 60 "$PY" loadtest/frontdoor.py --alone 1 --clients 64 --seconds 12 --procs "${FRONTDOOR_PROCS:-8}" \
      --out "$work/spied-$size.json" >/dev/null & spy=$!
    sleep 3
    "$PYSPY" record -p "$stub" -r 200 -d 5 --idle --threads -f raw -o "$logs/pyspy-$size.txt" >/dev/null 2>&1
    "$PYSPY" record -p "$stub" -r 500 -d 5 --gil --threads -f raw -o "$logs/pyspy-gil-$size.txt" >/dev/null 2>&1
    wait "$spy"
  fi
  if ((code == 0)) && [[ $size == 4b ]]; then
    timeout 120 "$PY" loadtest/long_states.py --tokenizer "$work/$size/base" --tokens 16384 --concurrent 8 --alone 5 \
      --rounds 3 --commit "$COMMIT" --out "$work/long-$size.json" || code=1
  fi
  kill -TERM -- -"$server" 2>/dev/null
  wait "$server"
  return $code
}

refuse() {  # SIZE CHECKPOINT: the server's start on a GPU left too small by another process, twice
  local size=$1 checkpoint=$2 bytes leave hog began code record=() case
  bytes=$(du -sb "$(dirname "$checkpoint")" | cut -f1)  # the checkpoint and its base (a LoRA's weights are there)
  for case in weights bank; do
    [[ $case == weights ]] && leave=$((bytes / 2 + (3 << 29))) || leave=$((bytes + (4 << 30)))
    "$PY" -c 'import sys, time, torch
free, _ = torch.cuda.mem_get_info()
held = torch.empty(free - int(sys.argv[1]), dtype=torch.uint8, device="cuda")
print("holding", held.numel(), flush=True)
time.sleep(900)' "$leave" >"$work/hog.txt" 2>&1 &
    hog=$!
    for _ in $(seq 100); do grep -q holding "$work/hog.txt" && break; sleep 0.2; done
    began=$SECONDS
    timeout 300 env KEV_CHECKPOINT="$checkpoint" GATEWAY=0 build/serve.sh >"$logs/refuse-$case-$size.log" 2>&1
    code=$?
    kill "$hog"; wait "$hog" 2>/dev/null
    record+=("$("$PY" - "$logs/refuse-$case-$size.log" "$case" "$code" "$((SECONDS - began))" <<'PYEOF'
import json, sys
log, case, code, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
lines = open(log, errors="replace").read().splitlines()
# The model's refusal as Triton logs it: "...: NAME: MESSAGE\n\nAt:\n  TRACEBACK" (newlines escaped, within one line).
said = [line.split(name + ": ", 1)[1].split("\\n", 1)[0] for line in lines
        for name in ("WeightsDoNotFit", "GpuMemoryError") if name + ": " in line]
print(json.dumps({"case": case, "exit_code": code, "seconds": seconds,
                  "restarts": sum("TRITON RESTART" in line for line in lines),
                  "message": said[0] if said else None}))
PYEOF
)")
  done
  (IFS=,; echo "[${record[*]}]") >"$work/refuse-$size.json"
  "$PY" -c 'import json, sys; [print(r) for r in json.load(open(sys.argv[1]))]' "$work/refuse-$size.json"
}

for size in "${sizes[@]}"; do
  checkpoint=$work/$size/kev table=$work/gemm-$size.json
  echo "== $size"
  wanted write && step "$size" write 300 "$PY" -m kev_backend.dev.synthetic "$work/$size" --size "$size" --device cuda
  if ! wanted tune || ! step "$size" tune 120 "$PY" -m kev_backend.dev.gemm_tuner tune "$size" "$table"; then
    table=auto
  fi
  scaling=()
  [[ $size == 4b ]] && scaling=(--scaling)
  wanted bench && step "$size" bench 300 "$PY" -m kev_backend.dev.bench --quick --seconds 3 --size "$size" \
    --checkpoint "$checkpoint" --gemm-algos "$table" --clients 64,128 ${scaling[@]+"${scaling[@]}"} \
    --commit "$COMMIT" \
    --out "$work/bench-$size"
  wanted parity && step "$size" parity 300 "$PY" -m kev_backend.dev.parity --size "$size" --questions 300 \
    --commit "$COMMIT" --out "$work/parity-$size"
  wanted serve && step "$size" serve 0 serve "$size" "$checkpoint" "$table"
  wanted refuse && step "$size" refuse 0 refuse "$size" "$checkpoint"
  rm -rf "${work:?}/$size"
  "$PY" bench/sizes_report.py "$size" "$work" "$OUT/sizes-$size.json" || status=1
  tables=("$work"/gemm-*.json)
  merged=$OUT/gemm-algos-$(IFS=-; echo "${sizes[*]}").json
  [[ -e ${tables[0]} ]] && "$PY" -m kev_backend.dev.gemm_tuner merge "$merged" "${tables[@]}" >/dev/null
  tar -czf "$OUT/sizes-logs.tar.gz" -C "$work" logs
done
exit $status
