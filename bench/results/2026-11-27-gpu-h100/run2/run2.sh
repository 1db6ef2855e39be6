#!/usr/bin/env bash
# Run 2: ceilings, speed and profile alone; then serving + parity beside the device tests that failed
# in run 1 (and the overlap tests).
OUT=$1
mkdir -p "$OUT/speed" "$OUT/correctness"
tools/gpu_run.sh "$OUT/speed" --correctness none --tests none --speed ceilings,speed,profile --budget 235
tools/gpu_run.sh "$OUT/correctness" --shared .gpu-shared --speed none --correctness serving,parity --budget 185 \
  --tests "tests/test_overlap.py tests/test_quant_triton.py tests/test_spec_decode.py tests/test_engine_parity.py tests/test_structured.py tests/test_executor.py"
