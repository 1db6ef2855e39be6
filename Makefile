# pipeserve developer entry points. Every target creates .venv on first use, through tools/install.py:
# a torch already installed (in .venv, or a CUDA build in $(PY)'s site-packages, which .venv then sees)
# is kept and never upgraded, and with a wheelhouse/ folder (`make wheelhouse`) nothing is downloaded.
# Triton comes with a CUDA torch or the dev extra (the tests), not beside a CPU torch; pip writes no
# bytecode at install time (Python does, on first import).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# What each kind of target needs: serving takes the runtime dependencies only (add EXTRAS=ray for
# `--ray`); tests and linters take the dev, bench and ray extras; benchmarks the bench extra.
RUNTIME = $(VENV)/.runtime$(EXTRAS:%=-%)
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench
TORCH_VERSION ?= 2.13.0
WHEELHOUSE ?= wheelhouse
PYTHON_VERSION ?= $(shell $(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
EXTRAS ?=
INSTALL := $(PY) tools/install.py venv $(VENV) --editable --no-compile --torch-version $(TORCH_VERSION) \
	--wheelhouse $(WHEELHOUSE)
MODEL ?=
HOST ?= 127.0.0.1
PORT ?= 50051
HTTP_PORT ?= 8000
WORKERS ?= 2
PYTEST_ARGS ?=
BENCH_ARGS ?= --help
GPU_CHECK_OUT ?= bench/results/$(shell date +%F)-gpu-check
GPU_CHECK_ARGS ?=
DOCKER_PACKAGES := docker.io docker-compose debootstrap

.PHONY: serve bench wheelhouse test test-fast test-gpu gpu-check lint venv proto clean

# Each stamp names the extras it installed; a later target with more extras installs the rest.
$(RUNTIME): pyproject.toml tools/install.py
	$(INSTALL) $(if $(EXTRAS),--extras $(EXTRAS))
	touch $(RUNTIME)

$(STAMP): pyproject.toml tools/install.py
	$(INSTALL) --extras dev,bench,ray
	touch $(STAMP) $(RUNTIME) $(BENCH_STAMP)

$(BENCH_STAMP): pyproject.toml tools/install.py
	$(INSTALL) --extras bench
	touch $(BENCH_STAMP) $(RUNTIME)

venv: $(STAMP)

proto: $(STAMP)
	$(BIN)/python -m pipeserve.gateway.proto

serve: $(RUNTIME)
	$(BIN)/pipeserve up $(if $(MODEL),--model $(MODEL)) --host $(HOST) --port $(PORT) --http-port $(HTTP_PORT) --tokenizer-workers $(WORKERS)

# `make bench BENCH_ARGS="offline --out bench/results/..."`: pipeserve bench with the bench extra.
bench: $(BENCH_STAMP)
	$(BIN)/pipeserve bench $(BENCH_ARGS)

# Wheels of every runtime dependency but torch and triton (and of EXTRAS), for PYTHON_VERSION on
# manylinux x86-64, into $(WHEELHOUSE)/: carry the checkout with it to a host without network.
wheelhouse:
	$(PY) tools/install.py wheelhouse $(WHEELHOUSE) --python-version $(PYTHON_VERSION) $(if $(EXTRAS),--extras $(EXTRAS))

# The whole suite, after ruff and the type checker (CI runs this target): every test but those marked
# serial spread over the cores, each test file on one worker, then the serial ones alone (they time
# themselves, or share one server across files).
test: lint
	# Docker (Debian packages) for the compose tests: they validate compose.yaml and run the deployment
	# (tests/docker_env.py starts dockerd). Best effort: without root they skip and say why.
	command -v docker-compose >/dev/null 2>&1 && command -v dockerd >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1 || \
	  (apt-get install -y -qq $(DOCKER_PACKAGES) >/dev/null 2>&1 || \
	  (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $(DOCKER_PACKAGES) >/dev/null 2>&1) || true)
	# Exit status 5 is "no test selected": a PYTEST_ARGS filter (-k ...) may leave one half empty.
	$(BIN)/python -m pytest -m "not serial" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) || test $$? -eq 5
	$(BIN)/python -m pytest -m serial $(PYTEST_ARGS) || test $$? -eq 5

# Everything but the tests marked slow (process pipelines, soak, faults, interpreter end to end), one
# pytest-xdist worker per core, each test file on one worker (its module fixtures built once).
TEST_WORKERS ?= auto
FAST_TESTS = $(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
test-fast: $(STAMP)
	$(FAST_TESTS)

# On a CUDA host: the tests that make sense on a GPU (marked `device`: kernels, Triton engine runs) on
# the GPU, Triton compiled; PYTEST_ARGS adds -k, -x, ...
test-gpu: $(STAMP)
	PIPESERVE_TEST_DEVICE=cuda $(BIN)/python -m pytest -m device $(PYTEST_ARGS)

# On a CUDA host: kernels vs references, engine parity, one sync per step and the speed rows, written
# to $(GPU_CHECK_OUT) (GPU_CHECK_ARGS=--quick for the correctness sections only). docs/gpu.md.
# The runtime install, as `serve`: the host's CUDA torch is kept, wheelhouse/ used when there is one.
gpu-check: $(RUNTIME)
	$(BIN)/pipeserve gpu-check --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy pipeserve

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
