#!/usr/bin/env bash
# Create the project's virtual environment VENV with PYTHON, once. TORCH=system: the venv also sees PYTHON's own
# packages (its torch, CUDA libraries and the rest: a GPU server's or a vendor image's stack), after its own, through
# a .pth file; the venv's own packages come first, so its numpy<2 wins over a system numpy 2 (the tritonserver 2.51
# Python stub needs it). A .pth and not --system-site-packages: that would expose the base installation's packages,
# not those of PYTHON when PYTHON is itself a venv, as vendor images often ship it.
#   build/venv.sh VENV PYTHON pip|system
set -euo pipefail
[[ $# -eq 3 ]] || { echo "usage: $0 VENV PYTHON pip|system" >&2; exit 2; }
venv=$1 python=$2 torch=$3
case $torch in pip | system) ;; *) echo "error: TORCH must be pip or system, not $torch" >&2; exit 2 ;; esac
[[ -x $venv/bin/python ]] || "$python" -m venv "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [[ $torch == system ]]; then
  "$python" -c 'import site, sys; print("\n".join(p for p in site.getsitepackages() if p not in sys.path[:1]))' \
    >"$site/system-torch.pth"
  "$venv/bin/python" -c 'import torch; print("TORCH=system:", torch.__version__, "from", torch.__file__)'
else
  rm -f "$site/system-torch.pth"
fi
