#!/usr/bin/env bash
# The whole check of a GPU host with no network, in one command, each part under its own time limit,
# everything written under one folder and packed into OUT/gpu-run.tar.gz (a summary printed last):
#
#   tools/gpu_run.sh OUT [--wheels DIR] [--correctness SECTIONS] [--tests FILES] [--speed SECTIONS]
#                        [--budget SECONDS] [--shared DIR]
#
# 1. the wheels in DIR (Python 3.12, manylinux x86-64; default .whl) installed into a private folder:
#    the runtime dependencies the host lacks (tools/gpu_wheels.py fetches them);
# 2. at once, side by side (correctness only, so they may share the GPU): each gpu-check correctness
#    section in its own `pipeserve gpu-check --sections` (default environment,kernels,parity,serving,
#    sync), and the test files marked `device` on CUDA (pytest-xdist);
# 3. then alone, so nothing else runs on the GPU while it times: the speed sections in one gpu-check
#    (default ceilings,speed), stopped (SIGTERM: it writes what it measured) when the whole run
#    reaches its budget (default 540 s; under 300 s, the correctness parts are stopped 20 s before
#    it, the tests 60 s). "none" skips a part.
# --shared DIR: the test assets (models/stories260K, data/traces) for the tests that use them, e.g. a
# git-ignored copy carried with the checkout (they skip without it).
set -u
OUT=${1:?usage: tools/gpu_run.sh OUT [--wheels DIR] [--correctness S] [--tests FILES] [--speed S]}
shift
WHEELS=.whl
CORRECTNESS=environment,kernels,parity,serving,sync
SPEED=ceilings,speed
BUDGET=540
TESTS="tests/test_kernels_pointwise.py tests/test_kernels_moe.py tests/test_kernels_attention.py
tests/test_kernels_gemm.py tests/test_spec_decode.py tests/test_sampler.py tests/test_structured.py
tests/test_engine_parity.py tests/test_executor.py tests/test_quant_triton.py tests/test_kernels_e2e.py
tests/test_moe_parity.py tests/test_prefix_parity.py tests/test_kv_fp8.py tests/test_device_switch.py"
while [ $# -gt 0 ]; do
  case $1 in
    --wheels) WHEELS=$2 ;;
    --correctness) CORRECTNESS=$2 ;;
    --tests) TESTS=$2 ;;
    --speed) SPEED=$2 ;;
    --budget) BUDGET=$2 ;;
    --shared) export PIPESERVE_SHARED; PIPESERVE_SHARED=$(cd "$2" && pwd) ;;
    *) echo "gpu_run: unknown option $1" >&2; exit 2 ;;
  esac
  shift 2
done
PY=${PYTHON:-python3}
W=$(mktemp -d /tmp/gpu-run.XXXXXX)
START=$(date +%s)
stamp() { echo "[$(( $(date +%s) - START )) s] $*" | tee -a "$W/summary.txt"; }

if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl >"$W/wheels.log" 2>&1 || { stamp "wheels failed"; cat "$W/wheels.log"; }
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{ nvidia-smi; $PY -c 'import torch, triton, transformers, sys; print(sys.version, torch.__version__,
torch.version.cuda, triton.__version__, transformers.__version__)'; $PY -m pip list 2>/dev/null; } \
  >"$W/host.txt" 2>&1
stamp "host: $(grep -m1 -o 'NVIDIA [A-Z0-9]* [^|]*' "$W/host.txt" | head -1)"

# 2. correctness, side by side, each part stopped within the budget.
pids=()
limit=$(( BUDGET < 300 ? BUDGET - 20 : 280 ))
if [ "$CORRECTNESS" != none ]; then
  for section in ${CORRECTNESS//,/ }; do
    timeout -k 5 "$limit" $PY -m pipeserve.cli gpu-check --sections "$section" --out "$W/$section" \
      >"$W/$section.log" 2>&1 &
    pids+=($!)
  done
fi
if [ "$TESTS" != none ]; then
  # shellcheck disable=SC2086
  PIPESERVE_TEST_DEVICE=cuda timeout -k 5 $(( limit - 40 )) $PY -m pytest -m device -n 6 --dist loadfile -v -p no:cacheprovider \
    --timeout 150 --junitxml "$W/device-tests.xml" $TESTS >"$W/device-tests.log" 2>&1 &
  pids+=($!)
fi
for pid in "${pids[@]}"; do wait "$pid"; done
stamp "correctness done"

# 3. speed, alone.
if [ "$SPEED" != none ]; then
  left=$(( BUDGET - ($(date +%s) - START) - 15 ))
  stamp "speed: $left s left"
  timeout -k 20 "$left" $PY -m pipeserve.cli gpu-check --sections "$SPEED" --out "$W/speed" >"$W/speed.log" 2>&1
  stamp "speed done"
fi

# The summary: each gpu-check's section lines and failures, each table, the tests' tail.
for log in "$W"/*.log; do
  name=$(basename "$log" .log)
  [ "$name" = wheels ] && continue
  echo "== $name" >>"$W/summary.txt"
  if [ "$name" = device-tests ]; then
    grep -E '^(FAILED|ERROR)|passed|failed' "$log" | tail -40 >>"$W/summary.txt"
  else
    grep -E '^gpu-check:|^FAILED|^\|' "$log" >>"$W/summary.txt"
    grep -B2 -A12 'Traceback' "$log" | tail -30 >>"$W/summary.txt"
  fi
done
tar -czf "$OUT/gpu-run.tar.gz" -C "$W" .
cp "$W/summary.txt" "$OUT/summary.txt"
cat "$W/summary.txt"
