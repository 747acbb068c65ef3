#!/usr/bin/env bash
# podman with the project's settings: build/image/containers.conf (unless CONTAINERS_CONF is set) and, when
# PODMAN_ROOT is set, image and container storage kept under that directory (graph root PODMAN_ROOT/storage, run
# root PODMAN_ROOT/run) instead of podman's default (/var/lib/containers for root). Arguments go to podman.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export CONTAINERS_CONF=${CONTAINERS_CONF:-$here/containers.conf}
if [[ -n ${PODMAN_ROOT:-} ]]; then
  root=$(realpath -m "$PODMAN_ROOT")
  mkdir -p "$root/storage" "$root/run"
  conf=$root/storage.conf
  want=$(printf '[storage]\ndriver = "overlay"\ngraphroot = "%s/storage"\nrunroot = "%s/run"\n' "$root" "$root")
  [[ -f $conf && "$(cat "$conf")" == "$want" ]] || printf '%s\n' "$want" >"$conf"
  export CONTAINERS_STORAGE_CONF=$conf
fi
exec "${PODMAN_BIN:-podman}" "$@"
