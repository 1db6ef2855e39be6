# pipeserve developer entry points. Every target creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL ?=
HOST ?= 127.0.0.1
PORT ?= 50051
HTTP_PORT ?= 8000
WORKERS ?= 2
PYTEST_ARGS ?=
GPU_CHECK_OUT ?= bench/results/$(shell date +%F)-gpu-check
GPU_CHECK_ARGS ?=
DOCKER_PACKAGES := docker.io docker-compose debootstrap

.PHONY: serve test test-fast test-gpu gpu-check lint venv proto clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	# torch first, pinned, so pip takes the CPU build on disk instead of pulling CUDA wheels.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,bench,ray]'
	touch $(STAMP)

venv: $(STAMP)

proto: $(STAMP)
	$(BIN)/python -m pipeserve.gateway.proto

serve: $(STAMP)
	$(BIN)/pipeserve up $(if $(MODEL),--model $(MODEL)) --host $(HOST) --port $(PORT) --http-port $(HTTP_PORT) --tokenizer-workers $(WORKERS)

# The whole suite, after ruff and the type checker (CI runs this target).
test: lint
	# Docker (Debian packages) for the compose tests: they validate compose.yaml and run the deployment
	# (tests/docker_env.py starts dockerd). Best effort: without root they skip and say why.
	command -v docker-compose >/dev/null 2>&1 && command -v dockerd >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1 || \
	  (apt-get install -y -qq $(DOCKER_PACKAGES) >/dev/null 2>&1 || \
	  (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $(DOCKER_PACKAGES) >/dev/null 2>&1) || true)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Everything but the tests marked slow (process pipelines, soak, faults, interpreter end to end).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# On a CUDA host: the tests that make sense on a GPU (marked `device`: kernels, Triton engine runs) on
# the GPU, Triton compiled; PYTEST_ARGS adds -k, -x, ...
test-gpu: $(STAMP)
	PIPESERVE_TEST_DEVICE=cuda $(BIN)/python -m pytest -m device $(PYTEST_ARGS)

# On a CUDA host: kernels vs references, engine parity, one sync per step and the speed rows, written
# to $(GPU_CHECK_OUT) (GPU_CHECK_ARGS=--quick for the correctness sections only). docs/gpu.md.
gpu-check: $(STAMP)
	$(BIN)/pipeserve gpu-check --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy pipeserve

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
