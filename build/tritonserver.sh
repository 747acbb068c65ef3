#!/usr/bin/env bash
# Run the tritonserver installed by build/install_tritonserver.sh, with a venv as the Python-backend env.
#
# Usage: build/tritonserver.sh [tritonserver args...]     e.g. --model-repository=model_repository
#   KEV_VENV     the project's venv (default: <repo>/.venv). The python stub runs in KEV_VENV/stub where that exists
#                (TORCH=system: build/venv.sh), else in KEV_VENV; that environment needs numpy<2 (2.51's stub breaks on
#                numpy 2)
#   TRITON_HOME  install dir (default: build/.tritonserver)
# --backend-directory (and --cache-directory) are put before your args; a later repeat of a flag overrides it.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=$(realpath -m "${KEV_VENV:-$here/../.venv}")
home=$(realpath -m "${TRITON_HOME:-$here/.tritonserver}")

if [[ ! -x $home/bin/tritonserver || ! -e $home/.installed ]]; then
  echo "error: no tritonserver in $home; run: $here/install_tritonserver.sh $venv $home" >&2
  exit 1
fi
[[ -x $venv/bin/python ]] || { echo "error: $venv/bin/python not found (set KEV_VENV)" >&2; exit 1; }
[[ ! -x $venv/stub/bin/python ]] || venv=$venv/stub

# One interpreter call: python minor, the base interpreter's LIBDIR, numpy version (metadata only, no import).
# (Command substitution, not `< <(...)`: that child would outlive the exec below as a zombie of tritonserver.)
info=$("$venv/bin/python" -c '
import sys, sysconfig
from importlib import metadata
try:
    np = metadata.version("numpy")
except metadata.PackageNotFoundError:
    np = "missing"
print(f"{sys.version_info[0]}.{sys.version_info[1]}", sysconfig.get_config_var("LIBDIR"), np)')
read -r minor libdir numpy <<<"$info"
read -r _ stub_minor <"$home/.installed"
if [[ $minor != "$stub_minor" ]]; then
  echo "error: $home has the python $stub_minor stub but $venv is python $minor; reinstall" >&2
  exit 1
fi
# triton_python_backend_utils imports numpy; numpy>=2 corrupts BYTES tensors in the 2.51 stub (pybind11 2.10).
if [[ $numpy == missing || ${numpy%%.*} -ge 2 ]]; then
  echo "error: $venv needs numpy<2 for the tritonserver 2.51 python stub (found: $numpy)" >&2
  exit 1
fi

# The stub ignores PYTHONPATH/VIRTUAL_ENV (isolated config); it takes sys.prefix from the python3 found on PATH.
export PATH="$venv/bin:$PATH"
# lib/: bundled libs, needed by the stub and libtriton_python.so (their RPATH points into the wheel layout).
# libdir: the venv's own libpython3.X.so.1.0 (pyenv builds it shared), so the stub embeds the same patch
# release as the venv rather than whatever system libpython of that minor the loader would find.
ld="$home/lib"
if [[ -e $libdir/libpython$minor.so.1.0 ]]; then ld="$ld:$libdir"; fi
export LD_LIBRARY_PATH="$ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

args=(--backend-directory="$home/backends")
if [[ -d $home/caches ]]; then args+=(--cache-directory="$home/caches"); fi
exec "$home/bin/tritonserver" "${args[@]}" "$@"
