# Two commands on a fresh machine: `make serve` and `make test`. Each runs `setup` first; setup is idempotent
# (a stamp file), so later runs skip it unless its inputs changed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := .stamps/setup
EMBEDDED := model_repository/kev/embedded
export HTTP_PORT ?= 8000
export GRPC_PORT ?= 8001
export METRICS_PORT ?= 8002
export GATEWAY_PORT ?= 8009
export GATEWAY ?= 1

.PHONY: setup serve test lint bench clean

setup: $(STAMP)

$(STAMP): requirements.txt requirements-test.txt pyproject.toml build/install_tritonserver.sh kev_backend/dev/tiny.py kev_backend/model/qwen35.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-test.txt
	$(PY) -m pip install --quiet --no-deps -e .
	build/install_tritonserver.sh $(VENV) build/.tritonserver
	rm -rf $(EMBEDDED) && $(PY) -m kev_backend.dev.tiny $(EMBEDDED)
	mkdir -p $(dir $(STAMP)) && touch $@

serve: setup
	KEV_VENV=$(abspath $(VENV)) build/serve.sh

test: setup lint
	$(PY) -m pytest -q -rs tests

lint: setup
	$(VENV)/bin/ruff check kev_backend tests model_repository loadtest bench
	$(VENV)/bin/ruff format --check kev_backend tests model_repository loadtest bench

# GPU benchmark, in-process (on the GPU machine: the image's python3 with fla-core from requirements-gpu.txt).
bench:
	$(if $(wildcard $(PY)),$(PY),python3) -m kev_backend.dev.bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .stamps build/.tritonserver build/.downloads $(EMBEDDED)
