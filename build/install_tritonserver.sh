#!/usr/bin/env bash
# Install the real tritonserver 2.51 (the binary bundled in the nvidia-pytriton 0.7.0 wheel) into DEST,
# without pip-installing the wheel or any of its Python dependencies.
#
# Usage: build/install_tritonserver.sh VENV DEST      (e.g. .venv build/.tritonserver)
#        build/install_tritonserver.sh --trimmed WHEEL MINOR OUT.tar.xz    (build/wheelhouse.sh: the archive below)
#   VENV  venv that will be the Python-backend model env; its python minor (3.8-3.13) picks the stub.
#   DEST  install dir. Resulting layout:
#           bin/tritonserver
#           lib/                     the wheel's nvidia_pytriton.libs (hash-suffixed sonames, no clashes)
#           backends/python/         libtriton_python.so, triton_python_backend_utils.py,
#                                    triton_python_backend_stub (for VENV's python minor)
#           caches/local/            libtritoncache_local.so (response cache)
#           .installed               "<wheel spec> <python minor>": idempotency stamp, read by tritonserver.sh
# PYTRITON_WHEELHOUSE=DIR: take the server from DIR (a wheelhouse made by build/wheelhouse.sh) and never download it:
# the wheel, or the trimmed archive nvidia_pytriton-VERSION-pyMINOR.tar.xz that build/wheelhouse.sh writes (the same
# paths, only what is installed here: half the size). Without it the wheel is downloaded into build/.downloads once.
# Run the server with build/tritonserver.sh: the stub and the backend .so only find lib/ through
# LD_LIBRARY_PATH (their RPATH is $ORIGIN/../../../../nvidia_pytriton.libs, i.e. the wheel's site-packages layout).
set -euo pipefail

VERSION=0.7.0
SPEC=nvidia-pytriton==$VERSION

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
downloads=$here/.downloads
stubs=pytriton/tritonserver/python_backend_stubs

# extract SOURCE MINOR DIR: what is installed (the server, its backends and caches, MINOR's stub, the bundled
# libraries) from the wheel or a trimmed archive into DIR, in the wheel's own paths.
extract() {
  local source=$1 minor=$2 dir=$3 listing
  mkdir -p "$dir"
  if [[ $source == *.tar.xz ]]; then
    tar -xJf "$source" -C "$dir"
  else
    # No `unzip | grep -q` pipe: grep -q exits early, unzip gets SIGPIPE and pipefail turns a match into a failure.
    listing=$(unzip -Z1 "$source")
    if ! grep -qx "$stubs/$minor/triton_python_backend_stub" <<<"$listing"; then
      echo "error: the wheel has no python backend stub for python $minor; it has:" >&2
      grep "^$stubs/.*/triton_python_backend_stub" <<<"$listing" >&2
      exit 1
    fi
    local excludes=()
    # The 31 MB bundled libpython3.13 is only needed by the 3.13 stub (the others link the system's libpython).
    [[ $minor == 3.13 ]] || excludes=(-x 'nvidia_pytriton.libs/libpython3-*')
    unzip -q -d "$dir" "$source" 'pytriton/tritonserver/bin/*' 'pytriton/tritonserver/backends/*' \
      'pytriton/tritonserver/caches/*' "$stubs/$minor/*" 'nvidia_pytriton.libs/*' "${excludes[@]}"
  fi
  if [[ ! -e $dir/$stubs/$minor/triton_python_backend_stub ]]; then
    echo "error: $source has no python backend stub for python $minor" >&2
    exit 1
  fi
}

trim=
if [[ ${1:-} == --trimmed ]]; then
  # build/wheelhouse.sh: the trimmed archive of WHEEL for python MINOR.
  [[ $# -eq 4 ]] || { echo "usage: $0 --trimmed WHEEL MINOR OUT.tar.xz" >&2; exit 2; }
  trim_wheel=$(realpath "$2") trim_minor=$3 trim=$(realpath -m "$4")
else
  [[ $# -eq 2 ]] || { echo "usage: $0 VENV DEST | --trimmed WHEEL MINOR OUT.tar.xz" >&2; exit 2; }
  venv=$(realpath "$1")
  dest=$(realpath -m "$2")
  minor=$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  stamp="$SPEC $minor"
fi

if [[ -n $trim ]]; then
  mkdir -p "$downloads"
  tmp=$(mktemp -d "$downloads/trim.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  extract "$trim_wheel" "$trim_minor" "$tmp"
  mkdir -p "$(dirname "$trim")"
  (cd "$tmp" && tar -cf - pytriton nvidia_pytriton.libs | xz -T0 -6 >"$trim.part") && mv "$trim.part" "$trim"
  echo "wrote $trim ($(du -h "$trim" | cut -f1)): the server for python $trim_minor"
  exit 0
fi

if [[ -x $dest/bin/tritonserver && "$(cat "$dest/.installed" 2>/dev/null)" == "$stamp" ]]; then
  echo "tritonserver already installed in $dest ($stamp)"
  exit 0
fi
# DEST gets replaced as a whole: refuse to delete a non-empty directory that we did not create.
if [[ -d $dest && ! -e $dest/.installed && -n "$(ls -A "$dest")" ]]; then
  echo "error: $dest is not empty and has no .installed stamp; refusing to replace it" >&2
  exit 1
fi

mkdir -p "$downloads"
shopt -s nullglob
if [[ -n ${PYTRITON_WHEELHOUSE:-} ]]; then
  wheels=("$PYTRITON_WHEELHOUSE/nvidia_pytriton-$VERSION-"*.whl "$PYTRITON_WHEELHOUSE/nvidia_pytriton-$VERSION-py$minor.tar.xz")
  if [[ ${#wheels[@]} -eq 0 ]]; then
    echo "error: no nvidia_pytriton-$VERSION-*.whl or -py$minor.tar.xz in $PYTRITON_WHEELHOUSE (make wheelhouse)" >&2
    exit 1
  fi
else
  wheels=("$downloads/nvidia_pytriton-$VERSION-"*.whl)
fi
if [[ ${#wheels[@]} -eq 0 ]]; then
  "$venv/bin/pip" download --no-deps --only-binary=:all: "$SPEC" -d "$downloads"
  wheels=("$downloads/nvidia_pytriton-$VERSION-"*.whl)
fi
wheel=${wheels[0]}

# Extract next to the wheel (git-ignored), assemble there, then swap into DEST.
tmp=$(mktemp -d "$downloads/extract.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
extract "$wheel" "$minor" "$tmp/x"

src=$tmp/x/pytriton/tritonserver
new=$tmp/new
mkdir -p "$new/backends"
mv "$src/bin" "$new/bin"
mv "$tmp/x/nvidia_pytriton.libs" "$new/lib"
mv "$src/backends/python" "$new/backends/python"
mv "$tmp/x/$stubs/$minor/triton_python_backend_stub" "$new/backends/python/"
if [[ -d $src/caches ]]; then mv "$src/caches" "$new/caches"; fi
chmod -R u=rwX,go=rX "$new"   # the wheel ships bin/tritonserver world-writable (0777)
echo "$stamp" >"$new/.installed"

rm -rf "$dest"
mkdir -p "$(dirname "$dest")"
mv "$new" "$dest"
echo "installed tritonserver ($stamp) into $dest"
