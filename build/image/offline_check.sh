#!/usr/bin/env bash
# Proof that a wheelhouse installs and serves with no network at all: copies the working tree (git's tracked and
# untracked-but-not-ignored files, no .venv, no build outputs) into a temporary directory, then, inside a network
# namespace of its own with only loopback (unshare --net), runs `make setup WHEELHOUSE=DIR` (a fresh venv, pip
# --no-index, tritonserver from DIR), starts `make serve` on its default ports, sends README's
# request through Triton's HTTP port and through the gateway, and stops the server with SIGTERM.
#
# Usage: build/image/offline_check.sh [WHEELHOUSE]      (default build/wheelhouse; root, for unshare --net)
#   KEEP=1  keep the temporary copy (its path is printed)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
wheelhouse=$(realpath "${1:-$repo/build/wheelhouse}")
[[ -f $wheelhouse/manifest.json ]] || { echo "error: $wheelhouse has no manifest.json (make wheelhouse)" >&2; exit 1; }

work=$(mktemp -d /tmp/kev-offline.XXXXXX)
[[ -n ${KEEP:-} ]] || trap 'rm -rf "$work"' EXIT
(cd "$repo" && git ls-files -z -co --exclude-standard | grep -zv '^build/wheelhouse/' | xargs -0 cp --parents -t "$work")
echo "copy of the working tree in $work; wheelhouse $wheelhouse"

# Inside the namespace: loopback up, no other interface; pip's own configuration and sources are out of play.
unshare --net bash -euo pipefail -s "$work" "$wheelhouse" <<'INNER'
work=$1 wheelhouse=$2
ip link set lo up
cd "$work"
if python3 -c 'import socket; socket.create_connection(("pypi.org", 443), timeout=3)' 2>/dev/null; then
  echo "error: the network is reachable inside the namespace" >&2; exit 1
fi
start=$(date +%s)
make setup WHEELHOUSE="$wheelhouse" PYTHON=python3 >setup.log 2>&1 || { tail -40 setup.log; exit 1; }
echo "offline make setup: $(( $(date +%s) - start )) s; $(.venv/bin/pip list 2>/dev/null | tail -n +3 | wc -l) packages"
# Its own process group (setsid: not a group leader here, so the same pid), to signal make and kev-serve together.
setsid make serve >serve.log 2>&1 &
serve=$!
for _ in $(seq 1 600); do
  curl -sf localhost:8009/ready >/dev/null && break
  sleep 0.2
done
curl -sf localhost:8009/ready >/dev/null || { tail -40 serve.log; exit 1; }
echo "serving after $(( $(date +%s) - start )) s from the start of setup"
request='{"state": "My card was charged twice for the same order.", "questions": {"urgent": {"type": "noul", "instructions": "Does this need a reply today?"}, "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "payments and refunds", "technical": null}}}}'
body=$(python3 -c 'import json, sys; print(json.dumps({"inputs": [{"name": "REQUEST", "shape": [1, 1], "datatype": "BYTES", "data": [sys.argv[1]]}]}))' "$request")
echo "Triton HTTP: $(curl -sf localhost:8000/v2/models/kev/infer -d "$body")"
echo "gateway:     $(curl -sf localhost:8009/v1/systemone -H 'content-type: application/json' -d "$request")"
kill -TERM -- "-$serve"
wait "$serve" || true
for _ in $(seq 1 100); do grep -q 'kev-serve: stopped' serve.log && break; sleep 0.1; done
grep 'kev-serve: stopped' serve.log
INNER
