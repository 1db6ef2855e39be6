#!/bin/bash
# Fresh clones; each venv built from nothing (the machine's pip cache and local wheel folders as they are).
set -u
out=/tmp/gr_install_measure.txt
: > $out
for kind in lean full; do
  dir=/tmp/gr_clone_$kind
  rm -rf $dir
  if [ $kind = lean ]; then git clone -q -b gpu-runtime /work/wt/gpu-runtime $dir; target=.venv/.runtime; else git clone -q -b main /work/wt/gpu-runtime $dir; target=venv; fi
  cd $dir
  load=$(cut -d' ' -f1 /proc/loadavg)
  start=$(date +%s.%N)
  make $target > /tmp/gr_install_$kind.log 2>&1; rc=$?
  end=$(date +%s.%N)
  size=$(du -sb .venv | cut -f1)
  pkgs=$(.venv/bin/python -m pip list 2>/dev/null | tail -n +3 | wc -l)
  echo "$kind rc=$rc seconds=$(echo "$end - $start" | bc) bytes=$size packages=$pkgs load_at_start=$load" >> $out
done
