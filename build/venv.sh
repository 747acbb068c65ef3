#!/usr/bin/env bash
# Create the project's virtual environment VENV with PYTHON, once.
#   build/venv.sh VENV PYTHON pip|system
# pip: a plain venv; setup installs the pinned torch and numpy<2 into it, and the tritonserver 2.51 Python stub runs
# in it too.
# system: the venv also sees PYTHON's own packages (its torch, CUDA libraries, numpy and the rest: a GPU server's or
# a vendor image's stack) after its own, through a .pth file; a .pth and not --system-site-packages, which would
# expose the base installation's packages, not those of PYTHON when PYTHON is itself a venv, as vendor images often
# ship it. Such a stack is built for numpy 2, which the 2.51 stub cannot use (it corrupts BYTES tensors), and
# numpy<2 would break the stack's own packages (scipy, and transformers through it). So the stub gets an
# environment of its own, VENV/stub: numpy<2 (setup installs it), then everything VENV sees.
set -euo pipefail
[[ $# -eq 3 ]] || { echo "usage: $0 VENV PYTHON pip|system" >&2; exit 2; }
venv=$1 python=$2 torch=$3
case $torch in pip | system) ;; *) echo "error: TORCH must be pip or system, not $torch" >&2; exit 2 ;; esac
[[ -x $venv/bin/python ]] || "$python" -m venv "$venv"
purelib() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
site=$(purelib "$venv")
if [[ $torch == system ]]; then
  "$python" -c 'import site, sys; print("\n".join(p for p in site.getsitepackages() if p not in sys.path[:1]))' \
    >"$site/system-torch.pth"
  "$venv/bin/python" -c 'import torch; print("TORCH=system:", torch.__version__, "from", torch.__file__)'
  [[ -x $venv/stub/bin/python ]] || "$python" -m venv "$venv/stub"
  # An `import` line of a .pth runs at start-up: VENV's site, with its own .pth files (the project's editable
  # install, system-torch.pth), comes after the stub's numpy.
  echo "import site; site.addsitedir('$site')" >"$(purelib "$venv/stub")/kev-venv.pth"
else
  rm -rf "$site/system-torch.pth" "$venv/stub"
fi
