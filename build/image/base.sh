#!/usr/bin/env bash
# Build the default base image of the Dockerfile, localhost/debian-base:bookworm, from Debian packages alone: no
# image registry is needed (air-gapped builds), only a Debian mirror (this machine's apt sources by default).
#
# Usage: build/image/base.sh [IMAGE]       (default: $BASE_IMAGE, else localhost/debian-base:bookworm)
#   FORCE=1         rebuild even when IMAGE exists (otherwise an existing IMAGE is kept: idempotent)
#   DEBIAN_MIRROR   a mirror URL (e.g. http://deb.debian.org/debian); default: /etc/apt/sources.list.d/debian.sources
#                   or /etc/apt/sources.list of this machine, passed to mmdebstrap as they are
#   PODMAN_ROOT     see build/image/podman.sh (image storage outside podman's default)
# Needs mmdebstrap and podman (Debian: apt-get install -y podman buildah mmdebstrap runc).
#
# What is in it (bookworm, --variant=apt, docs, man pages and locales left out): python3 3.11 and python3-venv (the
# venv), libpython3.11 (the tritonserver Python stub links it), tini (PID 1: forwards SIGTERM, reaps), libjemalloc2 (the
# servers' malloc: KEV_HOST_ALLOCATOR), unzip and xz-utils (build/install_tritonserver.sh), passwd (useradd for the
# non-root user), ca-certificates.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
image=${1:-${BASE_IMAGE:-localhost/debian-base:bookworm}}
podman=("$here/podman.sh")
packages=(python3 python3-venv libpython3.11 ca-certificates tini libjemalloc2 unzip xz-utils passwd)

# An image of that name made from an older list is made again.
if [[ -z ${FORCE:-} ]] && "${podman[@]}" image exists "$image" \
  && "${podman[@]}" run --rm --network=none "$image" dpkg-query -W "${packages[@]}" >/dev/null 2>&1; then
  echo "base image $image exists with every package (FORCE=1 rebuilds it)"
  exit 0
fi
command -v mmdebstrap >/dev/null || { echo "error: mmdebstrap not found (apt-get install -y mmdebstrap)" >&2; exit 1; }

if [[ -n ${DEBIAN_MIRROR:-} ]]; then
  mirrors=("deb $DEBIAN_MIRROR bookworm main" "deb $DEBIAN_MIRROR bookworm-updates main")
elif [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
  mirrors=(/etc/apt/sources.list.d/debian.sources)
elif [[ -s /etc/apt/sources.list ]]; then
  mirrors=(/etc/apt/sources.list)
else
  mirrors=("http://deb.debian.org/debian")
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
mmdebstrap --variant=apt --quiet \
  --include="$(IFS=,; echo "${packages[*]}")" \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
  bookworm "$tmp/rootfs.tar" "${mirrors[@]}"
"${podman[@]}" import --change 'CMD ["/bin/bash"]' \
  --change 'ENV LANG=C.UTF-8' \
  --message "debian bookworm (mmdebstrap, build/image/base.sh)" "$tmp/rootfs.tar" "$image" >/dev/null
echo "built $image in $(( $(date +%s) - start )) s ($(du -h "$tmp/rootfs.tar" | cut -f1) rootfs)"
