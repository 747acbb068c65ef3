#!/usr/bin/env bash
# Download every wheel the project needs into one directory (a wheelhouse), on a connected machine, so that a machine
# or an image build with no network installs it all: `make setup WHEELHOUSE=DIR`, the Dockerfile (`make image`).
#
# Usage: build/wheelhouse.sh DIR            (what `make wheelhouse` runs; DIR defaults to build/wheelhouse there)
# Environment (the Makefile's variables of the same names):
#   WHEEL_PYTHON    target Python minor (default: this python3's), e.g. 3.11 for Debian bookworm and the image
#   WHEEL_PLATFORM  target platform tag (default manylinux_2_35_x86_64: tritonserver 2.51 needs glibc >= 2.35 anyway;
#                   pip also takes every older manylinux tag, e.g. torch's manylinux_2_28 wheels)
#   WHEEL_TORCH     cpu (default), cuda or system. cpu pins torch to its +cpu build, which is on the PyTorch CPU
#                   index, not on PyPI (set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu, unless pip's own
#                   configuration finds it), and adds requirements-cpu.txt with the test set; cuda takes the measured
#                   GPU stack, requirements-gpu.txt (torch's CUDA build and its nvidia-* wheels, several GB); system is for a target
#                   whose python brings its own torch (`make setup TORCH=system`): no torch stack, requirements-gpu.txt
#                   added, and with WHEEL_HAVE nothing the target already has
#   WHEEL_HAVE      (system) a `pip freeze` of the target's python: those projects are used there as they are and
#                   left out here (numpy<2 always comes from here: the tritonserver 2.51 stub needs it)
#   WHEEL_SETS      which requirement sets: "serve test" (default: requirements.txt, requirements-bench.txt and
#                   requirements-test.txt), "serve" (requirements.txt only: the image, a server that runs no tests),
#                   "serve bench" (a server and the benchmark tools: the GPU benchmark scripts)
#   TORCH_INDEX_URL an extra index for torch alone's sake (e.g. the PyTorch CPU index); none by default
# Always added: setuptools (the build backend of `pip install -e .`) and tritonserver for WHEEL_PYTHON's stub, trimmed
# from the nvidia-pytriton wheel to what build/install_tritonserver.sh installs (nvidia_pytriton-VERSION-pyMINOR.tar.xz,
# ~26 MB instead of the wheel's 55; PYTRITON_WHEELHOUSE=DIR; it is not pip-installed).
# Written into DIR: the wheels, manifest.json (targets, requirement files and each wheel's sha256), SHA256SUMS
# (`sha256sum -c SHA256SUMS` in DIR checks it) and a .gitignore that keeps DIR out of git. Wheels already in DIR are
# kept (pip skips them): rerunning is cheap. Afterwards the set is checked for completeness offline: a dry-run
# resolution with --no-index against DIR alone, for the target Python and platform (not for system, whose target
# supplies part of the set: its own install is the check).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
dir=$(realpath -m "$1")
python=${PYTHON:-python3}
py=${WHEEL_PYTHON:-$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
platform=${WHEEL_PLATFORM:-manylinux_2_35_x86_64}
torch_variant=${WHEEL_TORCH:-cpu}
sets=${WHEEL_SETS:-serve test}
pytriton_version=$(sed -n 's/^VERSION=//p' "$here/install_tritonserver.sh")
pytriton=nvidia-pytriton==$pytriton_version

case $torch_variant in
  cpu | cuda | system) ;;
  *) echo "error: WHEEL_TORCH must be cpu, cuda or system, not $torch_variant" >&2; exit 2 ;;
esac
[[ $py =~ ^3\.[0-9]+$ ]] || { echo "error: WHEEL_PYTHON must look like 3.11, not $py" >&2; exit 2; }
files=()
for set in $sets; do
  case $set in
    serve) files+=(requirements.txt) ;;
    bench) ;;
    test) files+=(requirements-test.txt) ;;
    *) echo "error: unknown WHEEL_SETS entry $set (serve, bench, test)" >&2; exit 2 ;;
  esac
done
# bench: the benchmark tools; the test set needs them too.
[[ " $sets " != *" bench "* && " $sets " != *" test "* ]] || files+=(requirements-bench.txt)
if [[ $torch_variant == cpu ]]; then
  [[ " $sets " != *" test "* ]] || files+=(requirements-cpu.txt)
else
  files+=(requirements-gpu.txt)
fi
[[ ${#files[@]} -gt 0 ]] || { echo "error: WHEEL_SETS selects no requirement file" >&2; exit 2; }

mkdir -p "$dir"
echo '*' >"$dir/.gitignore"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Pins: the requirement files as they are, plus the torch build and the build backend.
torch_pin=$(sed -n 's/^torch==\([^ ;#]*\).*/\1/p' "$repo/requirements.txt")
[[ -n $torch_pin ]] || { echo "error: requirements.txt pins no torch==" >&2; exit 1; }
setuptools_pin=setuptools==80.9.0
# One line a project (build/requirements.py: requirements-gpu.txt's torch, the measured GPU stack, replaces
# requirements.txt's CPU build).
(cd "$repo" && "$python" build/requirements.py "${files[@]}") >"$tmp/requirements.txt"
reqs=(-r "$tmp/requirements.txt")
extra=("$setuptools_pin")
pipenv=(env)
have=/dev/null
if [[ $torch_variant == system ]]; then
  [[ -z ${WHEEL_HAVE:-} ]] || have=$(realpath "$WHEEL_HAVE")
  (cd "$repo" && "$python" build/requirements.py --have "$have" "${files[@]}") >"$tmp/requirements.txt"
  reqs=(-r "$tmp/requirements.txt")
elif [[ $torch_variant == cpu ]]; then
  extra+=("torch==${torch_pin%%+*}+cpu")
else
  # PyPI's torch is the CUDA build; a +cpu wheel that pip's configuration can see (find-links) would sort above it.
  pipenv=(env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null)
fi
index=(); [[ -z ${TORCH_INDEX_URL:-} ]] || index=(--extra-index-url "$TORCH_INDEX_URL")
# pip (23.x) takes a --platform literally: every older manylinux tag the target also runs is listed here.
target=(--only-binary=:all: --python-version "$py" --implementation cp --platform "$platform")
if [[ $platform =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
  glibc=${BASH_REMATCH[1]} arch=${BASH_REMATCH[2]}
  for ((y = glibc - 1; y >= 5; y--)); do target+=(--platform "manylinux_2_${y}_$arch"); done
  ((glibc < 17)) || target+=(--platform "manylinux2014_$arch")
  ((glibc < 12)) || target+=(--platform "manylinux2010_$arch")
  target+=(--platform "manylinux1_$arch")
fi

echo "wheelhouse $dir: python $py, $platform, torch $torch_variant, ${files[*]} + ${extra[*]} + $pytriton"
"${pipenv[@]}" "$python" -m pip download --quiet --dest "$dir" "${target[@]}" "${index[@]}" "${reqs[@]}" "${extra[@]}"
if [[ $torch_variant == system ]]; then
  # What the target has stays out of DIR, with the exceptions build/requirements.py gives.
  (cd "$repo" && "$python" build/requirements.py --have "$have" --prune "$dir")
fi
# tritonserver for WHEEL_PYTHON's stub, trimmed from its wheel (py3-none-manylinux_2_35: its own tag, no
# dependencies; downloaded once into build/.downloads).
"$python" -m pip download --quiet --dest "$here/.downloads" --no-deps --only-binary=:all: \
  --platform manylinux_2_35_x86_64 "$pytriton"
rm -f "$dir"/nvidia_pytriton-*.whl
server=$dir/nvidia_pytriton-$pytriton_version-py$py.tar.xz
[[ -s $server ]] || "$here/install_tritonserver.sh" --trimmed "$here/.downloads/nvidia_pytriton-$pytriton_version-"*.whl \
  "$py" "$server"

echo '{"install": []}' >"$tmp/report.json"
if [[ $torch_variant != system ]]; then
  # Complete? Resolve everything again from DIR alone, no index, no other find-links, nothing installed.
  env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL PIP_CONFIG_FILE=/dev/null \
    "$python" -m pip install --quiet --dry-run --ignore-installed --no-index --find-links "$dir" "${target[@]}" \
    --target "$tmp/none" --report "$tmp/report.json" "${reqs[@]}" "${extra[@]}"
fi

"$python" - "$dir" "$tmp/report.json" "$py" "$platform" "$torch_variant" "$repo" "${files[@]}" <<'PY'
import datetime, hashlib, json, os, sys
from pathlib import Path

directory, report, py, platform, torch, repo, *files = sys.argv[1:]
directory, repo = Path(directory), Path(repo)
def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
needed = {item["download_info"]["url"].rsplit("/", 1)[-1] for item in json.load(open(report))["install"]}
wheels = sorted([*directory.glob("*.whl"), *directory.glob("nvidia_pytriton-*.tar.xz")])
manifest = {
    "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "python": py,
    "platform": platform,
    "torch": torch,
    "requirements": {f: sha256(repo / f) for f in files},
    "install": f"pip install --no-index --find-links {directory.name} " + " ".join(f"-r {f}" for f in files),
    "wheels": [
        {"file": p.name, "bytes": p.stat().st_size, "sha256": sha256(p), "resolved": p.name in needed}
        for p in wheels
    ],
}
(directory / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
(directory / "SHA256SUMS").write_text("".join(f"{w['sha256']}  {w['file']}\n" for w in manifest["wheels"]))
total = sum(w["bytes"] for w in manifest["wheels"])
checked = (
    f"{len(needed)} resolve offline for python {py} on {platform}"
    if torch != "system"
    else "not resolved here: the rest is the target's own (WHEEL_HAVE)"
)
print(f"{len(wheels)} wheels, {total / 2**20:.0f} MiB; {checked}")
PY
