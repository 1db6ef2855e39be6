#!/usr/bin/env bash
# Wheels of the runtime dependencies a lent GPU host lacks (Python 3.12, manylinux x86-64, no
# network there), into DIR (default .whl, git-ignored), at the versions of this checkout's .venv:
#
#   tools/gpu_wheels.sh [DIR]        # then: tools/gpu_run.sh OUT --wheels DIR ...
#
# The host's image has torch, triton, transformers, numpy, msgpack, uvloop, protobuf, prometheus-client
# and the test tools; it lacks these (or holds an older grpcio than the generated health stubs need).
# Each is fetched without its dependencies (pip's resolver would pull torch); the list holds theirs.
set -eu
DIR=${1:-.whl}
PY=${PYTHON:-.venv/bin/python}
PACKAGES="pyzmq grpcio grpcio-health-checking grpcio-reflection setproctitle fastapi starlette pydantic
pydantic-core annotated-types typing-inspection opentelemetry-api uvicorn httptools xgrammar apache-tvm-ffi
jsonschema jsonschema-specifications referencing rpds-py"
mkdir -p "$DIR"
for name in $PACKAGES; do
  version=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux1_x86_64 \
    -d "$DIR" "$name==$version"
done
ls "$DIR"
