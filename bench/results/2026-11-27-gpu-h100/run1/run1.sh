#!/usr/bin/env bash
# Run 1: correctness + device tests + ceilings (gpu_run.sh), then the step diagnostics, then the Triton cache.
OUT=$1
T0=$(date +%s)
tools/gpu_run.sh "$OUT" --shared .gpu-shared --speed ceilings --budget 300
echo "[$(( $(date +%s) - T0 )) s] gpu_run done"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout -k 5 130 python3 .gpu-extra/prof.py "$OUT" > "$OUT/prof.log" 2>&1; echo "prof rc $?"
tail -5 "$OUT/prof.log"
echo "[$(( $(date +%s) - T0 )) s] prof done"
( cd "$OUT" && ls trace-*.json >/dev/null 2>&1 && tar czf traces.tgz trace-*.json && rm -f trace-*.json )
C=${TRITON_CACHE_DIR:-/root/.triton/cache}; du -sh $C
tar czf /tmp/tcache.tgz -C $(dirname $C) $(basename $C) 2>/dev/null; ls -la /tmp/tcache.tgz; [ $(stat -c %s /tmp/tcache.tgz) -lt 45000000 ] && split -b 15M /tmp/tcache.tgz "$OUT/tcache.tgz."
ls -la "$OUT"
echo "[$(( $(date +%s) - T0 )) s] all done"
