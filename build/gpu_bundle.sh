#!/usr/bin/env bash
# What a device call needs to run the real tritonserver on the GPU machine (no network there; its image has
# python 3.12 with numpy 2, which the 2.51 stub cannot use), assembled here into .gpu/ (git-excluded, ~50 MB, under
# the 64 MiB a call carries with the tree and .whl/):
#   .gpu/tritonserver-py312.tar.xz  the nvidia-pytriton 0.7.0 server: bin, backends, caches, the 3.12 stub and the
#                                   bundled libraries (without the 3.13 libpython, which only the 3.13 stub needs)
#   .gpu/wheels/                    numpy 1.26.4 (cp312) for the stub's venv, tritonclient with what its HTTP client
#                                   needs and the image lacks (gevent, geventhttpclient, greenlet, zope.*, brotli),
#                                   python-rapidjson and jevbench (the realistic mix)
# Usage on the device: bench/gpu_triton.sh (carry .gpu and .whl).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
wheel=build/.downloads/nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl
[[ -f $wheel ]] || python3 -m pip download -q --no-deps --only-binary=:all: nvidia-pytriton==0.7.0 -d build/.downloads
mkdir -p .gpu/wheels
if [[ ! -f .gpu/tritonserver-py312.tar.xz ]]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && unzip -q "$OLDPWD/$wheel" 'pytriton/tritonserver/bin/*' 'pytriton/tritonserver/backends/*' \
    'pytriton/tritonserver/caches/*' 'pytriton/tritonserver/python_backend_stubs/3.12/*' 'nvidia_pytriton.libs/*' \
    && rm -f nvidia_pytriton.libs/libpython3*13* && tar -cJf "$OLDPWD/.gpu/tritonserver-py312.tar.xz" pytriton \
    nvidia_pytriton.libs)
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/wheels \
  numpy==1.26.4 tritonclient==2.73.0 python-rapidjson==1.20 jevbench==0.1.0 \
  gevent==26.9.0 geventhttpclient==2.6.1 greenlet==3.3.2 zope.event==6.2 zope.interface==8.7 brotli==1.2.1
du -sh .gpu .gpu/* .gpu/wheels/*
